"""GET /suggest answers a job setup (issue 40): a profile is served only to a query of its own setup, the plan is the
one the probe made (over the profile's mesh, a pipeline's K within its measured bounds), and a difference that
changes memory or D is a 422 naming the field, never a plan over another D. On SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from autotune.core.mesh import Mesh
from autotune.core.schemas import Profile, Suggestion
from autotune.core.setup import JobSetup
from tests.factories import DEFAULT_DEVICE, FINGERPRINT, profile_payload
from tests.server.conftest import WRITE

SUGGEST = "/api/v1/suggest"
ASK = {"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE}


def _store(client: TestClient, body: dict[str, Any]) -> int:
    stored = client.post("/api/v1/profiles", json=body, headers=WRITE)
    assert stored.status_code == 201, stored.text
    return int(stored.json()["id"])


def _mesh_profile(mesh: dict[str, Any], *, world_size: int, max_micro_batch: int = 24, **kwargs: Any) -> dict[str, Any]:
    body = profile_payload(max_micro_batch=max_micro_batch, world_size=world_size, **kwargs)
    body["mesh"] = mesh
    if mesh.get("pp", 1) > 1:
        k = mesh.get("pp_microbatches", mesh["pp"])
        body["pipeline"] = {
            "microbatches": k,
            "stage_peak_bytes": [body["trials"][-2]["peak_bytes"]] * mesh["pp"],
            "most_loaded_stage": 0,
            "bubble_fraction": (mesh["pp"] - 1) / (k + mesh["pp"] - 1),
        }
    return body


def test_a_tp_profile_asked_without_its_mesh_is_a_422_naming_the_mesh(client: TestClient) -> None:
    # Finding 1: a tp 2 profile at W 4 asked without --tp answered 4 x 4 x 4 = 64 "exact"; the job runs D = 2.
    _store(client, _mesh_profile({"tp": 2}, world_size=4, max_micro_batch=4, bytes_per_sample=15 * 2**30))
    asked = client.get(SUGGEST, params={**ASK, "target_batch": 64, "world_size": 4})
    assert asked.status_code == 422, asked.text
    error = asked.json()["error"]
    assert error["code"] == "setup_mismatch" and error["field"] == "mesh"
    assert "mesh=tp=2" in error["message"] and "mesh=(none)" in error["message"]
    served = client.get(SUGGEST, params={**ASK, "target_batch": 64, "world_size": 4, "mesh": "tp=2"})
    assert served.status_code == 200, served.text
    got = Suggestion.model_validate(served.json())
    # The probe's own plan of the profile: 4 x 8 x 2 = 64 over D = 2.
    expected = JobSetup(world_size=4, mesh=Mesh(tp=2)).plan(4, 64)
    assert (got.micro_batch, got.accumulation_steps, got.world_size) == (4, 8, 2) == (
        expected.micro_batch,
        expected.accumulation_steps,
        expected.world_size,
    )
    assert got.mesh == "tp=2" and got.effective_batch == 64 and got.source == "measured"


def test_a_plain_profile_asked_with_a_mesh_is_refused_not_served_as_that_mesh(client: TestClient) -> None:
    _store(client, profile_payload(max_micro_batch=24, world_size=4))
    asked = client.get(SUGGEST, params={**ASK, "target_batch": 64, "world_size": 4, "mesh": "tp=2"})
    assert asked.status_code == 422, asked.text
    assert asked.json()["error"]["field"] == "mesh"
    assert "mesh=tp=2" in asked.json()["error"]["message"]


def test_a_gpipe_profile_is_planned_within_its_measured_k_in_equal_micro_batches(client: TestClient) -> None:
    # Finding 2: a GPipe profile measured at K = 2 was served A = 22 in uneven micro-batches, as "measured".
    mesh = {"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 2}
    _store(client, _mesh_profile(mesh, world_size=2, max_micro_batch=20, bytes_per_sample=2**30))
    served = client.get(SUGGEST, params={**ASK, "target_batch": 64, "world_size": 2, "mesh": "pp=2,pp_schedule=gpipe"})
    assert served.status_code == 200, served.text
    got = Suggestion.model_validate(served.json())
    assert got.accumulation_steps <= 2 and len(got.micro_batches) == 1  # K within its bound, equal micro-batches
    assert got.micro_batch <= 20 and got.world_size == 1
    assert not got.exact and any("1 <= K <= 2" in w for w in got.warnings)  # 64 needs m 32 at K 2: said


def test_a_1f1b_profile_is_never_planned_below_k_equal_pp(client: TestClient) -> None:
    mesh = {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4}
    _store(client, _mesh_profile(mesh, world_size=2, max_micro_batch=24, bytes_per_sample=2**30))
    served = client.get(SUGGEST, params={**ASK, "target_batch": 8, "world_size": 2, "mesh": "pp=2"})
    assert served.status_code == 200, served.text
    got = Suggestion.model_validate(served.json())
    # The ordinary planner answered 8 x 1: one micro-batch in flight for two stages.
    assert got.accumulation_steps >= 2 and got.micro_batch * got.accumulation_steps == 8
    assert got.mesh == "pp=2,pp_schedule=1f1b,pp_microbatches=4"


def test_a_mesh_profile_without_ddp_buckets_says_so_to_a_job_with_them(client: TestClient) -> None:
    # Finding 3: under tp with ddp, a profile at D = 1 (no buckets) answered a D > 1 job silently: the kind read
    # W > 1. It answers as a plain ddp profile at one replica does, with the buckets' warning, and a profile
    # that held them answers first.
    alone = _store(client, _mesh_profile({"tp": 2}, world_size=2, max_micro_batch=24))
    served = client.get(SUGGEST, params={**ASK, "target_batch": 64, "world_size": 4, "mesh": "tp=2"})
    assert served.status_code == 200, served.text
    got = Suggestion.model_validate(served.json())
    assert got.profile_id == alone and got.world_size == 2
    assert any("DDP's gradient buckets" in w and "were not counted" in w for w in got.warnings)
    with_buckets = _store(client, _mesh_profile({"tp": 2}, world_size=8, max_micro_batch=20, seed=-1))
    served = client.get(SUGGEST, params={**ASK, "target_batch": 64, "world_size": 4, "mesh": "tp=2"})
    got = Suggestion.model_validate(served.json())
    assert got.profile_id == with_buckets and not any("buckets" in w for w in got.warnings)


def _offload_profile(*, host_budget: int | None, max_micro_batch: int, seed: int) -> dict[str, Any]:
    body = profile_payload(max_micro_batch=max_micro_batch, seed=seed, tags={"offload": "activations"})
    body["offload"] = "activations"
    body["host_budget_bytes"] = host_budget
    for trial in body["trials"]:
        trial["host_peak_bytes"] = trial["micro_batch"] * 1000
    return body


def test_host_capped_and_uncapped_profiles_answer_their_own_jobs(client: TestClient) -> None:
    # Finding 5: a host-capped (m 3) and an uncapped (m 6) profile shared a kind: the newest answered every job.
    uncapped = _store(client, _offload_profile(host_budget=None, max_micro_batch=6, seed=1))
    capped = _store(client, _offload_profile(host_budget=3500, max_micro_batch=3, seed=2))
    plain = client.get(SUGGEST, params={**ASK, "target_batch": 12})
    assert plain.status_code == 200, plain.text
    assert (plain.json()["profile_id"], plain.json()["max_micro_batch"]) == (uncapped, 6)
    assert plain.json()["host_budget_bytes"] is None
    within = client.get(SUGGEST, params={**ASK, "target_batch": 12, "host_budget_bytes": 3500})
    assert within.status_code == 200, within.text
    assert (within.json()["profile_id"], within.json()["max_micro_batch"]) == (capped, 3)
    assert within.json()["host_budget_bytes"] == 3500
    other = client.get(SUGGEST, params={**ASK, "target_batch": 12, "host_budget_bytes": 9999})
    assert other.status_code == 422 and other.json()["error"]["field"] == "host_budget_bytes"
    assert "host_budget_bytes=3500" in other.json()["error"]["message"]


def test_a_host_budget_on_a_profile_without_offload_is_a_422(client: TestClient) -> None:
    _store(client, profile_payload(max_micro_batch=24))
    asked = client.get(SUGGEST, params={**ASK, "target_batch": 64, "host_budget_bytes": 2**30})
    assert asked.status_code == 422 and asked.json()["error"]["field"] == "host_budget_bytes"
    assert "no host budget" in asked.json()["error"]["message"]


def test_an_eager_estimate_of_a_compiled_job_says_so(client: TestClient) -> None:
    # Finding 11: an estimate with --compile ran eager; /suggest dropped the caveat.
    _store(client, profile_payload(max_micro_batch=24, source="estimate", tags={"compile": "default"}))
    served = client.get(SUGGEST, params={**ASK, "target_batch": 48})
    assert served.status_code == 200, served.text
    assert any("fake trials ran the eager step" in w for w in served.json()["warnings"])
    refused = client.get(SUGGEST, params={**ASK, "target_batch": 48, "compile": "max-autotune"})
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "compile"


def test_the_profile_and_the_query_build_the_same_setup() -> None:
    body = _mesh_profile({"tp": 2, "pp": 2, "pp_microbatches": 4}, world_size=8)
    profile = Profile.model_validate(body)
    assert JobSetup.of_profile(profile).data_parallel == 2 and JobSetup.of_profile(profile).holds_ddp_buckets
    assert JobSetup.of_profile(profile).pipeline_microbatches == (2, 4)
    from autotune.core.schemas import SuggestQuery

    query = SuggestQuery(**ASK, target_batch=64, world_size=8, mesh="tp=2,pp=2,pp_microbatches=4")
    assert JobSetup.of_query(query).mesh == JobSetup.of_profile(profile).mesh and query.data_parallel == 2


def test_a_profile_answers_only_a_query_of_its_own_loss(client: TestClient) -> None:
    # --loss (autotune/tasks/losses.py): the tag lm_loss is in the fingerprint; a query that names another loss is a
    # 422 naming the field, one that leaves it out takes the profile's, and "chunked" is TRL's chunked:256.
    _store(client, profile_payload(max_micro_batch=24, tags={"lm_loss": "chunked:256"}))
    assert client.get(SUGGEST, params={**ASK, "target_batch": 48}).status_code == 200
    served = client.get(SUGGEST, params={**ASK, "target_batch": 48, "lm_loss": "chunked"})
    assert served.status_code == 200, served.text
    refused = client.get(SUGGEST, params={**ASK, "target_batch": 48, "lm_loss": "plain"})
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "lm_loss"
    message = refused.json()["error"]["message"]
    assert "lm_loss=plain" in message and "lm_loss=chunked:256" in message
    bad = client.get(SUGGEST, params={**ASK, "target_batch": 48, "lm_loss": "chunked:0"})
    assert bad.status_code == 422 and "lm_loss" in bad.text and "a chunk holds 1 to" in bad.text


def test_a_profile_of_the_plain_loss_answers_a_plain_query_and_refuses_a_fused_one(client: TestClient) -> None:
    _store(client, profile_payload(max_micro_batch=24))
    assert client.get(SUGGEST, params={**ASK, "target_batch": 48, "lm_loss": "plain"}).status_code == 200
    refused = client.get(SUGGEST, params={**ASK, "target_batch": 48, "lm_loss": "fused-linear"})
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "lm_loss"
