"""One job setup from the flag to the plan a job receives (issue 40), against a real ``autotune serve`` on SQLite and
on PostgreSQL: a probe or estimate of a setup (tp, a GPipe pipeline, offload within a host budget, fsdp through the
client) is stored, and ``autotune suggest``, ``TunerClient.suggest`` and ``suggest()`` serve the probe's own plan to
a query of that setup; the same query with the setup changed is refused naming the field, never planned over
another D. The observer's reports of a mesh job (its D) are accepted.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from autotune.core.schemas import Observation, Profile, Suggestion
from autotune_client import TunerClient
from autotune_client._suggest import job_fingerprint, suggest
from tests import warm_cli
from tests.conftest import PostgresSchemas
from tests.e2e.conftest import REPO, LiveServer, autotune_command

PROCESS_TIMEOUT_SECONDS = 300
TINY_LLAMA = "hf:examples/configs/tiny-llama.json"


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return warm_cli.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_SECONDS, check=False
    )


def _profile(done: subprocess.CompletedProcess[str]) -> Profile:
    assert done.returncode == 0, done.stderr[-3000:]
    data: Any = json.loads(done.stdout)
    return Profile.model_validate(data[0] if isinstance(data, list) else data)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(
    request: pytest.FixtureRequest, start_live_server: Any, postgres_schemas: PostgresSchemas
) -> Iterator[LiveServer]:
    url = postgres_schemas.new() if request.param == "postgres" else None
    live: LiveServer = start_live_server(database_url=url)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def tp_estimate(tmp_path_factory: pytest.TempPathFactory) -> Profile:
    """Finding 1's estimate: a tiny Llama at L 64 on the CPU meter, W 4 over tp 2 (D 2)."""
    args = ["estimate", TINY_LLAMA, "--device-kind", "cpu", "--device-name", "cpu", "--budget", "4MiB"]
    args += ["--seq-len", "64", "--target-batch", "64", "--world-size", "4", "--tp", "2", "--json"]
    return _profile(_run([*autotune_command(), *args], {**_env(), "AUTOTUNE_URL": ""}))


@pytest.fixture(scope="module")
def gpipe_estimate() -> Profile:
    """Finding 2's: a GPipe pipeline of two stages measured at K = 2 (D 1)."""
    args = ["estimate", "examples/gpt.py:task", "--device-kind", "cpu", "--device-name", "cpu", "--budget", "24MiB"]
    args += ["--target-batch", "64", "--world-size", "2", "--pp", "2", "--pp-schedule", "gpipe"]
    args += ["--pp-microbatches", "2", "--json"]
    return _profile(_run([*autotune_command(), *args], _env()))


@pytest.fixture(scope="module")
def offload_probes() -> tuple[Profile, Profile]:
    """Finding 5's: one probe of activation offload within a host budget, one without (the same fingerprint)."""
    args = ["probe", "examples/gpt.py:task", "--device", "cpu", "--budget", "24MiB", "--target-batch", "64"]
    args += ["--offload", "activations", "--json"]
    capped = _profile(_run([*autotune_command(), *args, "--host-budget", "1MiB"], _env()))
    uncapped = _profile(_run([*autotune_command(), *args], _env()))
    return capped, uncapped


def _env() -> dict[str, str]:
    from tests.e2e.conftest import child_env

    return child_env()


def _suggest_cli(server: LiveServer, *args: str) -> subprocess.CompletedProcess[str]:
    return _run([*autotune_command(), "suggest", "--server", server.url, "--json", *args], server.env())


def _upload(server: LiveServer, profile: Profile) -> int:
    with TunerClient(base_url=server.url, token=server.token) as client:
        return client.upload(profile)


