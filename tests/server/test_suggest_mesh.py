"""GET /suggest for a job on a mesh (issue 34): the mesh's profiles match through the fingerprint, and the plan
holds the target over the data-parallel replicas only, D = world_size / (tp x pp x cp)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from autotune.core.plan import plan
from autotune.core.schemas import Profile, Suggestion
from tests.factories import DEFAULT_DEVICE, FINGERPRINT, profile_payload
from tests.server.conftest import WRITE

SUGGEST = "/api/v1/suggest"


def test_a_mesh_profile_is_stored_whole_and_planned_over_the_data_parallel_replicas(client: TestClient) -> None:
    body = profile_payload(max_micro_batch=24, world_size=8, strategy="fsdp")
    body["mesh"] = {"tp": 2}
    stored = client.post("/api/v1/profiles", json=body, headers=WRITE)
    assert stored.status_code == 201, stored.text
    shown = client.get(f"/api/v1/profiles/{stored.json()['id']}")
    assert Profile.model_validate(shown.json()["profile"]).mesh == {"tp": 2}
    query = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": 512}
    query |= {"world_size": 8, "strategy": "fsdp", "mesh": "tp=2"}
    response = client.get(SUGGEST, params=query)
    assert response.status_code == 200, response.text
    got = Suggestion.model_validate(response.json())
    expected = plan(24, 512, 4)  # 8 ranks over tp 2: 4 replicas
    assert (got.micro_batch, got.accumulation_steps, got.world_size) == (
        expected.micro_batch,
        expected.accumulation_steps,
        4,
    )
    assert got.effective_batch == 512


def test_a_mesh_that_does_not_divide_the_world_is_a_422_naming_it(client: TestClient) -> None:
    query = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": 64, "world_size": 8}
    response = client.get(SUGGEST, params={**query, "mesh": "tp=3"})
    assert response.status_code == 422
    assert "--world-size 8 is not a multiple of --tp x --pp x --cp" in response.text


def test_a_profile_with_a_mesh_no_job_runs_is_refused() -> None:
    body = profile_payload()
    body["mesh"] = {"pp": 2, "pp_microbatches": 1}
    try:
        Profile.model_validate(body)
    except ValueError as exc:
        assert "--pp-microbatches 1 is below --pp 2" in str(exc)
    else:
        raise AssertionError("a mesh with K < pp under 1F1B was accepted")


def test_the_client_sends_the_mesh_only_when_there_is_one() -> None:
    from autotune.core.schemas import SuggestQuery
    from autotune_client._client import _suggest_params

    base = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": 64, "world_size": 8}
    assert "mesh" not in _suggest_params(SuggestQuery(**base))  # an older server answers as it did
    assert _suggest_params(SuggestQuery(**base, mesh="tp=2"))["mesh"] == "tp=2"


def test_the_suggest_command_takes_the_mesh_flags() -> None:
    from autotune.cli.common import mesh_of
    from autotune.cli.parser import build_parser

    args = build_parser().parse_args(
        ["suggest", "--fingerprint", FINGERPRINT, "--device-name", "x", "--world-size", "8", "--tp", "2"]
    )
    assert mesh_of(args).label() == "tp=2"


def test_a_composition_the_table_refuses_is_a_422_naming_both_flags(client: TestClient) -> None:
    """/suggest refuses what the composition table refuses, as the CLI refuses the job (issue 61), in its words."""
    query = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, "target_batch": 64}
    refused = {
        "--strategy fsdp with --world-size 1": {"strategy": "fsdp", "world_size": 1},
        "--offload params with --strategy ddp": {"offload": "params", "world_size": 2},
        "--cp 2 with --compile default": {"mesh": "cp=2", "world_size": 2, "compile": "default"},
    }
    for words, more in refused.items():
        response = client.get(SUGGEST, params={**query, **more})
        assert response.status_code == 422, (more, response.text)
        assert words in response.json()["error"]["message"], response.text
