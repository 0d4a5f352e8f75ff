"""GET /api/v1/suggest from an estimate of a CUDA card, re-derived with the memory outside the allocator that
measured profiles of the card hold (autotune_server.measured_context), on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from autotune.core.plan import plan
from autotune.core.schemas import Suggestion
from tests.factories import fingerprint_for, profile_payload
from tests.server.conftest import WRITE

MiB = 1 << 20
H200 = "NVIDIA H200"
SUGGEST = "/api/v1/suggest"
ESTIMATED = fingerprint_for("estimated on an emulated H200")
MEASURED = fingerprint_for("measured on a real H200")
TORCH = "2.11.0+cu130"
# The estimate: 2 GiB at 10 % headroom (a limit of 1843.2 MiB), figures of 900 MiB + 38 MiB per sample with
# 800 MiB of them outside the allocator; trials at m = 1, 2, 12, 24 (m_max: 1812 MiB) and 25 (1850 MiB, over).
ESTIMATE = {
    "fingerprint": ESTIMATED,
    "device_name": H200,
    "source": "estimate",
    "budget_bytes": 2048 * MiB,
    "headroom": 0.1,
    "max_micro_batch": 24,
    "fixed_bytes": 900 * MiB,
    "bytes_per_sample": 38 * MiB,
}


def _with_outside(body: dict[str, Any], outside: list[int], torch_version: str = TORCH) -> dict[str, Any]:
    """body's trials split as a CUDA trial records them: outside bytes given (the last one repeated),
    allocated below the rest."""
    body["torch_version"] = torch_version
    for i, trial in enumerate(body["trials"]):
        trial["outside_allocator_bytes"] = outside[min(i, len(outside) - 1)]
        trial["allocated_bytes"] = max(0, trial["peak_bytes"] - trial["outside_allocator_bytes"] - 4 * MiB)
    return body


def _upload(client: TestClient, body: dict[str, Any]) -> int:
    response = client.post("/api/v1/profiles", json=body, headers=WRITE)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def _estimate(client: TestClient, torch_version: str = TORCH) -> int:
    return _upload(client, _with_outside(profile_payload(**ESTIMATE), [800 * MiB], torch_version))


def _measurement(client: TestClient, outside: list[int], **kwargs: Any) -> int:
    """A measured profile of another setup on the H200 (m_max 24 is its 4th trial, the decisive one)."""
    body = profile_payload(fingerprint=MEASURED, device_name=H200, **kwargs)
    return _upload(client, _with_outside(body, outside, kwargs.pop("torch_version", TORCH)))


def _suggest(client: TestClient, fingerprint: str = ESTIMATED) -> Suggestion:
    response = client.get(SUGGEST, params={"fingerprint": fingerprint, "device_name": H200, "target_batch": 48})
    assert response.status_code == 200, response.text
    return Suggestion.model_validate(response.json())


def _re_derived(answer: Suggestion) -> list[str]:
    return [w for w in answer.warnings if w.startswith("estimate re-derived")]


def test_an_estimate_answers_with_the_outside_bytes_its_card_measured(client: TestClient) -> None:
    """876 MiB measured against the 800 assumed: m = 24 reads 1888 MiB, over the limit; 12 (1432 MiB) is the
    largest tested size below it. The plan is the one of m_max 12, and the stored estimate is unchanged."""
    estimate = _estimate(client)
    _measurement(client, [742 * MiB, 760 * MiB, 797 * MiB, 876 * MiB, 877 * MiB])
    got = _suggest(client)
    assert (got.source, got.profile_id, got.max_micro_batch) == ("estimated", estimate, 12)
    expected = plan(12, 48, 1)
    assert (got.micro_batch, got.accumulation_steps, got.micro_batches) == (
        expected.micro_batch,
        expected.accumulation_steps,
        expected.micro_batches,
    )
    assert got.peak_bytes == 900 * MiB + 12 * 38 * MiB + 76 * MiB  # the re-derived figure at m = 12
    assert _re_derived(got) == [
        "estimate re-derived with the 876.00 MiB outside the allocator measured on NVIDIA H200 (1 profile, "
        "torch 2.11) instead of the estimate's 800.00 MiB: max micro-batch 12 (the estimate's 24)"
    ]
    assert got.warnings[0].startswith("estimated, not measured")
    stored = client.get(f"/api/v1/profiles/{estimate}").json()["profile"]
    assert stored["max_micro_batch"] == 24
    assert {t["outside_allocator_bytes"] for t in stored["trials"]} == {800 * MiB}
    # The measurement itself answers as measured, untouched.
    measured = _suggest(client, MEASURED)
    assert (measured.source, measured.max_micro_batch, _re_derived(measured)) == ("measured", 24, [])


def test_nothing_measured_on_the_card_answers_the_stored_estimate(client: TestClient) -> None:
    """Neither another card's measurement nor another estimate of the H200 is a measured context; the first
    measurement of the H200 re-derives the next answer (an upload clears the cached one)."""
    _estimate(client)
    _upload(client, _with_outside(profile_payload(fingerprint=MEASURED), [500 * MiB]))  # an A100
    other = profile_payload(fingerprint=fingerprint_for("another estimate"), device_name=H200, source="estimate")
    _upload(client, _with_outside(other, [876 * MiB]))
    got = _suggest(client)
    assert (got.source, got.max_micro_batch, got.micro_batch, got.accumulation_steps) == ("estimated", 24, 24, 2)
    assert _re_derived(got) == []
    _measurement(client, [876 * MiB])
    assert _suggest(client).max_micro_batch == 12


def test_another_torch_is_used_where_the_estimates_own_is_not_measured(client: TestClient) -> None:
    """An estimate for torch 2.12, measurements with 2.11 only: theirs, of any torch. 742 MiB, less than
    assumed: m = 25 (1792 MiB) now fits and is the largest size tested."""
    _estimate(client, torch_version="2.12.0")
    _measurement(client, [742 * MiB])
    got = _suggest(client)
    assert got.max_micro_batch == 25
    assert _re_derived(got) == [
        "estimate re-derived with the 742.00 MiB outside the allocator measured on NVIDIA H200 (1 profile) "
        "instead of the estimate's 800.00 MiB: max micro-batch 25 (the estimate's 24)"
    ]


def test_nothing_fitting_with_the_measured_figure_is_a_422_that_says_so(client: TestClient) -> None:
    _estimate(client)
    _measurement(client, [1800 * MiB])
    response = client.get(SUGGEST, params={"fingerprint": ESTIMATED, "device_name": H200, "target_batch": 48})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "budget_too_small"
    assert "\n" not in error["message"]
    assert error["message"].endswith("not even micro-batch 1 fits; probe on NVIDIA H200 for a measured figure")
