"""GET /api/v1/suggest and the observations that feed it, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from autotune.core.plan import micro_batch_for_limit, plan
from autotune.core.schemas import Fit, Suggestion
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
    assert (got.micro_batch, got.accumulation_steps, got.world_size, got.micro_batches) == (
        expected.micro_batch,
        expected.accumulation_steps,
        expected.world_size,
        expected.micro_batches,
    )
    assert got.effective_batch == expected.effective_batch
    assert got.exact is expected.exact
    assert got.max_micro_batch == 24
    assert sum(size * count for size, count in got.micro_batches) * got.world_size == got.effective_batch == 512


def test_measured_peak_is_reported_when_the_chosen_size_was_measured(client: TestClient) -> None:
    _upload(client, max_micro_batch=24, fixed_bytes=1000, bytes_per_sample=100)
    got = _suggest(client, target_batch=24)
    assert (got.micro_batch, got.accumulation_steps) == (24, 1)
    assert got.peak_bytes == 1000 + 100 * 24


def test_newest_measurement_wins(client: TestClient) -> None:
    _upload(client, seed=1, max_micro_batch=16)
    newest = _upload(client, seed=50, **_sized(32))
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
        "strategy": "ddp",
        "world_size": 1,
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
    profile_id = _upload(client, world_size=2)
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
    newer = _upload(client, seed=9, **_sized(32))
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


# --- The plan arithmetic off the event loop, and its errors -------------------------------------


def _upload_payload(client: TestClient, payload: dict[str, object]) -> int:
    response = client.post("/api/v1/profiles", json=payload, headers=WRITE)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def _suggest_error(client: TestClient, **params: object) -> dict[str, object]:
    query = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, **params}
    response = client.get(SUGGEST, params=query)
    assert response.status_code == 422, response.text
    error: dict[str, object] = response.json()["error"]
    return error


def test_the_plan_is_computed_in_a_worker_thread_not_on_the_event_loop(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    import autotune_server.api as api

    seen: list[bool] = []
    original = api.compute_suggestion

    def spy(*args: object, **kwargs: object) -> Suggestion:
        try:
            asyncio.get_running_loop()
            seen.append(True)
        except RuntimeError:
            seen.append(False)  # no running loop: a worker thread
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(api, "compute_suggestion", spy)
    _upload(client)
    assert _suggest(client, target_batch=64).source == "measured"
    assert seen == [False]


def test_a_target_needing_absurdly_many_steps_is_422_naming_the_problem(client: TestClient) -> None:
    _upload(client, max_micro_batch=24)
    target = 2**40 - 2**30  # the largest the API accepts: over 2**24 accumulation steps of 24
    error = _suggest_error(client, target_batch=target)
    assert error["code"] == "invalid_plan_request"
    assert error["field"] == "target_batch"
    assert "accumulation steps" in str(error["message"]) and str(target) in str(error["message"])


def test_the_target_check_still_names_target_batch_with_multiple_of(client: TestClient) -> None:
    _upload_payload(client, profile_payload(max_micro_batch=24, multiple_of=8))
    error = _suggest_error(client, target_batch=2, world_size=8)
    assert error["code"] == "invalid_plan_request" and error["field"] == "target_batch"
    assert "smaller than world_size" in str(error["message"])


def test_a_maximum_below_multiple_of_is_refused_on_upload(client: TestClient) -> None:
    # It once was stored and answered with a 422 at /suggest; now the store never takes it.
    payload = profile_payload(max_micro_batch=24)
    payload["multiple_of"] = 32
    response = client.post("/api/v1/profiles", json=payload, headers=WRITE)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "inconsistent_profile" and error["field"] == "max_micro_batch"
    assert "24 is not a multiple of multiple_of 32" in error["message"]


# --- multiple_of --------------------------------------------------------------------------------


def test_measured_plan_respects_the_profiles_multiple_of(client: TestClient) -> None:
    _upload_payload(client, profile_payload(max_micro_batch=24, multiple_of=8))
    for target in (40, 100, 24 * 7, 1000):
        for policy in ("balanced", "divisor"):
            got = _suggest(client, target_batch=target, plan=policy)
            expected = plan(24, target, 1, multiple_of=8, policy=policy)  # type: ignore[arg-type]
            assert (got.micro_batch, got.accumulation_steps, got.exact, got.micro_batches) == (
                expected.micro_batch,
                expected.accumulation_steps,
                expected.exact,
                expected.micro_batches,
            )
            assert all(size % 8 == 0 for size, _ in got.micro_batches) and got.multiple_of == 8


def test_capped_measured_size_is_rounded_down_to_multiple_of(client: TestClient) -> None:
    # Trials at 8, 12, 16, 24 (32 over) with peak = 1000 + 100 m: within 2500 bytes the largest
    # measured is 12 (a size the probe measured before --multiple-of 8 was asked for, say).
    payload = profile_payload(
        max_micro_batch=24, fixed_bytes=1000, bytes_per_sample=100, budget_bytes=10**6, multiple_of=8
    )
    payload["trials"].insert(1, {"micro_batch": 12, "peak_bytes": 2200, "fits": True})
    _upload_payload(client, payload)
    got = _suggest(client, target_batch=64, budget_bytes=2500, headroom=0.0)
    assert (got.source, got.max_micro_batch, got.micro_batch, got.accumulation_steps) == ("measured", 8, 8, 8)


def test_predicted_plan_respects_the_profiles_multiple_of(client: TestClient) -> None:
    payload = profile_payload(device_name=H100, fixed_bytes=10 * 2**30, bytes_per_sample=2.5 * 2**30, multiple_of=4)
    _upload_payload(client, payload)
    got = _suggest(client, target_batch=60, budget_bytes=40 * 2**30, headroom=0.1)
    assert got.source == "predicted"
    assert got.max_micro_batch == 8  # the fit allows 10
    assert got.micro_batch % 4 == 0
    expected = plan(8, 60, 1, multiple_of=4)
    assert (got.micro_batch, got.accumulation_steps) == (expected.micro_batch, expected.accumulation_steps)


# --- World size: DDP-ness of the profile vs the job ---------------------------------------------


def _ddp_payload(world_size: int, **kwargs: object) -> dict[str, object]:
    payload = profile_payload(**kwargs)
    payload["world_size"] = world_size
    return payload


def test_a_profile_with_the_jobs_ddp_ness_is_preferred_over_a_newer_one(client: TestClient) -> None:
    ddp = _upload_payload(client, _ddp_payload(4, seed=1, max_micro_batch=16))
    single = _upload_payload(client, _ddp_payload(1, seed=5, max_micro_batch=24))  # newer
    on_two = _suggest(client, target_batch=64, world_size=2)
    assert (on_two.source, on_two.profile_id, on_two.max_micro_batch) == ("measured", ddp, 16)
    assert not any("world size" in w for w in on_two.warnings)
    on_one = _suggest(client, target_batch=64, world_size=1)
    assert (on_one.profile_id, on_one.max_micro_batch) == (single, 24)
    assert not any("world size" in w for w in on_one.warnings)
    # Newest within the same DDP-ness still wins.
    newer_ddp = _upload_payload(client, _ddp_payload(2, seed=9, max_micro_batch=20))
    assert _suggest(client, target_batch=64, world_size=8).profile_id == newer_ddp


def test_a_single_process_profile_serves_a_ddp_job_with_a_warning(client: TestClient) -> None:
    profile_id = _upload(client, max_micro_batch=24)
    got = _suggest(client, target_batch=64, world_size=2)
    assert (got.source, got.profile_id, got.world_size) == ("measured", profile_id, 2)
    (warning,) = [w for w in got.warnings if "world size 1" in w]
    assert f"profile {profile_id}" in warning
    assert "gradient buckets" in warning and "--world-size 2" in warning


def test_a_ddp_profile_serves_a_single_process_job_noting_it_is_conservative(client: TestClient) -> None:
    profile_id = _upload_payload(client, _ddp_payload(4, max_micro_batch=24))
    got = _suggest(client, target_batch=64, world_size=1)
    assert (got.source, got.profile_id) == ("measured", profile_id)
    (note,) = [w for w in got.warnings if "DDP" in w]
    assert "world size 4" in note and "conservative" in note


def test_a_prediction_prefers_a_fit_with_the_jobs_ddp_ness(client: TestClient) -> None:
    ddp = _upload_payload(client, _ddp_payload(2, seed=1, device_name=H100))
    single = _upload_payload(client, _ddp_payload(1, seed=7, device_name=H100))  # newer
    on_two = _suggest(client, target_batch=64, world_size=2, budget_bytes=40 * 2**30)
    assert (on_two.source, on_two.profile_id) == ("predicted", ddp)
    on_one = _suggest(client, target_batch=64, world_size=1, budget_bytes=40 * 2**30)
    assert (on_one.source, on_one.profile_id) == ("predicted", single)


# --- Predictions: the step phase the fit does not see -------------------------------------------


def _step_dominated_payload(**kwargs: object) -> dict[str, object]:
    """The fit is of the forward/backward peaks (1 GiB + 1 GiB x m); the whole peak is flat at
    20 GiB up to m = 16 while the optimizer step dominates, then follows the activations."""
    payload = profile_payload(device_name=H100, fixed_bytes=2**30, bytes_per_sample=2**30, **kwargs)
    gib = 2**30
    payload["trials"] = [
        {"micro_batch": 1, "peak_bytes": 20 * gib, "fits": True, "forward_backward_bytes": 2 * gib},
        {"micro_batch": 2, "peak_bytes": 20 * gib, "fits": True, "forward_backward_bytes": 3 * gib},
        {"micro_batch": 12, "peak_bytes": 20 * gib, "fits": True, "forward_backward_bytes": 13 * gib},
        {"micro_batch": 24, "peak_bytes": 25 * gib, "fits": True, "forward_backward_bytes": 25 * gib},
        {"micro_batch": 25, "peak_bytes": 80 * gib, "fits": False, "oom": True},
    ]
    return payload


def test_a_prediction_needs_the_smallest_measured_whole_peak_to_fit_too(client: TestClient) -> None:
    _upload_payload(client, _step_dominated_payload())
    # 18 GiB: the fit alone would allow 17 samples, but the step phase alone takes 20 GiB.
    error = _suggest_error(client, target_batch=64, budget_bytes=18 * 2**30, headroom=0.0)
    assert error["code"] == "budget_too_small" and error["field"] == "budget_bytes"
    message = str(error["message"])
    assert "weights and optimizer state alone take about" in message and str(20 * 2**30) in message


def test_a_prediction_within_both_bounds_is_answered(client: TestClient) -> None:
    _upload_payload(client, _step_dominated_payload())
    got = _suggest(client, target_batch=64, budget_bytes=21 * 2**30, headroom=0.0)
    assert got.source == "predicted"
    assert got.max_micro_batch == 20  # fit: 1 GiB + 1 GiB x 20 <= 21 GiB; step phase 20 GiB <= 21 GiB
    assert got.peak_bytes is not None and got.peak_bytes >= 20 * 2**30


def test_an_oom_below_fitting_sizes_is_refused_so_the_step_phase_is_always_measured(client: TestClient) -> None:
    # An OOM at m = 1 under sizes that fit once reached the store, and the step phase was then read
    # from m = 2; now such a profile contradicts its own max_micro_batch and is refused.
    payload = _step_dominated_payload()
    trials = payload["trials"]
    assert isinstance(trials, list)
    trials[0] = {"micro_batch": 1, "peak_bytes": 79 * 2**30, "fits": False, "oom": True}
    response = client.post("/api/v1/profiles", json=payload, headers=WRITE)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["field"], error["details"][0]["trial"]) == ("max_micro_batch", 0)


# --- headroom without budget_bytes applies to the profile's own budget --------------------------


def _small_budget_profile(client: TestClient, multiple_of: int = 1) -> int:
    # Trials at 1, 2, 12, 24 with peak = 1000 + 100 m (1100, 1200, 2200, 3400); measured within
    # 4000 x 0.9 = 3600 bytes. With multiple_of, the same trials (1, 2 and 12 measured before the
    # multiple was asked for), m_max 24 and the failure at 24 + multiple_of.
    payload = profile_payload(max_micro_batch=24, fixed_bytes=1000, bytes_per_sample=100, budget_bytes=4000)
    if multiple_of > 1:
        payload["multiple_of"] = multiple_of
        payload["trials"][-1]["micro_batch"] = 24 + multiple_of
    return _upload_payload(client, payload)


def test_a_stricter_headroom_alone_caps_at_the_largest_measured_size_within_it(client: TestClient) -> None:
    profile_id = _small_budget_profile(client)
    got = _suggest(client, target_batch=24, headroom=0.4)  # 4000 x 0.6 = 2400 bytes
    assert (got.source, got.profile_id, got.max_micro_batch, got.budget_bytes) == ("measured", profile_id, 12, 4000)
    assert got.peak_bytes == 2200
    assert any("below" in w and "2400" in w for w in got.warnings)


def test_a_looser_headroom_alone_keeps_the_measured_maximum(client: TestClient) -> None:
    _small_budget_profile(client)
    got = _suggest(client, target_batch=24, headroom=0.0)
    assert (got.source, got.max_micro_batch) == ("measured", 24)
    assert any("probe again" in w for w in got.warnings)
    same = _suggest(client, target_batch=24, headroom=0.1)
    assert same.max_micro_batch == 24 and not same.warnings


def test_a_headroom_no_measured_size_fits_falls_back_to_a_prediction(client: TestClient) -> None:
    # multiple_of 8: the sizes within 2000 bytes (1 and 2) are not usable; the fit allows 10 -> 8.
    _small_budget_profile(client, multiple_of=8)
    got = _suggest(client, target_batch=64, headroom=0.5)
    assert (got.source, got.device_name, got.max_micro_batch, got.micro_batch) == ("predicted", DEFAULT_DEVICE, 8, 8)
    assert any("predicted" in w for w in got.warnings)


def test_a_headroom_leaving_less_than_the_weights_is_422(client: TestClient) -> None:
    _small_budget_profile(client)
    error = _suggest_error(client, target_batch=64, headroom=0.8)  # 800 bytes < 1100 at m = 1
    assert error["code"] == "budget_too_small" and error["field"] == "headroom"
    assert "weights and optimizer state alone take about 1100 bytes" in str(error["message"])


def test_a_prediction_never_reaches_a_size_measured_over_the_limit(client: TestClient) -> None:
    # m = 12 measured 2600 bytes whole (its forward/backward part is on the line, 2200): a limit of
    # 2400 leaves only m = 1 and 2 measured within, not multiples of 4, so the answer is predicted;
    # the line alone would allow 12, but 12 was measured over the limit.
    payload = profile_payload(max_micro_batch=24, fixed_bytes=1000, bytes_per_sample=100, budget_bytes=4000)
    payload["multiple_of"] = 4
    payload["trials"][-1]["micro_batch"] = 28  # the failure at m_max + multiple_of
    for trial in payload["trials"]:
        if trial["micro_batch"] == 12:
            trial["forward_backward_bytes"] = trial["peak_bytes"]
            trial["peak_bytes"] = 2600
    _upload_payload(client, payload)
    got = _suggest(client, target_batch=64, headroom=0.4)  # 4000 x 0.6 = 2400 bytes
    assert got.source == "predicted"
    assert got.max_micro_batch == 8 and got.micro_batch % 4 == 0


# --- Strategy (ddp | fsdp) and world size -------------------------------------------------------


def _sized(max_micro_batch: int) -> dict[str, object]:
    """A consistent profile's figures for this m_max: within the 72 GiB limit up to it, over after."""
    per_sample = 62 * 2**30 / (max_micro_batch + 0.5)
    return {"max_micro_batch": max_micro_batch, "fixed_bytes": 10 * 2**30, "bytes_per_sample": per_sample}


