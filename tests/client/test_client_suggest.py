"""suggest(model, T): fingerprint, server hit, miss -> local probe + upload, fallbacks, and the
caller's model left exactly as it was."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import torch
from torch import nn

import autotune.measure.trial
import autotune.orchestrate.probe
from autotune.core.schemas import Profile
from autotune.orchestrate.probe import ProbeConfig
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.task import ProbeTask
from autotune_client import (
    APIConnectionError,
    APITimeoutError,
    AutotuneClientError,
    NotFoundError,
    TunerClient,
    TunerUnavailableWarning,
    UnprocessableEntityError,
    job_fingerprint,
    parse_bytes,
    suggest,
)
from examples import mlp
from tests.client._factories import (
    error_body,
    json_response,
    make_profile,
    make_suggestion,
    mock_client,
    sequence,
)
from tests.client.test_client_timeouts import BlackHole

REPO = Path(__file__).resolve().parents[2]


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))


def tiny_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(m, 64), torch.randn(m, 8)


@pytest.fixture(autouse=True)
def _no_ambient_server(monkeypatch: pytest.MonkeyPatch) -> None:
    # The developer's shell may point at a real tuner; these tests choose their server themselves.
    for name in ("AUTOTUNE_URL", "AUTOTUNE_TOKEN", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


class FakeProbe:
    """Stands in for autotune.orchestrate.probe.probe: records what it was asked, answers like the real one."""

    def __init__(self) -> None:
        self.calls: list[tuple[ProbeTask, ProbeConfig]] = []

    def __call__(self, task: ProbeTask, config: ProbeConfig, **_: Any) -> Profile:
        self.calls.append((task, config))
        # The real probe stamps the task's own fingerprint: so does this, so that a mismatch between
        # the job's fingerprint and the probed task's would show.
        return make_profile(fingerprint=task_fingerprint(task), max_micro_batch=20)


@pytest.fixture
def fake_probe(monkeypatch: pytest.MonkeyPatch) -> FakeProbe:
    fake = FakeProbe()
    monkeypatch.setattr(autotune.orchestrate.probe, "probe", fake)
    return fake


@pytest.fixture
def no_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a trial ran although the server had the answer")

    monkeypatch.setattr(autotune.orchestrate.probe, "probe", forbidden)
    monkeypatch.setattr(autotune.measure.trial, "run_trial", forbidden)


# -- fingerprint ---------------------------------------------------------------------------------


def test_job_fingerprint_equals_the_probe_task_fingerprint() -> None:
    assert job_fingerprint(mlp.MLP(), example=mlp.task.batch) == task_fingerprint(mlp.task)
    # A batch instead of the callable: its first sample is what counts.
    assert job_fingerprint(mlp.MLP(), example=mlp.make_batch(7)) == task_fingerprint(mlp.task)


def test_job_fingerprint_changes_with_what_changes_memory() -> None:
    base = job_fingerprint(tiny_model(), example=tiny_batch)
    assert job_fingerprint(tiny_model(), example=tiny_batch, precision="bf16") != base
    assert job_fingerprint(tiny_model(), example=tiny_batch, tags={"seq_len": 2}) != base
    assert job_fingerprint(tiny_model(), example=lambda m: (torch.randn(m, 64), torch.randn(m, 9))) != base
    frozen = tiny_model()
    frozen[0].weight.requires_grad_(False)
    assert job_fingerprint(frozen, example=tiny_batch) != base


def test_a_length_the_example_is_not_made_at_is_refused_before_anything_is_asked() -> None:
    """Issue 62, item 1: the job's seq_len is a dimension of its example, or the local probe would measure the
    example's length and store (and answer) it as seq_len's. Refused before the store is asked or a trial runs."""
    tokens = lambda m: {"input_ids": torch.zeros(m, 64, dtype=torch.long)}  # noqa: E731
    with pytest.raises(AutotuneClientError) as caught:
        job_fingerprint(tiny_model(), example=tokens, seq_len=4096)
    assert str(caught.value) == (
        "seq_len 4096: no dimension of the example's sample is 4096 (its shapes without the batch dimension: [64]): "
        "make the example at the job's length, which is what is measured and answered"
    )
    with pytest.raises(AutotuneClientError, match="seq_len 4096: no dimension of the example's sample is 4096"):
        suggest(tiny_model(), 64, example=tokens, seq_len=4096, probe_if_missing=False)
    # At its own length the fingerprint is the sequence-aware one.
    assert job_fingerprint(tiny_model(), example=tokens, seq_len=64) != job_fingerprint(tiny_model(), example=tokens)


def test_the_fingerprint_of_a_model_built_in_two_processes_is_equal() -> None:
    script = textwrap.dedent(
        """
        import sys, torch
        from examples import mlp
        from autotune_client import job_fingerprint
        torch.manual_seed(int(sys.argv[1]))  # different weights: they must not matter
        print(job_fingerprint(mlp.MLP(), example=mlp.make_batch(3, seed=int(sys.argv[1]))))
        """
    )
    digests = []
    for seed, hash_seed in (("1", "11"), ("2", "22")):
        done = subprocess.run(
            [sys.executable, "-c", script, seed],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env={**_child_env(), "PYTHONHASHSEED": hash_seed},
            check=True,
        )
        digests.append(done.stdout.strip())
    assert digests[0] == digests[1]
    assert digests[0] == task_fingerprint(mlp.task)


def _child_env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    env["PYTHONPATH"] = str(REPO)
    return env


# -- a hit: the server answers, nothing is measured -----------------------------------------------


def test_a_stored_answer_is_returned_without_any_trial(
    no_trials: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    expected = make_suggestion()
    handler, seen = sequence(json_response(200, expected.model_dump(mode="json")))
    with mock_client(handler) as client:
        got = suggest(mlp.MLP(), 128, example=mlp.task.batch, client=client)
    assert got == expected
    params = seen[0].url.params
    assert params["fingerprint"] == task_fingerprint(mlp.task)
    assert params["world_size"] == "2"  # from $WORLD_SIZE
    assert params["device_name"] == "cpu"
    assert params["target_batch"] == "128"


def test_explicit_world_size_and_budget_reach_the_server(no_trials: None) -> None:
    handler, seen = sequence(json_response(200, make_suggestion(world_size=4).model_dump(mode="json")))
    with mock_client(handler) as client:
        suggest(tiny_model(), 128, example=tiny_batch, world_size=4, budget="1GiB", client=client)
    assert seen[0].url.params["world_size"] == "4"
    assert seen[0].url.params["budget_bytes"] == str(1 << 30)


def test_the_client_is_built_from_the_environment(no_trials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    handler, seen = sequence(json_response(200, make_suggestion().model_dump(mode="json")))
    real_init = TunerClient.__init__

    def init_with_mock(self: TunerClient, **kwargs: Any) -> None:
        real_init(self, **kwargs, http_client=httpx.Client(transport=httpx.MockTransport(handler)))

    monkeypatch.setattr(TunerClient, "__init__", init_with_mock)
    monkeypatch.setenv("AUTOTUNE_URL", "http://env-tuner:1234")
    assert suggest(tiny_model(), 128, example=tiny_batch).source == "measured"
    assert seen[0].url.host == "env-tuner"


# -- a miss: probe here, upload, answer ----------------------------------------------------------


def test_a_batch_example_is_used_by_its_first_sample_and_left_untouched(fake_probe: FakeProbe) -> None:
    inputs, targets = torch.randn(6, 64), torch.randint(0, 8, (6,))
    saved = (inputs.clone(), targets.clone())
    with pytest.warns(TunerUnavailableWarning):
        suggest(tiny_model(), 40, example=(inputs, targets), budget="8MiB")
    ((task, _),) = fake_probe.calls
    made_inputs, made_targets = task.batch(3)
    assert made_inputs.shape == (3, 64) and made_targets.shape == (3,)
    assert torch.equal(made_inputs[2], inputs[0]) and made_targets.dtype == torch.int64
    assert torch.equal(inputs, saved[0]) and torch.equal(targets, saved[1])


def test_a_miss_probes_locally_uploads_and_returns_probed(fake_probe: FakeProbe) -> None:
    ref = {"id": 31, "content_hash": "0" * 64, "created": True, "url": "/api/v1/profiles/31"}
    handler, seen = sequence(
        json_response(404, error_body("no_matching_profile", "nothing stored for this fingerprint")),
        json_response(201, ref),
    )
    model = tiny_model()
    with mock_client(handler, token="w") as client:
        got = suggest(model, 40, example=tiny_batch, budget="8MiB", client=client)
    ((task, config),) = fake_probe.calls
    assert (config.device, config.budget_bytes, config.target_batch, config.world_size) == (
        "cpu",
        8 << 20,
        40,
        1,
    )
    built = task.model()
    assert built is not model and built.training
    assert task.precision == "fp32"
    # The profile went up under the very fingerprint the job asked for.
    upload = json.loads(seen[1].content)
    assert seen[1].method == "POST" and seen[1].url.path == "/api/v1/profiles"
    assert upload["fingerprint"] == seen[0].url.params["fingerprint"]
    assert (got.source, got.profile_id, got.max_micro_batch) == ("probed", 31, 20)
    assert got.micro_batch * got.accumulation_steps * got.world_size == got.effective_batch == 40
    assert got.micro_batch <= 20


def test_a_miss_without_probe_if_missing_raises_not_found(fake_probe: FakeProbe) -> None:
    handler, _ = sequence(
        json_response(404, error_body("no_matching_profile", "nothing stored; run autotune probe"))
    )
    with mock_client(handler) as client, pytest.raises(NotFoundError, match="run autotune probe"):
        suggest(tiny_model(), 40, example=tiny_batch, budget="8MiB", probe_if_missing=False, client=client)
    assert fake_probe.calls == []


def test_a_failed_upload_warns_and_still_answers(fake_probe: FakeProbe) -> None:
    handler, _ = sequence(
        json_response(404, error_body("no_matching_profile", "nothing")),
        json_response(401, error_body("authentication_required", "a write needs a bearer token")),
    )
    with mock_client(handler) as client, pytest.warns(TunerUnavailableWarning, match="not uploaded"):
        got = suggest(tiny_model(), 40, example=tiny_batch, budget="8MiB", client=client)
    assert got.source == "probed" and got.profile_id is None
    assert any("bearer token" in w for w in got.warnings)


def test_an_unreachable_server_warns_probes_and_does_not_try_to_upload(fake_probe: FakeProbe) -> None:
    handler, seen = sequence(*[httpx.ConnectError("connection refused")] * 3)
    with mock_client(handler) as client, pytest.warns(TunerUnavailableWarning, match="tuner unavailable"):
        got = suggest(tiny_model(), 40, example=tiny_batch, budget="8MiB", client=client)
    assert got.source == "probed" and got.profile_id is None
    assert len(fake_probe.calls) == 1
    assert all(r.method == "GET" for r in seen)  # three suggest attempts, no upload


def test_an_unreachable_server_without_probe_if_missing_raises(fake_probe: FakeProbe) -> None:
    handler, _ = sequence(*[httpx.ConnectError("connection refused")] * 3)
    with mock_client(handler) as client, pytest.raises(APIConnectionError):
        suggest(tiny_model(), 40, example=tiny_batch, probe_if_missing=False, client=client)
    assert fake_probe.calls == []


def test_a_silent_server_costs_the_job_no_more_than_the_client_timeout(fake_probe: FakeProbe) -> None:
    hole = BlackHole()
    try:
        with TunerClient(base_url=f"http://127.0.0.1:{hole.port}", timeout=2.0) as client:
            started = time.monotonic()
            with pytest.raises(APITimeoutError):
                suggest(tiny_model(), 40, example=tiny_batch, probe_if_missing=False, client=client)
            # Bounded by the client's timeout plus the job's own fingerprinting (slack for a shared,
            # noisy machine), and below the 6 s that three attempts of 2 s would take.
            assert time.monotonic() - started < 2.0 + 2.5
            with pytest.warns(TunerUnavailableWarning):
                got = suggest(tiny_model(), 40, example=tiny_batch, budget="8MiB", client=client)
        assert got.source == "probed"
    finally:
        hole.close()


def test_a_request_the_server_rejects_is_raised_not_probed(fake_probe: FakeProbe) -> None:
    handler, _ = sequence(
        json_response(422, error_body("validation_error", "device_name: too long", "device_name"))
    )
    with mock_client(handler) as client, pytest.raises(UnprocessableEntityError):
        suggest(tiny_model(), 40, example=tiny_batch, client=client)
    assert fake_probe.calls == []


def test_no_server_configured_and_no_probe_is_an_error(fake_probe: FakeProbe) -> None:
    with pytest.raises(AutotuneClientError, match="AUTOTUNE_URL"):
        suggest(tiny_model(), 40, example=tiny_batch, probe_if_missing=False)


# -- input checks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"example": None}, "example="),
        ({"example": {"not": "tensors"}}, "no tensor"),
        ({"target_batch": 0}, "target_batch"),
        ({"world_size": 0}, "world_size"),
        ({"target_batch": 2, "world_size": 4}, "smaller than world_size"),
        ({"budget": "lots"}, "budget 'lots': cannot read 'lots' as a size"),
        ({"device": "meta"}, "not 'meta'"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs: dict[str, Any], match: str, fake_probe: FakeProbe) -> None:
    args: dict[str, Any] = {"target_batch": 8, "example": tiny_batch, "budget": "8MiB"}
    args.update(kwargs)
    target = args.pop("target_batch")
    with pytest.raises(AutotuneClientError, match=match):
        suggest(tiny_model(), target, **args)
    assert fake_probe.calls == []


def test_a_bad_world_size_variable_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(AutotuneClientError, match="WORLD_SIZE='two'"):
        suggest(tiny_model(), 8, example=tiny_batch)


def test_probing_on_the_cpu_needs_a_budget(fake_probe: FakeProbe) -> None:
    with pytest.warns(TunerUnavailableWarning), pytest.raises(AutotuneClientError, match="budget="):
        suggest(tiny_model(), 8, example=tiny_batch)
    assert fake_probe.calls == []


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        ("64MiB", 64 << 20),
        ("1.5GiB", 3 << 29),
        ("80GB", 80 * 10**9),
        ("512 kib", 512 << 10),
        # The units of autotune.core.units, the one parser of sizes (the client once knew no k/m/g).
        ("80G", 80 * 10**9),
        ("4k", 4000),
        ("2m", 2 * 10**6),
    ],
)
def test_parse_bytes(value: int | str, expected: int) -> None:
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", [0, -1, "0MiB", "12 parsecs", True])
def test_parse_bytes_rejects(value: Any) -> None:
    with pytest.raises(AutotuneClientError):
        parse_bytes(value)


# -- the caller's model is left exactly as it was (a real probe) ----------------------------------


class Tied(nn.Module):
    """Eval mode, a frozen layer, a buffer a training forward mutates, and tied weights: everything
    a careless probe would touch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 32, bias=False)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 32))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.head = nn.Linear(32, 32, bias=False)
        self.head.weight = self.embed.weight  # tied, as in language models
        self.body[0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1  # like BatchNorm's running statistics: state a training forward changes
        return self.head(self.body(self.embed(x)))


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "state": {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()},
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "devices": {k: str(t.device) for k, t in model.state_dict(keep_vars=True).items()},
        "training": {k: m.training for k, m in model.named_modules()},
        "grads": {k: p.grad for k, p in model.named_parameters()},
        "ids": {k: id(p) for k, p in model.named_parameters()},
    }


