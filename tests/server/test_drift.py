"""Observed peaks move /suggest's answer (autotune_server.drift), on SQLite and PostgreSQL.

The profile (tests.factories.make_profile): peak(m) = 10 GiB + 2.5 GiB x m within 80 GiB less 10 %
headroom (72 GiB); trials at m = 1, 2, 12, 24 fit, 25 is over: m_max 24 at 70 GiB.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from autotune.core.schemas import Suggestion
from autotune_server.drift import QUANTILE, Reference, drift_of
from tests.factories import DEFAULT_DEVICE, FINGERPRINT, profile_payload
from tests.server.conftest import WRITE

GiB = 2**30
SUGGEST = "/api/v1/suggest"


def _peak(m: int) -> int:
    return int(10 * GiB + 2.5 * GiB * m)


def _upload(client: TestClient, **kwargs: object) -> int:
    response = client.post("/api/v1/profiles", json=profile_payload(**kwargs), headers=WRITE)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def _observe(client: TestClient, profile_id: int, **body: Any) -> dict[str, Any]:
    response = client.post(f"/api/v1/profiles/{profile_id}/observations", json=body, headers=WRITE)
    assert response.status_code == 201, response.text
    return dict(response.json())


def _suggest(client: TestClient, target_batch: int = 96) -> Suggestion:
    query = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": target_batch}
    response = client.get(SUGGEST, params=query)
    assert response.status_code == 200, response.text
    return Suggestion.model_validate(response.json())


@pytest.fixture
def cached(make_client: Callable[..., TestClient]) -> TestClient:
    """A client whose /suggest answers are cached for a minute: only a write may refresh them."""
    return make_client(suggest_cache_seconds=60.0)


def test_drift_lowers_m_with_a_warning_at_once(cached: TestClient) -> None:
    profile_id = _upload(cached)
    assert _suggest(cached).max_micro_batch == 24  # and now cached
    for _ in range(3):
        _observe(cached, profile_id, micro_batch=24, peak_bytes=round(_peak(24) * 1.04))
    after = _suggest(cached)
    # 72 GiB / 1.04 = 69.2 GiB: m = 24 (70 GiB) no longer fits with the drift, m = 23 (67.5 GiB) does.
    assert after.max_micro_batch == 23 and after.micro_batch <= 23
    assert "3 jobs observed up to 4.0 % above the probe at m = 24; answering 23" in after.warnings


def test_peaks_below_the_probe_never_raise_m(client: TestClient) -> None:
    profile_id = _upload(client)
    for m in (24, 12, 2):
        _observe(client, profile_id, micro_batch=m, peak_bytes=_peak(m) // 2)
    got = _suggest(client, target_batch=100)
    assert got.max_micro_batch == 24 and got.micro_batch <= 24
    assert not any("observed" in w for w in got.warnings)


def test_one_outlier_does_not_swing_the_answer(client: TestClient) -> None:
    profile_id = _upload(client)
    for _ in range(5):
        _observe(client, profile_id, micro_batch=24, peak_bytes=round(_peak(24) * 1.01))
    _observe(client, profile_id, micro_batch=24, peak_bytes=round(_peak(24) * 1.30), note="a neighbour on the card")
    got = _suggest(client)
    assert got.max_micro_batch == 24
    (said,) = [w for w in got.warnings if "observed" in w]
    assert "6 jobs observed up to 30.0 % above the probe at m = 24" in said
    assert "takes +1.0 %" in said and "still fits" in said


def test_the_only_observation_counts_whatever_it_says(client: TestClient) -> None:
    profile_id = _upload(client)
    _observe(client, profile_id, micro_batch=24, peak_bytes=round(_peak(24) * 1.30))
    # 72 GiB / 1.3 = 55.4 GiB: (55.4 - 10) / 2.5 = 18.2.
    assert _suggest(client).max_micro_batch == 18


def test_an_observed_oom_still_caps_below_the_drift(client: TestClient) -> None:
    profile_id = _upload(client)
    for _ in range(3):
        _observe(client, profile_id, micro_batch=24, peak_bytes=round(_peak(24) * 1.04))
    assert _suggest(client).max_micro_batch == 23
    _observe(client, profile_id, micro_batch=20, oom=True)
    got = _suggest(client)
    assert got.max_micro_batch == 19
    assert any("out-of-memory error at micro-batch 20" in w for w in got.warnings)


def test_an_observation_nothing_compares_with_is_stored_and_left_out(client: TestClient) -> None:
    profile_id = _upload(client, with_fit=False)
    stored = _observe(client, profile_id, micro_batch=13, peak_bytes=_peak(13) * 2)
    assert stored["id"] >= 1 and stored["peak_bytes"] == _peak(13) * 2
    assert stored["warnings"] == [
        f"stored, but left out of the drift: profile {profile_id} never measured micro-batch 13 and has "
        "no memory fit to compare the observed peak with"
    ]
    assert _suggest(client).max_micro_batch == 24
    listed = client.get(f"/api/v1/profiles/{profile_id}/observations").json()["items"]
    assert [o["micro_batch"] for o in listed] == [13]


def test_with_a_fit_an_unmeasured_micro_batch_counts(client: TestClient) -> None:
    profile_id = _upload(client)
    for _ in range(2):
        assert _observe(client, profile_id, micro_batch=13, peak_bytes=round(_peak(13) * 1.10))["warnings"] == []
    # 72 GiB / 1.1 = 65.5 GiB: m = 22 (65 GiB).
    assert _suggest(client).max_micro_batch == 22


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"micro_batch": 24, "peak_bytes": 1, "device_name": "NVIDIA B200"}, "device_name"),
        ({"micro_batch": 24, "peak_bytes": 1, "world_size": 4}, "world_size"),
    ],
)
def test_an_observation_of_another_setup_is_refused_naming_the_field(
    client: TestClient, body: dict[str, Any], field: str
) -> None:
    profile_id = _upload(client)
    url = f"/api/v1/profiles/{profile_id}/observations"
    response = client.post(url, json=body, headers=WRITE)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["field"] == field and error["code"] == "observation_mismatch"
    assert client.get(url).json()["items"] == []
    same = client.post(url, json={**body, field: DEFAULT_DEVICE if field == "device_name" else 1}, headers=WRITE)
    assert same.status_code == 201


def test_the_rule_is_the_90th_percentile_and_never_the_single_largest() -> None:
    reference = Reference(trials=((10, 1000, True, False),))
    ratios = [i / 100 for i in range(1, 41)]  # 40 jobs, +1 % .. +40 %
    drift = drift_of([(10, round(1000 * (1 + r))) for r in ratios], reference)
    assert drift is not None and drift.count == 40 and drift.highest == pytest.approx(0.40)
    # floor(40 x 0.1) + 1 = 5th largest: +36 %.
    assert QUANTILE == 0.9 and drift.ratio == pytest.approx(0.36)
    pair = drift_of([(10, 1010), (10, 1500)], reference)
    assert pair is not None and pair.ratio == pytest.approx(0.01)
