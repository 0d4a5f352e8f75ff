"""Fake-tensor trials: the pre-search that finds the boundary before any real trial, and estimates.

A fake trial is the real trial under FakeTensorMode (meters/fake.py): the same model, optimizer,
precision and strategy, counted like the CPU meter, with no storage and no compute. On the CPU its
peak equals the real one byte for byte, so the boundary it finds is the real boundary, and the real
search only confirms it (m and m + multiple_of: two trials). On CUDA it is the allocator's view
without rounding, workspaces and the context: the real trials start there and correct from it.

A fake trial costs the Python dispatch of the trial's ops whatever m (about 0.3 s for the gpt
example, 7 s for the 7B configuration), so the pre-search spends as few as it can: two traced trials
at 2 and 3 times multiple_of give the whole curve (autotune/curve.py: every op's live bytes are
affine in m), and its largest m under the limit is the answer. Where the traces do not line up, or
the small sizes do not fit, it runs the exact search on fake trials instead, reusing one fake model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autotune.curve import PeakCurve
from autotune.errors import AutotuneError
from autotune.meters.fake import FakeMeter
from autotune.schemas import Fit, Trial
from autotune.search import FAKE_FAR_EXTRAPOLATION, find_max_micro_batch, measured_fit
from autotune.strategies import Replicated, Strategy
from autotune.task import ProbeTask
from autotune.trial import TrialRunner

__all__ = ["TRACED_SIZES", "FakeSearch", "fake_search", "presearch_failed"]

# The traced sizes, in units of multiple_of: not 1, where a dimension of size one makes some ops
# views or no-ops that copy at every other size (the transformers models of bench/_hf_tasks.py
# count 1035, 1295 and 1153 allocations at m = 1 against 1075, 1299 and 1197 at every m >= 2).
TRACED_SIZES = (2, 3)


@dataclass
class FakeSearch:
    """What the fake trials found: m_max, the fake trials (marked fake) and the line they give;
    ``curve`` where m_max was read off two traced trials rather than searched for."""

    max_micro_batch: int
    trials: list[Trial]
    fit: Fit | None
    warnings: list[str] = field(default_factory=list)
    curve: PeakCurve | None = None


def fake_search(
    task: ProbeTask,
    *,
    budget_bytes: int,
    limit_bytes: int,
    device_type: str,
    strategy: Strategy,
    max_micro_batch: int,
    multiple_of: int,
    device_name: str | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    confirm: bool = False,
) -> FakeSearch:
    """m_max by fake trials (inside strategy's process group when it has one): read off the curve of
    two traced trials, or found by the exact search where the curve cannot be had.

    Args:
        confirm: also run fake trials at the curve's m_max and one step past it. An estimate has no
            real trials to confirm it, so it stands on fake trials that show m_max fits and the next
            size does not; the search goes on from them where they disagree with the curve.

    Raises:
        NoFitError: even multiple_of does not fit (the fake trial's verdict).
        TrialError / TaskError: an op cannot run fake (the message names it), or the task misbehaves.
    """
    meter = FakeMeter(budget_bytes, device_type, device_name)
    meter.keep_trace = True
    if isinstance(strategy, Replicated) and strategy.world_size > 1:
        # DDP's constructor broadcasts the weights over gloo/nccl, which cannot carry fake tensors:
        # the fake trials leave the gradient buckets out and the real trials put them back.
        strategy = Replicated(1)
    runner = TrialRunner(task, meter, limit_bytes=limit_bytes, strategy=strategy)
    done: dict[int, Trial] = {}
    traces: dict[int, list[int]] = {}

    def trial(micro_batch: int) -> Trial:
        if micro_batch not in done:  # the exact search may ask again for a traced size
            result = runner(micro_batch).model_copy(update={"fake": True})
            done[micro_batch] = result
            if meter.last_trace is not None and not result.oom:
                traces[micro_batch] = meter.last_trace
            if on_trial is not None:
                on_trial(result)
        return done[micro_batch]

    try:
        curve = _traced_curve(trial, traces, max_micro_batch=max_micro_batch, multiple_of=multiple_of)
        predicted = curve.max_fitting(limit_bytes, cap=max_micro_batch, multiple_of=multiple_of) if curve else None
        if predicted and not confirm:
            m_max = predicted
        else:
            m_max = find_max_micro_batch(
                trial,
                limit_bytes=limit_bytes,
                max_micro_batch=max_micro_batch,
                multiple_of=multiple_of,
                hint=predicted or None,
                far_extrapolation=FAKE_FAR_EXTRAPOLATION,
            ).max_micro_batch
    finally:
        runner.close()
    trials = list(done.values())
    return FakeSearch(
        max_micro_batch=m_max, trials=trials, fit=measured_fit(trials), warnings=runner.warnings, curve=curve
    )


def _traced_curve(
    trial: Callable[[int], Trial], traces: dict[int, list[int]], *, max_micro_batch: int, multiple_of: int
) -> PeakCurve | None:
    """The curve through the traced sizes, or None where one of them is above the cap, does not fit,
    or their traces do not line up."""
    low, high = (size * multiple_of for size in TRACED_SIZES)
    if high > max_micro_batch:
        return None
    for size in (low, high):
        if not trial(size).fits:
            return None
    return PeakCurve.from_traces(low, traces.get(low, []), high, traces.get(high, []))


def presearch_failed(exc: BaseException) -> str:
    """The warning a probe carries when its fake pre-search could not run."""
    text = str(exc) if isinstance(exc, AutotuneError) else f"{type(exc).__name__}: {exc}"
    first_line = (text.strip().splitlines() or [""])[0]
    return f"fake pre-search skipped ({first_line}); the search used real trials only"
