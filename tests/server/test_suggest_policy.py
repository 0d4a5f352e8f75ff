"""The memory-policy dimension of /suggest: objective=memory answers from the job's own policy,
objective=throughput picks the stored policy whose plan is timed fastest and says it."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from autotune.core.schemas import Suggestion
from tests.factories import DEFAULT_DEVICE, FINGERPRINT, profile_payload
from tests.server.conftest import WRITE

SUGGEST = "/api/v1/suggest"


def timing(micro_batch: int, seconds: float, step_seconds: float = 0.1) -> dict[str, Any]:
    """A timed run: one micro-batch of ``micro_batch`` in ``seconds`` plus the step."""
    total = seconds + step_seconds
    return {
        "micro_batch": micro_batch,
        "samples_per_second": micro_batch / total,
        "seconds_per_update": total,
        "micro_batches": [[micro_batch, 1]],
        "micro_batch_seconds": [[micro_batch, seconds]],
        "step_seconds": step_seconds,
        "repeats": 3,
    }


def upload(
    client: TestClient, policy: str, max_micro_batch: int, timings: list[dict[str, Any]] | None, seed: int
) -> int:
    body = profile_payload(max_micro_batch=max_micro_batch, seed=seed)
    body["activation_checkpointing"] = policy
    body["throughput"] = timings
    response = client.post("/api/v1/profiles", json=body, headers=WRITE)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def suggest(client: TestClient, **params: object) -> Suggestion:
    query = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": 96, **params}
    response = client.get(SUGGEST, params=query)
    assert response.status_code == 200, response.text
    return Suggestion.model_validate(response.json())


def test_throughput_picks_the_faster_of_two_timed_policies(client: TestClient) -> None:
    # none: m_max 8, 12 steps of 8 at 0.4 s each = 4.9 s an update; full: m_max 24, 4 steps of 24
    # at 1.6 s (recomputation: more per sample) = 6.5 s. none is faster, though full needs fewer steps.
    plain = upload(client, "none", 8, [timing(8, 0.4)], seed=1)
    full = upload(client, "full", 24, [timing(24, 1.6)], seed=2)
    got = suggest(client, objective="throughput")
    assert (got.profile_id, got.activation_checkpointing) == (plain, "none")
    assert (got.micro_batch, got.accumulation_steps) == (8, 12)
    assert got.samples_per_second is not None and abs(got.samples_per_second - 96 / (12 * 0.4 + 0.1)) < 1e-3
    assert any("objective throughput" in w and "full:" in w for w in got.warnings)
    # Make full's forward+backward cheaper per sample and it wins, saying so.
    upload(client, "full", 24, [timing(24, 1.0)], seed=3)
    got = suggest(client, objective="throughput")
    assert got.activation_checkpointing == "full" and got.accumulation_steps == 4
    assert got.profile_id != full  # the newest full profile answers


def test_memory_answers_from_the_jobs_own_policy(client: TestClient) -> None:
    upload(client, "none", 8, None, seed=1)
    full = upload(client, "full", 24, None, seed=2)
    plain = suggest(client)
    assert (plain.activation_checkpointing, plain.max_micro_batch) == ("none", 8)
    got = suggest(client, activation_checkpointing="full")
    assert (got.profile_id, got.activation_checkpointing, got.max_micro_batch) == (full, "full", 24)
    assert got.as_hf_training_args()["gradient_checkpointing"] is True
    assert "gradient_checkpointing" not in plain.as_hf_training_args()


def test_untimed_policies_fall_back_to_the_fewest_steps(client: TestClient) -> None:
    upload(client, "none", 8, None, seed=1)
    upload(client, "every-2", 16, None, seed=2)
    got = suggest(client, objective="throughput")
    assert got.activation_checkpointing == "every-2" and got.samples_per_second is None
    assert any("was timed" in w for w in got.warnings)


def test_a_policy_without_profiles_is_a_404_naming_the_others(client: TestClient) -> None:
    upload(client, "full", 24, None, seed=1)
    response = client.get(
        SUGGEST, params={"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": 96}
    )
    assert response.status_code == 404
    assert "under 'full'" in response.text and "objective=throughput" in response.text
    bad = client.get(SUGGEST, params={"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": 96,
                                      "objective": "speed"})  # fmt: skip
    assert bad.status_code == 422


def test_the_policy_column_and_filter_of_the_list(client: TestClient) -> None:
    upload(client, "none", 8, None, seed=1)
    full = upload(client, "full", 24, [timing(24, 1.0)], seed=2)
    page = client.get("/api/v1/profiles", params={"activation_checkpointing": "full"}).json()
    assert [(p["id"], p["activation_checkpointing"]) for p in page["items"]] == [(full, "full")]
    stored = client.get(f"/api/v1/profiles/{full}").json()
    assert stored["profile"]["throughput"][0]["micro_batch"] == 24
