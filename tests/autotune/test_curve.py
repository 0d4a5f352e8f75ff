"""The peak curve from two traced trials: its arithmetic, and that it predicts the real peaks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.core.curve import PeakCurve
from autotune.measure.meters import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.strategies import Replicated, Strategy
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.trial import TrialRunner, frozen_heap
from autotune.search.boundary import find_max_micro_batch
from autotune.search.presearch import TRACED_SIZES, fake_search
from autotune.tasks.load import load_task
from autotune.tasks.task import ProbeTask
from examples.cases import task_spec
from tests.autotune._tasks import linear_task

MiB = 1 << 20
UNBOUNDED = 1 << 40


def test_the_peak_is_the_largest_line_and_the_boundary_follows() -> None:
    # Point 0: flat 500 (the weights); point 1: 100 + 50/sample; point 2: 40 + 80/sample.
    curve = PeakCurve.from_traces(2, [500, 200, 200], 4, [500, 300, 360])
    assert curve is not None
    assert [curve.peak_bytes(m) for m in (2, 4, 6, 10)] == [500, 500, 520, 840]
    # 40 + 80 m <= 1000 up to m = 12; the flat point never decides it.
    assert curve.max_fitting(1000, cap=4096) == 12
    assert curve.max_fitting(1000, cap=4096, multiple_of=5) == 10
    assert curve.max_fitting(1000, cap=7) == 7
    assert curve.max_fitting(520, cap=4096) == 6  # 40 + 80 x 6 = 520: at the limit still fits
    assert curve.max_fitting(499, cap=4096) == 0  # even the traced size is over the limit


def test_a_curve_with_no_growing_point_fits_up_to_the_cap() -> None:
    curve = PeakCurve.from_traces(2, [500, 100], 3, [500, 90])
    assert curve is not None and curve.max_fitting(600, cap=300) == 300


@pytest.mark.parametrize(
    ("low", "trace_low", "high", "trace_high"),
    [(2, [1, 2, 3], 3, [1, 2]), (3, [1, 2], 2, [1, 3]), (2, [], 3, []), (0, [1], 1, [2])],
)
def test_traces_that_do_not_line_up_give_no_curve(low: int, trace_low: list, high: int, trace_high: list) -> None:
    assert PeakCurve.from_traces(low, trace_low, high, trace_high) is None


def _traces(task: ProbeTask, meter: CpuMeter, sizes: tuple[int, ...], strategy: Strategy | None = None) -> dict:
    meter.keep_trace = True
    runner = TrialRunner(task, meter, limit_bytes=UNBOUNDED, strategy=strategy)
    found = {}
    try:
        for m in sizes:
            trial = runner(m)
            found[m] = (trial.peak_bytes, meter.last_trace)
    finally:
        runner.close()
    return found


def _real_peaks(task: ProbeTask, sizes: tuple[int, ...], strategy: Strategy | None = None) -> list[int]:
    runner = TrialRunner(task, CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, strategy=strategy)
    try:
        return [runner(m).peak_bytes for m in sizes]
    finally:
        runner.close()


@pytest.mark.parametrize(("name", "strategy"), [("mlp", "ddp"), ("gpt", "ddp"), ("cnn", "ddp"), ("gpt", "fsdp")])
def test_two_fake_traces_predict_the_real_peak_at_other_sizes_byte_for_byte(name: str, strategy: str) -> None:
    task = load_task(task_spec(name))
    chosen = make_strategy(strategy, 4 if strategy == "fsdp" else 1)
    low, high = TRACED_SIZES
    elsewhere = (7, 40)
    with chosen.process_group(torch.device("cpu")), frozen_heap():
        traced = _traces(task, FakeMeter(UNBOUNDED), (low, high), chosen)
        real = _real_peaks(task, elsewhere, chosen)
    (peak_low, trace_low), (peak_high, trace_high) = traced[low], traced[high]
    # The trace's maximum is the trial's peak.
    assert trace_low is not None and max(trace_low) == peak_low
    assert trace_high is not None and max(trace_high) == peak_high
    curve = PeakCurve.from_traces(low, trace_low, high, trace_high)
    assert curve is not None
    assert [curve.peak_bytes(m) for m in elsewhere] == real


def test_fsdp_first_trial_traces_line_up_with_later_ones() -> None:
    # FSDP2's first forward makes storages that later trials only resize: the trace leaves out the
    # counts that add no bytes, so a probe's first two trials can be lined up.
    task = load_task(task_spec("gpt"))
    strategy = make_strategy("fsdp", 4)
    with strategy.process_group(torch.device("cpu")), frozen_heap():
        traced = _traces(task, FakeMeter(UNBOUNDED), (2, 3, 2), strategy)
    assert traced[2][1] is not None and traced[3][1] is not None
    assert len(traced[2][1]) == len(traced[3][1])


def _search(task: ProbeTask, budget_bytes: int, *, confirm: bool = False):
    with frozen_heap():
        return fake_search(
            task,
            budget_bytes=budget_bytes,
            limit_bytes=int(budget_bytes * 0.9),
            device_type="cpu",
            strategy=Replicated(1),
            max_micro_batch=4096,
            multiple_of=1,
            confirm=confirm,
        )


def _exact_fake(task: ProbeTask, budget_bytes: int) -> int:
    """The exact search on fake trials, without the curve."""
    runner = TrialRunner(task, FakeMeter(budget_bytes), limit_bytes=int(budget_bytes * 0.9))
    with frozen_heap():
        try:
            return find_max_micro_batch(runner, limit_bytes=int(budget_bytes * 0.9)).max_micro_batch
        finally:
            runner.close()


@pytest.mark.parametrize(("name", "budget_mib"), [("mlp", 2), ("gpt", 12), ("cnn", 8)])
def test_the_pre_search_reads_the_boundary_off_two_fake_trials(name: str, budget_mib: float) -> None:
    task = load_task(task_spec(name))
    found = _search(task, int(budget_mib * MiB))
    assert found.curve is not None
    assert [t.micro_batch for t in found.trials] == list(TRACED_SIZES)
    assert all(t.fake for t in found.trials)
    assert found.max_micro_batch == _exact_fake(task, int(budget_mib * MiB))


def test_an_estimate_confirms_the_curve_with_fake_trials_at_m_and_one_past_it() -> None:
    task = load_task(task_spec("gpt"))
    found = _search(task, 12 * MiB, confirm=True)
    m = found.max_micro_batch
    assert [t.micro_batch for t in found.trials] == [*TRACED_SIZES, m, m + 1]
    assert [t.fits for t in found.trials] == [True, True, True, False]


class _OddBatchCopies(nn.Module):
    """Runs an extra op at odd micro-batches: its traces at 2 and 3 do not line up."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % 2:
            x = x * 1.0
        return self.layer(x)


def test_traces_that_differ_fall_back_to_the_exact_search_on_fake_trials() -> None:
    task = linear_task(
        name="odd-copies",
        model=_OddBatchCopies,
        batch=lambda m: (torch.randn(m, 256), torch.randn(m, 256)),
    )
    budget = 4 * MiB
    found = _search(task, budget)
    assert found.curve is None
    assert len(found.trials) > len(TRACED_SIZES)
    assert found.max_micro_batch == _exact_fake(task, budget)


def test_where_the_traced_sizes_do_not_fit_the_search_goes_below_them() -> None:
    # Tiny weights, large activations: the peak grows with m from m = 1.
    task = linear_task(
        name="wide-activations",
        model=lambda: nn.Linear(8, 8),
        batch=lambda m: (torch.randn(m, 4096, 8), torch.randn(m, 4096, 8)),
    )
    traced = _traces(task, FakeMeter(UNBOUNDED), (1, 2))
    one, two = traced[1][0], traced[2][0]
    assert one < two
    budget = int((one + two) / 2 / 0.9)  # the limit (90 %) holds m = 1 and not m = 2
    found = _search(task, budget)
    assert found.curve is None
    assert found.max_micro_batch == 1 == _exact_fake(task, budget)