@pytest.fixture
def loaded_model() -> Iterator[Tied]:
    torch.manual_seed(0)
    model = Tied()
    model.eval()
    yield model


def test_suggest_leaves_the_callers_model_bit_identical(loaded_model: Tied) -> None:
    before = _snapshot(loaded_model)
    rng_before = torch.get_rng_state()

    def example(m: int) -> torch.Tensor:
        return torch.randn(m, 32)  # draws from the global generator, as a data pipeline does

    with pytest.warns(TunerUnavailableWarning, match="no tuner server configured"):
        got = suggest(loaded_model, 64, example=example, budget="2MiB")
    after = _snapshot(loaded_model)
    assert got.source == "probed" and got.profile_id is None
    assert got.micro_batch * got.accumulation_steps == got.effective_batch
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(value, after["state"][key]), key  # bit-identical, the mutated buffer included
    for field in ("requires_grad", "devices", "training", "grads", "ids"):
        assert before[field] == after[field], field
    assert not loaded_model.training
    assert torch.equal(torch.get_rng_state(), rng_before)  # the job's random stream did not move
    # The probe measured a model with the same fingerprint as the caller's.
    assert got.fingerprint == job_fingerprint(loaded_model, example=example)


def test_a_model_on_the_meta_device_is_probed_on_a_cpu_stand_in(fake_probe: FakeProbe) -> None:
    with torch.device("meta"):
        model = tiny_model()
    with pytest.warns(TunerUnavailableWarning):
        got = suggest(model, 40, example=tiny_batch, budget="8MiB")
    ((task, _),) = fake_probe.calls
    built = task.model()
    assert all(p.device.type == "cpu" for p in built.parameters())
    assert all(p.is_meta for p in model.parameters())  # the caller's model is still on meta
    assert got.fingerprint == job_fingerprint(tiny_model(), example=tiny_batch)


