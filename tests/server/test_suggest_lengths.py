"""Sequence length in the store and /suggest, on SQLite and PostgreSQL: a measured length answers as
measured, a length the surface covers as predicted, others 404 with the measured lengths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from autotune.core.schemas import Profile, Suggestion
from autotune.core.surface import PeakSurface
from tests.server.conftest import WRITE

SUGGEST = "/api/v1/suggest"
# One real probe of examples/gpt.py:task_seq over 128, 256 and 512 (tests/data/make_surface_gpt.py).
PROFILES: list[dict[str, Any]] = json.loads((Path(__file__).parents[1] / "data" / "surface_gpt.json").read_text())


@pytest.fixture
def stored(client: TestClient) -> dict[int, int]:
    """seq_len -> profile id of the three profiles, uploaded."""
    ids = {}
    for body in PROFILES:
        response = client.post("/api/v1/profiles", json=body, headers=WRITE)
        assert response.status_code == 201, response.text
        ids[body["seq_len"]] = int(response.json()["id"])
    return ids


def _ask(client: TestClient, **params: object) -> Any:
    query = {"fingerprint": PROFILES[0]["fingerprint"], "device_name": PROFILES[0]["device"]["name"], **params}
    return client.get(SUGGEST, params=query)


def _suggest(client: TestClient, **params: object) -> Suggestion:
    response = _ask(client, **params)
    assert response.status_code == 200, response.text
    return Suggestion.model_validate(response.json())


def test_a_measured_length_answers_from_its_own_profile_in_tokens_too(
    client: TestClient, stored: dict[int, int]
) -> None:
    for body in PROFILES:
        got = _suggest(client, seq_len=body["seq_len"], target_batch=64)
        assert (got.source, got.profile_id, got.max_micro_batch) == (
            "measured",
            stored[body["seq_len"]],
            body["max_micro_batch"],
        )
        assert got.seq_len == body["seq_len"]
        assert got.tokens_per_micro_batch == got.micro_batch * body["seq_len"]
        assert got.tokens_per_update == got.effective_batch * body["seq_len"] == 64 * body["seq_len"]


def test_a_length_between_measured_ones_is_predicted_from_the_surface(
    client: TestClient, stored: dict[int, int]
) -> None:
    surface = Profile.model_validate(PROFILES[0]).surface
    assert surface is not None
    got = _suggest(client, seq_len=384, target_batch=64)
    limit = int(PROFILES[0]["budget_bytes"] * (1 - PROFILES[0]["headroom"]))
    expected = PeakSurface.from_dict(surface.model_dump()).max_fitting(limit - surface.offset_bytes, 384, cap=4096)
    assert got.source == "predicted" and got.max_micro_batch == expected
    assert PROFILES[2]["max_micro_batch"] <= expected <= PROFILES[1]["max_micro_batch"]  # between 512's and 256's
    assert any("seq_len 384 was not measured (measured: 128, 256, 512)" in w for w in got.warnings), got.warnings
    # The longest length that fit at m = 1 is covered too; a stricter budget lowers the answer.
    longest = surface.covered[1]
    assert _suggest(client, seq_len=longest, target_batch=8).max_micro_batch >= 1
    stricter = _suggest(client, seq_len=384, target_batch=64, budget_bytes=PROFILES[0]["budget_bytes"] // 2)
    assert stricter.max_micro_batch < got.max_micro_batch


def test_lengths_the_surface_does_not_cover_are_a_404_naming_the_measured_ones(
    client: TestClient, stored: dict[int, int]
) -> None:
    for seq_len in (64, 3000):
        response = _ask(client, seq_len=seq_len, target_batch=64)
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["field"] == "seq_len"
        assert "measured at seq_len 128, 256, 512" in error["message"] and "cover 128..2048" in error["message"]


def test_a_sequence_aware_setup_needs_the_length(client: TestClient, stored: dict[int, int]) -> None:
    response = _ask(client, target_batch=64)
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "seq_len"
    assert "is sequence-aware (measured at seq_len 128, 256, 512)" in response.json()["error"]["message"]


def test_token_targets_are_planned_in_sequences(client: TestClient, stored: dict[int, int]) -> None:
    exact = _suggest(client, seq_len=256, target_tokens=32768)
    assert (exact.target_batch, exact.effective_batch, exact.tokens_per_update, exact.target_tokens) == (
        128,
        128,
        32768,
        32768,
    )
    uneven = _suggest(client, seq_len=256, target_tokens=30000)
    assert uneven.effective_batch == 117 and uneven.tokens_per_update == 117 * 256
    assert any("30000 tokens is not a multiple of seq_len 256" in w for w in uneven.warnings)
    for params, field in (
        ({"seq_len": 256, "target_tokens": 4096, "target_batch": 8}, "target_tokens"),
        ({"seq_len": 256}, "target_batch"),
        ({"target_tokens": 4096}, "seq_len"),
    ):
        response = _ask(client, **params)
        assert response.status_code == 422, (params, response.text)
        assert response.json()["error"]["field"] == field


def test_profiles_filter_by_length(client: TestClient, stored: dict[int, int]) -> None:
    response = client.get("/api/v1/profiles", params={"seq_len": 256})
    assert response.status_code == 200
    assert [(item["id"], item["seq_len"]) for item in response.json()["items"]] == [(stored[256], 256)]
    assert client.get("/api/v1/profiles", params={"seq_len": 0}).status_code == 422


def test_a_surface_without_its_length_is_refused(client: TestClient) -> None:
    body = {**PROFILES[0], "seq_len": None}
    response = client.post("/api/v1/profiles", json=body, headers=WRITE)
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "surface"
    outside = {**PROFILES[0], "seq_len": 4096}
    assert client.post("/api/v1/profiles", json=outside, headers=WRITE).status_code == 422


def _fixed(client: TestClient, fingerprint: str, tags: dict[str, Any]) -> int:
    from tests.factories import profile_payload

    response = client.post(
        "/api/v1/profiles",
        json=profile_payload(fingerprint=fingerprint, max_micro_batch=26, bytes_per_sample=2**30, tags=tags),
        headers=WRITE,
    )
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def _ask_fixed(client: TestClient, fingerprint: str, **params: object) -> Any:
    from tests.factories import DEFAULT_DEVICE

    return client.get(SUGGEST, params={"fingerprint": fingerprint, "device_name": DEFAULT_DEVICE, **params})


def test_a_fixed_length_setup_answers_its_own_length_only(client: TestClient) -> None:
    """Issue 62, item 1: examples/gpt.py:task (64 tokens, not sequence-aware) asked at seq_len 4096 answered 200,
    "measured", m = 26 and 106,496 tokens per micro-batch: a job at 4096 would run out of memory on its first step.
    Its own length (the tag seq_len) answers as before; another is a 404 naming both."""
    fingerprint = "64" * 32
    profile_id = _fixed(client, fingerprint, {"seq_len": 64})
    own = _ask_fixed(client, fingerprint, seq_len=64, target_batch=512)
    assert own.status_code == 200, own.text
    got = Suggestion.model_validate(own.json())
    assert (got.source, got.profile_id, got.micro_batch, got.tokens_per_micro_batch) == (
        "measured",
        profile_id,
        26,
        26 * 64,
    )
    unsaid = Suggestion.model_validate(_ask_fixed(client, fingerprint, target_batch=512).json())
    assert (unsaid.source, unsaid.micro_batch, unsaid.tokens_per_micro_batch) == ("measured", 26, None)
    longer = _ask_fixed(client, fingerprint, seq_len=4096, target_batch=512)
    assert longer.status_code == 404, longer.text
    error = longer.json()["error"]
    assert error["code"] == "no_matching_profile" and error["field"] == "seq_len"
    assert error["message"].startswith(
        f"no profile of fingerprint {fingerprint} at seq_len 4096 on 'NVIDIA A100-SXM4-80GB': its task's length is "
        "fixed at 64 (the tag seq_len;"
    ), error["message"]
    assert error["details"] == {"measured_lengths": [64], "covered": []}
    tokens = _ask_fixed(client, fingerprint, seq_len=4096, target_tokens=1 << 20)
    assert tokens.status_code == 404


def test_a_setup_that_records_no_length_is_not_answered_at_one(client: TestClient) -> None:
    fingerprint = "0a" * 32
    _fixed(client, fingerprint, {})
    response = _ask_fixed(client, fingerprint, seq_len=4096, target_batch=512)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "seq_len"
    assert error["message"].startswith(
        f"seq_len 4096: fingerprint {fingerprint} is not sequence-aware and records no length"
    ), error["message"]
    assert _ask_fixed(client, fingerprint, target_batch=512).status_code == 200