def _suggest_404(client: TestClient, **params: object) -> dict[str, object]:
    query = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, **params}
    response = client.get(SUGGEST, params=query)
    assert response.status_code == 404, response.text
    error: dict[str, object] = response.json()["error"]
    return error


def test_an_fsdp_profile_answers_an_fsdp_job_at_its_world_size_as_measured(client: TestClient) -> None:
    _upload(client, seed=1, **_sized(8))  # ddp, newer ones below
    fsdp = _upload(client, seed=2, strategy="fsdp", world_size=8, **_sized(40))
    got = _suggest(client, target_batch=640, world_size=8, strategy="fsdp")
    assert (got.source, got.profile_id, got.strategy, got.max_micro_batch) == ("measured", fsdp, "fsdp", 40)
    assert (got.micro_batch, got.accumulation_steps, got.world_size) == (40, 2, 8)
    assert got.warnings == []


def test_a_ddp_job_never_gets_an_fsdp_profile(client: TestClient) -> None:
    _upload(client, seed=5, strategy="fsdp", world_size=8, **_sized(40))
    error = _suggest_404(client, target_batch=64, world_size=8)
    assert "fsdp at world size 8" in str(error["message"]) and "do not answer a ddp job" in str(error["message"])
    ddp = _upload(client, seed=1, **_sized(8))  # older than the fsdp one
    got = _suggest(client, target_batch=64, world_size=8)
    assert (got.source, got.profile_id, got.strategy, got.max_micro_batch) == ("measured", ddp, "ddp", 8)
    # Same query but the strategy: a different answer (the answer cache keys on it too).
    assert _suggest(client, target_batch=64, world_size=8, strategy="fsdp").max_micro_batch == 40


