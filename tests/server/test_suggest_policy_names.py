"""Policies beyond none, every-2 and full on the wire: every-K and op (with its op list) are stored under their
canonical spelling, /suggest's ``activation_checkpointing`` matches them however the job spells them, and a
name that is not a policy is a 422 saying why, all torch-free (autotune.core.policy_names)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.factories import DEFAULT_DEVICE, FINGERPRINT
from tests.server.test_suggest_policy import SUGGEST, suggest, timing, upload

# torchtitan's list with two more ops: longer than the 16 characters the column held before migration 0004.
LONG_OP_LIST = "op:mm/addmm/_scaled_dot_product_flash_attention/_c10d_functional.reduce_scatter_tensor"


def test_every_k_and_op_lists_are_stored_and_matched_by_their_canonical_name(client: TestClient) -> None:
    every_4 = upload(client, "every-4", 12, None, seed=1)
    listed = upload(client, "op:aten.mm.default/addmm", 20, None, seed=2)
    long_list = upload(client, LONG_OP_LIST, 18, None, seed=3)
    assert client.get(f"/api/v1/profiles/{listed}").json()["profile"]["activation_checkpointing"] == "op:addmm/mm"
    got = suggest(client, activation_checkpointing="every-4")
    assert (got.profile_id, got.max_micro_batch) == (every_4, 12)
    # The job spells the op list its own way: the same policy answers.
    got = suggest(client, activation_checkpointing="op:addmm/aten.mm")
    assert (got.profile_id, got.activation_checkpointing) == (listed, "op:addmm/mm")
    got = suggest(client, activation_checkpointing=LONG_OP_LIST)
    assert got.profile_id == long_list and got.activation_checkpointing.startswith("op:_c10d_functional.")
    page = client.get("/api/v1/profiles", params={"activation_checkpointing": "op:mm/addmm"}).json()
    assert [item["id"] for item in page["items"]] == [listed]


def test_throughput_chooses_among_every_k_and_op(client: TestClient) -> None:
    upload(client, "none", 8, [timing(8, 0.4)], seed=1)
    upload(client, "every-3", 12, [timing(12, 0.5)], seed=2)
    op = upload(client, "op", 16, [timing(16, 0.55)], seed=3)
    got = suggest(client, objective="throughput")
    assert (got.profile_id, got.activation_checkpointing, got.accumulation_steps) == (op, "op", 6)
    assert any("'op' holds the target fastest" in w and "every-3:" in w for w in got.warnings)


def test_a_name_that_is_not_a_policy_is_a_422_saying_why(client: TestClient) -> None:
    upload(client, "none", 8, None, seed=1)
    for name, reason in [
        ("every-1", "that is full"),
        ("every-x", "whole number from 2 to 9999"),
        ("op:", "name the ops after the colon"),
        ("half", "unknown policy 'half'"),
    ]:
        response = client.get(
            SUGGEST,
            params={
                "fingerprint": FINGERPRINT,
                "device_name": DEFAULT_DEVICE,
                "target_batch": 96,
                "activation_checkpointing": name,
            },
        )
        assert response.status_code == 422 and reason in response.text, (name, response.text)
