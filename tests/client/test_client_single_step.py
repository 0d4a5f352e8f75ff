"""suggest() on a profile with a single-step figure (Profile.single_step; issue 33, item 8): the local probe's
answer and the server's for the same stored profile and target are one plan (autotune.core.plan.plan_profile),
so a job that probed and then asks again gets the answer it got the first time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import autotune.orchestrate.probe
from autotune.cli.client_commands import format_suggestion
from autotune.core.plan import plan_profile
from autotune.core.schemas import Profile, SingleStep, Trial
from autotune.orchestrate.probe import ProbeConfig
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.task import ProbeTask
from autotune_client import suggest
from autotune_client._local_probe import suggestion_from_profile
from tests.client._factories import make_profile
from tests.client.conftest import WRITE_TOKEN

MIB = 1 << 20
# make_profile: 1 MiB + 1 MiB x m against a limit of 57.6 MiB, m_max 20 set by hand (21 measured over the
# limit). Without accumulation 30 fits and 31 does not, searched up to 40.
ACCUMULATING, SINGLE, CAP = 20, 30, 40


def single_step_profile(fingerprint: str | None = None) -> Profile:
    profile = (
        make_profile(max_micro_batch=ACCUMULATING)
        if fingerprint is None
        else make_profile(fingerprint=fingerprint, max_micro_batch=ACCUMULATING)
    )
    limit = profile.limit_bytes
    trials = [
        Trial(micro_batch=m, peak_bytes=MIB * (m + 1) if m <= SINGLE else limit + 1, fits=m <= SINGLE, seconds=0.1)
        for m in (ACCUMULATING, SINGLE, SINGLE + 1)
    ]
    profile.single_step = SingleStep(max_micro_batch=SINGLE, cap=CAP, trials=trials)
    profile.plan = plan_profile(profile, CAP)  # what a probe with target 40 stores: one step does not hold it
    return profile


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))


def tiny_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(m, 64), torch.randn(m, 8)


@pytest.fixture(autouse=True)
def _no_ambient_server(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AUTOTUNE_URL", "AUTOTUNE_TOKEN", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _plan_of(answer: Any) -> tuple[Any, ...]:
    return (answer.micro_batches, answer.accumulation_steps, answer.effective_batch, answer.single_step)


def test_the_local_answer_equals_the_servers_for_every_target(in_process_server: Callable[..., Any]) -> None:
    tuner = in_process_server(token=WRITE_TOKEN)
    profile = single_step_profile()
    profile_id = tuner.upload(profile)
    for world in (1, 2):
        for target in range(2 * world, 42 * world, 3 * world):
            local = suggestion_from_profile(profile, target, world, profile_id, [])
            served = tuner.suggest(
                fingerprint=profile.fingerprint, target_batch=target, world_size=world, device_name="cpu"
            )
            assert _plan_of(local) == _plan_of(served), (target, world)
            if served.single_step:  # autotune suggest's line says which case applied
                assert "one step per update (A = 1)" in format_suggestion(served).splitlines()[0]
            one_step = ACCUMULATING < target // world <= SINGLE and target % world == 0
            assert served.single_step is one_step and (served.accumulation_steps == 1) is (target // world <= SINGLE)


def test_a_job_that_probed_gets_the_same_one_step_plan_from_the_server(
    in_process_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    probed: list[ProbeConfig] = []

    def fake_probe(task: ProbeTask, config: ProbeConfig, **_: Any) -> Profile:
        probed.append(config)
        return single_step_profile(task_fingerprint(task))

    monkeypatch.setattr(autotune.orchestrate.probe, "probe", fake_probe)
    tuner = in_process_server(token=WRITE_TOKEN)
    first = suggest(tiny_model(), SINGLE, example=tiny_batch, budget="64MiB", client=tuner)
    again = suggest(tiny_model(), SINGLE, example=tiny_batch, budget="64MiB", client=tuner)
    assert len(probed) == 1 and (first.source, again.source) == ("probed", "measured")
    assert _plan_of(first) == _plan_of(again) == ([(SINGLE, 1)], 1, SINGLE, True)
    beyond = suggest(tiny_model(), SINGLE + 1, example=tiny_batch, budget="64MiB", client=tuner)
    assert len(probed) == 1 and beyond.single_step is False and beyond.accumulation_steps == 2