def test_an_fsdp_profile_at_a_smaller_world_size_is_a_prediction_saying_so(client: TestClient) -> None:
    at_two = _upload(client, seed=1, strategy="fsdp", world_size=2, **_sized(16))
    _upload(client, seed=2, strategy="fsdp", world_size=4, max_micro_batch=24)
    _upload(client, seed=3, strategy="fsdp", world_size=16, **_sized(64))  # ranks held less: never
    got = _suggest(client, target_batch=256, world_size=8, strategy="fsdp")
    assert (got.source, got.max_micro_batch, got.strategy) == ("predicted", 24, "fsdp")  # the nearest below
    (warning,) = [w for w in got.warnings if "per-rank memory" in w]
    assert "world size 4, not 8" in warning and "--strategy fsdp --world-size 8" in warning
    assert _suggest(client, target_batch=256, world_size=3, strategy="fsdp").profile_id == at_two
    # fsdp over one rank is no job (the composition table): a 422 in the CLI's words, where the 404 once advised
    # probing --strategy fsdp --world-size 1, which the CLI refuses (issue 61).
    query = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": 256}
    response = client.get(SUGGEST, params={**query, "world_size": 1, "strategy": "fsdp"})
    assert response.status_code == 422, response.text
    assert "--strategy fsdp with --world-size 1" in response.json()["error"]["message"]


