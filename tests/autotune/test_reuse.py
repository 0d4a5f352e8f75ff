"""One model per probe: a trial on the reused model peaks exactly where a fresh model's trial does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.measure.meters import CpuMeter
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.trial import TrialRunner, run_trial
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task
from examples.cases import task_spec
from tests.autotune._tasks import linear_task

UNBOUNDED = 1 << 40
EXAMPLES = ["mlp", "gpt", "cnn"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_reused_model_trials_equal_fresh_model_trials_byte_for_byte(name: str) -> None:
    task = load_task(task_spec(name))
    meter = CpuMeter(UNBOUNDED)
    runner = TrialRunner(task, meter, limit_bytes=UNBOUNDED)
    reused = {m: runner(m) for m in (2, 8, 24, 8)}  # 8 twice: a later trial sees no earlier one's leftovers
    runner.close()
    assert meter.live_bytes == 0
    for m, trial in reused.items():
        fresh = run_trial(task, meter, m, limit_bytes=UNBOUNDED)
        assert (trial.peak_bytes, trial.forward_backward_bytes) == (fresh.peak_bytes, fresh.forward_backward_bytes)
        assert meter.live_bytes == 0


def test_reused_fsdp_model_trials_equal_fresh_ones_at_world_size_4() -> None:
    task = load_task(task_spec("gpt"))
    strategy = make_strategy("fsdp", 4)
    meter = CpuMeter(UNBOUNDED)
    with strategy.process_group(meter.device):
        runner = TrialRunner(task, meter, limit_bytes=UNBOUNDED, strategy=strategy)
        reused = [runner(m).peak_bytes for m in (2, 16, 2)]
        runner.close()
        fresh = [run_trial(task, meter, m, limit_bytes=UNBOUNDED, strategy=strategy).peak_bytes for m in (2, 16, 2)]
    assert reused == fresh
    assert reused[1] > reused[0]


def test_after_an_oom_the_next_trial_gets_a_new_model_and_measures_as_fresh() -> None:
    task = load_task(task_spec("gpt"))
    fresh = run_trial(task, CpuMeter(UNBOUNDED), 4, limit_bytes=UNBOUNDED).peak_bytes
    meter = CpuMeter(fresh + 1)
    runner = TrialRunner(task, meter, limit_bytes=fresh + 1)
    assert runner(64).oom
    assert runner._model is None  # dropped: the wrapper may have stopped mid-step
    assert runner(4).peak_bytes == fresh
    runner.close()


def test_the_model_is_built_once_per_probe_and_only_on_meta() -> None:
    devices: list[str] = []

    def model() -> nn.Module:
        devices.append(str(torch.empty(0).device))
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))

    task = linear_task(model=model)
    for presearch in (False, True):
        devices.clear()
        profile = probe(task, ProbeConfig(device="cpu", budget_bytes=2 << 20, presearch=presearch))
        assert len(profile.trials) >= 4
        # the fingerprint, the real runner (and the fake runner) once each, however many trials
        # ran, and once more after each OOM; every time on meta, never first on the CPU (the
        # BatchNorm check builds one too, but only where m_max is small: not here)
        assert profile.max_micro_batch >= 16
        base, ooms = (3 if presearch else 2), sum(1 for t in profile.trials if t.oom)
        assert set(devices) == {"meta"}
        assert base <= len(devices) <= base + ooms < len(profile.trials)


def test_a_factory_that_cannot_run_on_meta_is_built_on_the_device_with_a_warning_naming_the_module() -> None:
    class NeedsData(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(64, 8)
            with torch.no_grad():
                if self.body.weight.abs().sum().item() < 0:  # reads a value: impossible on meta
                    raise AssertionError

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    task = linear_task(model=NeedsData)
    profile = probe(task, ProbeConfig(device="cpu", budget_bytes=1 << 20, presearch=False))
    assert profile.max_micro_batch > 1
    assert any("could not be built on the meta device (in NeedsData)" in w for w in profile.warnings)
