"""The fake meter: fake-tensor trials counted like the CPU meter, equal to it byte for byte."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.measure.meters import CpuMeter, CpuOutOfMemoryError
from autotune.measure.meters.fake import FakeMeter, FakeTrialError
from autotune.measure.strategies import Replicated
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.trial import TrialRunner, _cycle
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task
from autotune.tasks.task import ProbeTask
from examples.cases import CPU_BUDGET_CASES, HEADROOM, task_spec
from tests.autotune._tasks import linear_task

MiB = 1 << 20
UNBOUNDED = 1 << 40


def peaks(task: ProbeTask, meter: CpuMeter, sizes: tuple[int, ...], strategy=None) -> list[tuple[int, int | None]]:
    runner = TrialRunner(task, meter, limit_bytes=UNBOUNDED, strategy=strategy)
    try:
        return [(t.peak_bytes, t.forward_backward_bytes) for t in map(runner, sizes)]
    finally:
        runner.close()


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_fake_peaks_equal_the_cpu_meter_byte_for_byte(name: str) -> None:
    task = load_task(task_spec(name))
    sizes = (2, 16, 48)
    assert peaks(task, FakeMeter(UNBOUNDED), sizes) == peaks(task, CpuMeter(UNBOUNDED), sizes)


def test_fake_peaks_equal_the_cpu_meter_under_fsdp_at_world_size_4() -> None:
    task = load_task(task_spec("gpt"))
    strategy = make_strategy("fsdp", 4)
    with strategy.process_group(torch.device("cpu")):
        fake = peaks(task, FakeMeter(UNBOUNDED), (2, 16), strategy)
        real = peaks(task, CpuMeter(UNBOUNDED), (2, 16), strategy)
    assert fake == real


def _oom_message(meter: CpuMeter, micro_batch: int) -> str:
    task = load_task(task_spec("gpt"))
    runner = TrialRunner(task, meter, limit_bytes=UNBOUNDED)
    model = runner._ensure_model()
    assert model is not None
    with pytest.raises(CpuOutOfMemoryError) as caught:
        with meter.measure():
            _cycle(task, meter, micro_batch, Replicated(1), model)
    message = str(caught.value)
    del caught, model
    runner.close()
    return message


def test_the_fake_oom_is_raised_at_the_same_op_with_the_same_bytes() -> None:
    budget = 12 * MiB
    fake, real = _oom_message(FakeMeter(budget), 24), _oom_message(CpuMeter(budget), 24)
    assert "aten." in real and "over the budget of" in real
    assert fake == real


def test_scalar_reads_answer_a_placeholder_and_memory_is_unchanged() -> None:
    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = model(x)
        count = int((y > 0).sum())  # .item() on a fake tensor
        return ((out - y) ** 2).sum() / max(count, 1)

    task = linear_task(loss=loss, optimizer=lambda p: torch.optim.Adam(p, foreach=False))  # step counters .item()
    sizes = (4, 32)
    assert peaks(task, FakeMeter(UNBOUNDED), sizes) == peaks(task, CpuMeter(UNBOUNDED), sizes)


def _data_dependent_task() -> ProbeTask:
    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = model(x)
        return out[y > 0].sum()  # boolean indexing: the output's shape depends on the data

    return linear_task(loss=loss)


def test_an_op_that_needs_data_fails_fake_naming_the_op() -> None:
    runner = TrialRunner(_data_dependent_task(), FakeMeter(UNBOUNDED), limit_bytes=UNBOUNDED)
    with pytest.raises(Exception, match="nonzero|index") as caught:
        runner(4)
    assert "cannot run on fake tensors" in str(caught.value)
    assert FakeTrialError.__name__ in str(caught.value)


def test_the_probe_falls_back_to_real_trials_when_the_presearch_cannot_run() -> None:
    profile = probe(_data_dependent_task(), ProbeConfig(device="cpu", budget_bytes=MiB))
    assert not any(t.fake for t in profile.trials)
    assert any(w.startswith("fake pre-search skipped") and "cannot run on fake tensors" in w for w in profile.warnings)
    assert profile.max_micro_batch > 1


@pytest.mark.parametrize(("name", "budget_mib"), CPU_BUDGET_CASES)
def test_the_presearch_leaves_two_real_trials_with_the_same_answer(name: str, budget_mib: float) -> None:
    task = load_task(task_spec(name))
    config = ProbeConfig(device="cpu", budget_bytes=int(budget_mib * MiB), headroom=HEADROOM)
    with_presearch = probe(task, config)
    without = probe(task, ProbeConfig(**{**config.__dict__, "presearch": False}))
    real = [t for t in with_presearch.trials if not t.fake]
    fake = [t for t in with_presearch.trials if t.fake]
    assert with_presearch.max_micro_batch == without.max_micro_batch
    assert [t.micro_batch for t in real] == [with_presearch.max_micro_batch, with_presearch.max_micro_batch + 1]
    assert real[0].fits and not real[1].fits
    assert fake and with_presearch.trial_count == 2
    assert not any(t.fake for t in without.trials)