def test_an_fsdp_job_with_only_a_ddp_profile_is_a_prediction_saying_so(client: TestClient) -> None:
    ddp = _upload(client, max_micro_batch=24)
    got = _suggest(client, target_batch=64, world_size=8, strategy="fsdp")
    assert (got.source, got.profile_id, got.strategy, got.world_size) == ("predicted", ddp, "fsdp", 8)
    (warning,) = [w for w in got.warnings if "FSDP" in w]
    assert "measured with DDP" in warning and "not with FSDP at world size 8" in warning


def test_an_fsdp_fit_elsewhere_beats_a_ddp_profile_here_for_an_fsdp_job(client: TestClient) -> None:
    ddp = _upload(client, seed=1, max_micro_batch=24)
    fsdp = _upload(client, seed=2, device_name=H100, strategy="fsdp", world_size=8)
    got = _suggest(client, target_batch=64, world_size=8, strategy="fsdp", budget_bytes=40 * 2**30)
    assert (got.source, got.profile_id, got.device_name) == ("predicted", fsdp, DEFAULT_DEVICE)
    assert not any("FSDP" in w for w in got.warnings)
    # A ddp job is predicted from ddp fits only: the fsdp one elsewhere does not count.
    payload = {"fingerprint": FINGERPRINT, "device_name": "another GPU", "target_batch": 64}
    only_fsdp = client.get(SUGGEST, params={**payload, "world_size": 8, "budget_bytes": 40 * 2**30})
    assert only_fsdp.status_code == 200 and only_fsdp.json()["profile_id"] == ddp


