"""GET /api/v1/suggest and the observations that feed it, on SQLite and PostgreSQL."""

from __future__ import annotations

import math
from collections.abc import Callable

from fastapi.testclient import TestClient

from autotune.plan import micro_batch_for_limit, plan
from autotune.schemas import Fit, Suggestion
from tests.factories import DEFAULT_DEVICE, FINGERPRINT, fingerprint_for, profile_payload
from tests.server.conftest import WRITE

SUGGEST = "/api/v1/suggest"
H100 = "NVIDIA H100 80GB HBM3"


def _upload(client: TestClient, **kwargs: object) -> int:
    response = client.post("/api/v1/profiles", json=profile_payload(**kwargs), headers=WRITE)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def _suggest(client: TestClient, **params: object) -> Suggestion:
    query = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, **params}
    response = client.get(SUGGEST, params=query)
    assert response.status_code == 200, response.text
    return Suggestion.model_validate(response.json())


def test_measured_profile_gives_the_plan_of_autotune_plan(client: TestClient) -> None:
    profile_id = _upload(client, max_micro_batch=24)
    got = _suggest(client, target_batch=512, world_size=4)
    expected = plan(24, 512, 4)
    assert got.source == "measured"
    assert got.profile_id == profile_id
    assert (got.micro_batch, got.accumulation_steps, got.world_size) == (
        expected.micro_batch,
        expected.accumulation_steps,
        expected.world_size,
    )
    assert got.effective_batch == expected.effective_batch
    assert got.exact is expected.exact
    assert got.max_micro_batch == 24
    assert got.micro_batch * got.accumulation_steps * got.world_size == got.effective_batch


def test_measured_peak_is_reported_when_the_chosen_size_was_measured(client: TestClient) -> None:
    _upload(client, max_micro_batch=24, fixed_bytes=1000, bytes_per_sample=100)
    got = _suggest(client, target_batch=24)
    assert (got.micro_batch, got.accumulation_steps) == (24, 1)
    assert got.peak_bytes == 1000 + 100 * 24


def test_newest_measurement_wins(client: TestClient) -> None:
    _upload(client, seed=1, max_micro_batch=16)
    newest = _upload(client, seed=50, max_micro_batch=32)
    _upload(client, seed=2, max_micro_batch=8)  # uploaded last, measured earlier
    got = _suggest(client, target_batch=64)
    assert got.profile_id == newest
    assert got.max_micro_batch == 32


def test_other_device_with_budget_is_predicted_from_the_stored_fit(client: TestClient) -> None:
    fixed, per_sample = 10 * 2**30, 2.5 * 2**30
    source_id = _upload(client, device_name=H100, fixed_bytes=fixed, bytes_per_sample=per_sample)
    budget = 40 * 2**30
    got = _suggest(client, target_batch=256, budget_bytes=budget, headroom=0.1)
    m_max = micro_batch_for_limit(Fit(fixed_bytes=fixed, bytes_per_sample=per_sample), budget * 0.9, 4096)
    assert m_max == math.floor((budget * 0.9 - fixed) / per_sample) == 10
    assert got.source == "predicted"
    assert got.profile_id == source_id
    assert got.device_name == DEFAULT_DEVICE
    assert got.max_micro_batch == m_max
    assert got.micro_batch <= m_max
    assert got.budget_bytes == budget
    assert any("predicted" in w and H100 in w for w in got.warnings)


def test_other_device_without_budget_is_404_that_says_what_to_do(client: TestClient) -> None:
    _upload(client, device_name=H100)
    response = client.get(
        SUGGEST, params={"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": 64}
    )
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "no_matching_profile"
    assert "budget_bytes" in error["message"]
    assert error["details"]["devices_with_profiles"] == [H100]


def test_nothing_matching_is_404_saying_what_was_looked_for_and_how_to_probe(client: TestClient) -> None:
    _upload(client)  # a different fingerprint must not match
    unknown = fingerprint_for("never probed")
    response = client.get(
        SUGGEST,
        params={"fingerprint": unknown, "device_name": H100, "target_batch": 64, "budget_bytes": 2**30},
    )
    assert response.status_code == 404
    error = response.json()["error"]
    assert unknown in error["message"]
    assert "autotune probe" in error["message"]
    assert error["details"]["looked_for"] == {
        "fingerprint": unknown,
        "device_name": H100,
        "budget_bytes": 2**30,
    }
    assert "autotune probe" in error["details"]["how_to_probe"]