# -- strategy ------------------------------------------------------------------------------------


def test_an_fsdp_job_asks_the_server_for_fsdp(no_trials: None) -> None:
    answer = make_suggestion(world_size=4, effective_batch=128, accumulation_steps=2, strategy="fsdp")
    handler, seen = sequence(json_response(200, answer.model_dump(mode="json")))
    with mock_client(handler) as client:
        got = suggest(tiny_model(), 128, example=tiny_batch, world_size=4, strategy="fsdp", client=client)
    assert (seen[0].url.params["strategy"], seen[0].url.params["world_size"]) == ("fsdp", "4")
    assert got.strategy == "fsdp"


def test_a_local_probe_of_an_fsdp_job_runs_fsdp_at_its_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.factories import make_profile as shared_make_profile

    configs: list[ProbeConfig] = []

    def fsdp_probe(task: ProbeTask, config: ProbeConfig, **_: Any) -> Profile:
        configs.append(config)
        return shared_make_profile(
            fingerprint=task_fingerprint(task), strategy=config.strategy, world_size=config.world_size
        )

    monkeypatch.setattr(autotune.orchestrate.probe, "probe", fsdp_probe)
    with pytest.warns(TunerUnavailableWarning):
        got = suggest(tiny_model(), 96, example=tiny_batch, world_size=4, strategy="fsdp", budget="8MiB")
    ((config,),) = [configs]
    assert (config.strategy, config.world_size, config.target_batch) == ("fsdp", 4, 96)
    assert (got.source, got.strategy, got.world_size) == ("probed", "fsdp", 4)
    assert got.micro_batch * got.accumulation_steps * 4 == got.effective_batch == 96