def test_a_bad_strategy_is_422_naming_it(client: TestClient) -> None:
    response = client.get(
        SUGGEST,
        params={"fingerprint": FINGERPRINT, "device_name": "x", "target_batch": 8, "strategy": "zero3"},
    )
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "strategy"


# --- Source: measurements, estimates, and fake trials -------------------------------------------


def test_a_measurement_wins_over_a_newer_estimate(client: TestClient) -> None:
    measured = _upload(client, seed=1, **_sized(16))
    _upload(client, seed=9, source="estimate", **_sized(32))
    got = _suggest(client, target_batch=64)
    assert (got.source, got.profile_id, got.max_micro_batch) == ("measured", measured, 16)
    assert not any("estimate" in w for w in got.warnings)


def test_an_estimate_alone_answers_as_estimated_with_a_warning(client: TestClient) -> None:
    estimate = _upload(client, source="estimate", **_sized(32))
    got = _suggest(client, target_batch=64)
    assert (got.source, got.profile_id, got.max_micro_batch) == ("estimated", estimate, 32)
    (warning,) = [w for w in got.warnings if "fake-tensor" in w]
    assert warning.startswith("estimated, not measured") and f"profile {estimate}" in warning


def test_a_measured_fit_elsewhere_wins_over_an_estimate_here(client: TestClient) -> None:
    _upload(client, seed=1, source="estimate", **_sized(32))
    measured = _upload(client, seed=2, device_name=H100)
    got = _suggest(client, target_batch=64, budget_bytes=40 * 2**30)
    assert (got.source, got.profile_id) == ("predicted", measured)
    without_budget = _suggest(client, target_batch=64)  # no budget: no prediction, the estimate answers
    assert without_budget.source == "estimated"


