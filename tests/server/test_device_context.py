"""GET /api/v1/devices/context: the memory outside the caching allocator that measured CUDA profiles of a
card record (their real trials' outside_allocator_bytes), on both databases."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.factories import profile_payload
from tests.server.conftest import WRITE

MiB = 1 << 20
H200 = "NVIDIA H200"
CONTEXT = "/api/v1/devices/context"


def _with_context(body: dict[str, Any], outside: list[int], torch_version: str = "2.11.0+cu130") -> dict[str, Any]:
    """body's trials split as a CUDA probe records them: outside bytes given, allocated below the rest."""
    body["torch_version"] = torch_version
    for trial, figure in zip(body["trials"], outside * len(body["trials"]), strict=False):
        trial["outside_allocator_bytes"] = figure
        trial["allocated_bytes"] = max(0, trial["peak_bytes"] - figure - 4 * MiB)
    return body


def _upload(client: TestClient, body: dict[str, Any]) -> None:
    response = client.post("/api/v1/profiles", json=body, headers=WRITE)
    assert response.status_code in (200, 201), response.text


def test_the_median_of_each_profiles_decisive_trial(client: TestClient) -> None:
    """Trials at m = 1, 2, 21, 26 (fits, m_max) and 27 (over): the figure grows as a real process loads the
    kernels of larger shapes; each profile counts with its trial at m_max, and the store answers the lower
    median of those over profiles, with the range over every trial."""
    growing = [742 * MiB, 744 * MiB, 797 * MiB, 876 * MiB, 877 * MiB]
    _upload(client, _with_context(profile_payload(device_name=H200), growing))
    _upload(client, _with_context(profile_payload(device_name=H200, seed=3), [760 * MiB] * 3 + [870 * MiB] * 2))
    # Not counted: an estimate's fake trials (its outside bytes are an assumption) and another card.
    _upload(client, _with_context(profile_payload(device_name=H200, source="estimate", seed=1), [800 * MiB]))
    _upload(client, _with_context(profile_payload(seed=2), [500 * MiB]))
    found = client.get(CONTEXT, params={"device_name": H200})
    assert found.status_code == 200, found.text
    assert found.json() == {
        "device_name": H200,
        "torch_version": None,
        "outside_allocator_bytes": 870 * MiB,  # the lower of the two decisive trials (876 and 870 MiB)
        "low_bytes": 742 * MiB,
        "high_bytes": 877 * MiB,
        "trials": 10,
        "profiles": 2,
    }
    same_torch = client.get(CONTEXT, params={"device_name": H200, "torch_version": "2.11"})
    assert same_torch.status_code == 200 and same_torch.json()["torch_version"] == "2.11"


def test_nothing_measured_is_a_404_that_says_so(client: TestClient) -> None:
    _upload(client, _with_context(profile_payload(device_name=H200), [750 * MiB]))
    other_torch = client.get(CONTEXT, params={"device_name": H200, "torch_version": "2.13"})
    assert other_torch.status_code == 404
    assert other_torch.json()["error"]["code"] == "context_not_measured"
    assert "with torch 2.13" in other_torch.json()["error"]["message"]
    unknown = client.get(CONTEXT, params={"device_name": "NVIDIA L4"})
    assert unknown.status_code == 404


def test_a_bad_query_is_a_422_naming_the_field(client: TestClient) -> None:
    assert client.get(CONTEXT).status_code == 422
    bad = client.get(CONTEXT, params={"device_name": H200, "torch_version": "latest"})
    assert bad.status_code == 422
    assert "torch_version" in bad.text