def test_an_unknown_strategy_is_a_one_line_error(fake_probe: FakeProbe) -> None:
    with pytest.raises(AutotuneClientError, match="strategy must be one of ddp, fsdp"):
        suggest(tiny_model(), 8, example=tiny_batch, budget="8MiB", strategy="zero3")
    assert fake_probe.calls == []


# -- plan policy ---------------------------------------------------------------------------------


def test_a_local_probe_plans_with_the_policy_asked_for(fake_probe: FakeProbe) -> None:
    # The fake profile measured m_max 20; T = 50: balanced is 17 + 17 + 16, divisor 10 x 5.
    with pytest.warns(TunerUnavailableWarning):
        balanced = suggest(tiny_model(), 50, example=tiny_batch, budget="8MiB")
    with pytest.warns(TunerUnavailableWarning):
        divisor = suggest(tiny_model(), 50, example=tiny_batch, budget="8MiB", plan="divisor")
    assert [config.plan_policy for _, config in fake_probe.calls] == ["balanced", "divisor"]
    assert (balanced.micro_batches, balanced.accumulation_steps) == ([(17, 2), (16, 1)], 3)
    assert balanced.effective_batch == 50
    assert (divisor.micro_batches, divisor.accumulation_steps, divisor.effective_batch) == ([(10, 5)], 5, 50)


def test_a_plan_policy_reaches_the_server_and_an_unknown_one_is_an_error(
    no_trials: None, fake_probe: FakeProbe
) -> None:
    handler, seen = sequence(json_response(200, make_suggestion().model_dump(mode="json")))
    with mock_client(handler) as client:
        suggest(tiny_model(), 128, example=tiny_batch, world_size=2, plan="divisor", client=client)
    assert seen[0].url.params["plan"] == "divisor"
    with pytest.raises(AutotuneClientError, match="plan must be one of balanced, divisor"):
        suggest(tiny_model(), 8, example=tiny_batch, budget="8MiB", plan="round")


def test_a_job_that_cannot_fit_one_sample_gets_the_one_line_diagnosis() -> None:
    """The local probe's no-fit answer reaches the job as the probe's own line, not an allocator error."""
    from autotune.core.errors import CannotFitError

    with pytest.warns(TunerUnavailableWarning), pytest.raises(CannotFitError) as caught:
        suggest(tiny_model(), 8, example=tiny_batch, budget="16KiB")
    line = str(caught.value)
    assert line.startswith("micro-batch 1 does not fit: budget 16384 bytes") and "\n" not in line
    assert "weights, gradients and optimizer state alone take" in line and "a budget of" in line