def test_target_smaller_than_world_size_is_422_with_the_plan_message(client: TestClient) -> None:
    _upload(client)
    response = client.get(
        SUGGEST,
        params={
            "fingerprint": FINGERPRINT,
            "device_name": DEFAULT_DEVICE,
            "target_batch": 2,
            "world_size": 8,
        },
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_plan_request"
    assert error["field"] == "target_batch"
    assert "smaller than world_size" in error["message"]


def test_bad_query_is_422_naming_the_parameter(client: TestClient) -> None:
    for params, field in [
        ({"device_name": "x", "target_batch": 8}, "fingerprint"),
        ({"fingerprint": "XYZ", "device_name": "x", "target_batch": 8}, "fingerprint"),
        ({"fingerprint": FINGERPRINT, "device_name": "x", "target_batch": 0}, "target_batch"),
        ({"fingerprint": FINGERPRINT, "device_name": "x", "target_batch": 8, "headroom": 1}, "headroom"),
        ({"fingerprint": FINGERPRINT, "device_name": "x", "target_batch": 8, "world_size": 0}, "world_size"),
    ]:
        response = client.get(SUGGEST, params=params)
        assert response.status_code == 422, params
        assert response.json()["error"]["field"] == field


def test_smaller_budget_caps_at_the_largest_measured_size_within_it(client: TestClient) -> None:
    # Trials at 1, 2, 12, 24 with peak = 1000 + 100 m; the probe's limit was 1e6 x 0.9.
    _upload(client, max_micro_batch=24, fixed_bytes=1000, bytes_per_sample=100, budget_bytes=10**6)
    got = _suggest(client, target_batch=24, budget_bytes=3000, headroom=0.0)
    assert got.source == "measured"
    assert got.max_micro_batch == 12  # 1000 + 100 x 12 = 2200 <= 3000 < 1000 + 100 x 24
    assert any("below" in w for w in got.warnings)


def test_budget_too_small_for_any_sample_is_422(client: TestClient) -> None:
    _upload(client, device_name=H100, fixed_bytes=10 * 2**30, bytes_per_sample=2**30)
    response = client.get(
        SUGGEST,
        params={
            "fingerprint": FINGERPRINT,
            "device_name": DEFAULT_DEVICE,
            "target_batch": 64,
            "budget_bytes": 2**30,
        },
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "budget_too_small"
    assert response.json()["error"]["field"] == "budget_bytes"


def test_an_observed_oom_lowers_the_suggested_micro_batch(client: TestClient) -> None:
    profile_id = _upload(client, max_micro_batch=24)
    before = _suggest(client, target_batch=96)
    assert before.max_micro_batch == 24
    response = client.post(
        f"/api/v1/profiles/{profile_id}/observations",
        json={"micro_batch": 20, "oom": True, "note": "fragmentation"},
        headers=WRITE,
    )
    assert response.status_code == 201
    after = _suggest(client, target_batch=96)
    assert after.max_micro_batch == 19
    assert after.micro_batch <= 19
    assert any("out-of-memory" in w for w in after.warnings)


def test_observations_are_stored_and_listed(client: TestClient) -> None:
    profile_id = _upload(client)
    url = f"/api/v1/profiles/{profile_id}/observations"
    first = client.post(url, json={"micro_batch": 8, "peak_bytes": 12345, "world_size": 2}, headers=WRITE)
    assert first.status_code == 201
    assert first.json()["profile_id"] == profile_id
    assert first.json()["uploader"] == "ci"
    client.post(url, json={"micro_batch": 30, "oom": True}, headers=WRITE)
    items = client.get(url).json()["items"]
    assert [(o["micro_batch"], o["oom"], o["peak_bytes"]) for o in items] == [
        (8, False, 12345),
        (30, True, None),
    ]
    assert client.get(f"/api/v1/profiles/{profile_id}").json()["observation_count"] == 2


def test_observation_needs_a_write_token_an_existing_profile_and_valid_fields(client: TestClient) -> None:
    profile_id = _upload(client)
    url = f"/api/v1/profiles/{profile_id}/observations"
    assert client.post(url, json={"micro_batch": 8}).status_code == 401
    missing = client.post("/api/v1/profiles/4242/observations", json={"micro_batch": 8}, headers=WRITE)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "profile_not_found"
    bad = client.post(url, json={"micro_batch": 0}, headers=WRITE)
    assert bad.status_code == 422
    assert bad.json()["error"]["field"] == "micro_batch"
    assert client.get(url).json()["items"] == []


def test_writes_in_this_process_are_seen_by_the_next_suggest_at_once(client: TestClient) -> None:
    # /suggest caches lookups for a second; an upload or delete here must not wait for that.
    first = _upload(client, seed=1, max_micro_batch=16)
    assert _suggest(client, target_batch=64).profile_id == first
    newer = _upload(client, seed=9, max_micro_batch=32)
    assert _suggest(client, target_batch=64).profile_id == newer
    assert client.delete(f"/api/v1/profiles/{newer}", headers=WRITE).status_code == 204
    assert _suggest(client, target_batch=64).profile_id == first
    assert client.delete(f"/api/v1/profiles/{first}", headers=WRITE).status_code == 204
    params = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": 64}
    assert client.get(SUGGEST, params=params).status_code == 404


def test_another_process_write_is_seen_within_the_cache_ttl(make_client: Callable[..., TestClient]) -> None:
    # Two apps on one database stand for two worker processes; with the cache off, at once.
    reader = make_client(suggest_cache_seconds=0)
    writer = make_client()
    params = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": 64}
    assert reader.get(SUGGEST, params=params).status_code == 404
    _upload(writer)
    assert reader.get(SUGGEST, params=params).status_code == 200