def test_an_estimate_elsewhere_is_estimated_from_its_fit(client: TestClient) -> None:
    estimate = _upload(client, device_name=H100, source="estimate")
    got = _suggest(client, target_batch=64, budget_bytes=40 * 2**30, headroom=0.1)
    assert (got.source, got.profile_id, got.max_micro_batch) == ("estimated", estimate, 10)
    assert any("fit estimated on" in w for w in got.warnings)
    assert any(w.startswith("estimated, not measured") for w in got.warnings)


def test_fake_pre_search_trials_of_a_measurement_are_not_measured_sizes(client: TestClient) -> None:
    # Real trials at 1, 2, 12, 24 (peak 1000 + 100 m, limit 3420); a fake one at 20 claims 1500 bytes.
    payload = profile_payload(
        max_micro_batch=24, fixed_bytes=1000, bytes_per_sample=100, budget_bytes=3800, fake_micro_batches=(20,)
    )
    _upload_payload(client, payload)
    got = _suggest(client, target_batch=24, budget_bytes=3000, headroom=0.0)
    assert (got.source, got.max_micro_batch) == ("measured", 12)
    assert got.peak_bytes == 2200


def test_a_prediction_takes_the_step_phase_from_deciding_trials_only(client: TestClient) -> None:
    # The real trial at m = 1 is replaced by a fake one at 2 GiB: the smallest measured whole peak
    # is then m = 2's 20 GiB, and an 18 GiB budget is too small; counting the fake one would answer.
    payload = _step_dominated_payload()
    trials = payload["trials"]
    assert isinstance(trials, list)
    trials[0] = {"micro_batch": 1, "peak_bytes": 2 * 2**30, "fits": True, "fake": True}
    _upload_payload(client, payload)
    error = _suggest_error(client, target_batch=64, budget_bytes=18 * 2**30, headroom=0.0)
    assert error["code"] == "budget_too_small" and str(20 * 2**30) in str(error["message"])


def test_an_estimates_fake_trials_are_its_deciding_trials(client: TestClient) -> None:
    payload = _step_dominated_payload()
    payload["source"] = "estimate"
    for trial in payload["trials"]:  # type: ignore[attr-defined]
        trial["fake"] = True
    _upload_payload(client, payload)
    error = _suggest_error(client, target_batch=64, budget_bytes=18 * 2**30, headroom=0.0)
    assert error["code"] == "budget_too_small" and str(20 * 2**30) in str(error["message"])
    got = _suggest(client, target_batch=64, budget_bytes=21 * 2**30, headroom=0.0)
    assert (got.source, got.max_micro_batch) == ("estimated", 20)


def _presearch_payload() -> dict[str, object]:
    """A probe's profile after a fake pre-search: fake trials at small m, real ones at m_max = 24
    and 25 only, each real trial recording its optimizer step's peak (flat in m: 20 GiB)."""
    payload = _step_dominated_payload()
    gib = 2**30
    payload["trials"] = [
        {"micro_batch": 1, "peak_bytes": 20 * gib, "fits": True, "forward_backward_bytes": 2 * gib, "fake": True},
        {"micro_batch": 2, "peak_bytes": 20 * gib, "fits": True, "forward_backward_bytes": 3 * gib, "fake": True},
        {"micro_batch": 24, "peak_bytes": 25 * gib, "fits": True, "forward_backward_bytes": 25 * gib,
         "step_bytes": 20 * gib},
        {"micro_batch": 25, "peak_bytes": 80 * gib, "fits": False, "oom": True},
    ]  # fmt: skip
    return payload


def test_a_prediction_from_a_presearch_profile_floors_at_the_recorded_step_not_at_m_max(client: TestClient) -> None:
    # Without step_bytes the smallest real trial is m_max's 25 GiB, and a 21 GiB card would be
    # refused as too small for the weights; the recorded step phase (20 GiB) says it is not.
    _upload_payload(client, _presearch_payload())
    got = _suggest(client, target_batch=64, budget_bytes=21 * 2**30, headroom=0.0)
    assert (got.source, got.max_micro_batch) == ("predicted", 20)
    error = _suggest_error(client, target_batch=64, budget_bytes=19 * 2**30, headroom=0.0)
    assert error["code"] == "budget_too_small" and str(20 * 2**30) in str(error["message"])