def test_a_tp_profile_is_served_its_own_plan_and_refused_without_its_mesh(
    server: LiveServer, tp_estimate: Profile
) -> None:
    stored = _upload(server, tp_estimate)
    ask = ["--fingerprint", tp_estimate.fingerprint, "--device-name", "cpu", "--target-batch", "64"]
    ask += ["--world-size", "4", "--seq-len", "64"]
    refused = _suggest_cli(server, *ask)
    assert refused.returncode == 2 and "422 mesh: the job asks mesh=(none)" in refused.stderr, refused.stderr
    served = _suggest_cli(server, *ask, "--tp", "2")
    assert served.returncode == 0, served.stderr
    got = Suggestion.model_validate_json(served.stdout)
    assert tp_estimate.plan is not None and got.profile_id == stored and got.mesh == "tp=2"
    assert (got.micro_batch, got.accumulation_steps, got.world_size) == (
        tp_estimate.plan.micro_batch,
        tp_estimate.plan.accumulation_steps,
        tp_estimate.plan.world_size,
    ) == (tp_estimate.max_micro_batch, 64 // (2 * tp_estimate.max_micro_batch), 2)
    with TunerClient(base_url=server.url, token=server.token) as client:
        same = client.suggest(
            fingerprint=tp_estimate.fingerprint,
            target_batch=64,
            world_size=4,
            device_name="cpu",
            seq_len=64,
            mesh="tp=2",
        )
        assert (same.micro_batch, same.accumulation_steps, same.world_size) == (
            got.micro_batch,
            got.accumulation_steps,
            2,
        )
        # Finding 8: the observer posts the plan's world size (D 2); the profile was measured over W 4.
        kept = client.observe(stored, Observation(micro_batch=got.micro_batch, world_size=got.world_size))
        assert kept is not None


def test_a_gpipe_profile_is_served_within_its_measured_k(server: LiveServer, gpipe_estimate: Profile) -> None:
    _upload(server, gpipe_estimate)
    ask = ["--fingerprint", gpipe_estimate.fingerprint, "--device-name", "cpu", "--target-batch", "64"]
    served = _suggest_cli(server, *ask, "--world-size", "2", "--pp", "2", "--pp-schedule", "gpipe")
    assert served.returncode == 0, served.stderr
    got = Suggestion.model_validate_json(served.stdout)
    plan = gpipe_estimate.plan
    assert plan is not None and plan.accumulation_steps <= 2
    assert (got.micro_batch, got.accumulation_steps, got.world_size, got.exact) == (
        plan.micro_batch,
        plan.accumulation_steps,
        plan.world_size,
        plan.exact,
    )
    assert got.micro_batches == plan.micro_batches  # equal micro-batches: the schedule's K, not A = 22
    changed = _suggest_cli(server, *ask, "--world-size", "2", "--pp", "2")  # 1f1b: another schedule
    assert changed.returncode == 2 and "422 mesh" in changed.stderr


def test_host_capped_and_uncapped_probes_answer_their_own_jobs(
    server: LiveServer, offload_probes: tuple[Profile, Profile]
) -> None:
    capped, uncapped = offload_probes
    assert capped.fingerprint == uncapped.fingerprint and capped.max_micro_batch < uncapped.max_micro_batch
    capped_id, uncapped_id = _upload(server, capped), _upload(server, uncapped)
    ask = ["--fingerprint", capped.fingerprint, "--device-name", "cpu", "--target-batch", "64"]
    plain = Suggestion.model_validate_json(_suggest_cli(server, *ask).stdout)
    assert (plain.profile_id, plain.max_micro_batch) == (uncapped_id, uncapped.max_micro_batch)
    within = _suggest_cli(server, *ask, "--host-budget", "1MiB")
    got = Suggestion.model_validate_json(within.stdout)
    assert (got.profile_id, got.max_micro_batch, got.host_budget_bytes) == (capped_id, capped.max_micro_batch, 2**20)
    other = _suggest_cli(server, *ask, "--host-budget", "3MiB")
    assert other.returncode == 2 and "422 host_budget_bytes" in other.stderr


def test_an_fsdp_job_finds_its_own_upload_on_the_second_call(server: LiveServer) -> None:
    # Finding 6: suggest(strategy="fsdp") fingerprinted without the fsdp tags, so it never found its profile.
    from examples import gpt

    batch, model = gpt.task.batch, gpt.task.model()
    ask: dict[str, Any] = {"example": batch, "world_size": 2, "strategy": "fsdp", "budget": "24MiB", "device": "cpu"}
    ask["loss"] = gpt.token_mean_loss
    with TunerClient(base_url=server.url, token=server.token) as client:
        first = suggest(model, 64, client=client, **ask)
        assert first.source == "probed" and first.profile_id is not None
        second = suggest(model, 64, client=client, probe_if_missing=False, **ask)
        assert (second.source, second.profile_id, second.strategy) == ("measured", first.profile_id, "fsdp")
        assert (second.micro_batch, second.accumulation_steps) == (first.micro_batch, first.accumulation_steps)
        stored = client.profile(first.profile_id).profile
    key = job_fingerprint(model, example=batch, strategy="fsdp", world_size=2)
    assert key == stored.fingerprint != job_fingerprint(model, example=batch)
