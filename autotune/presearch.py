"""Fake-tensor trials: the pre-search that finds the boundary before any real trial, and estimates.

A fake trial is the real trial under FakeTensorMode (meters/fake.py): the same model, optimizer,
precision and strategy, counted like the CPU meter, with no storage and no compute. On the CPU its
peak equals the real one byte for byte, so the boundary it finds is the real boundary, and the real
search only confirms it (m and m + multiple_of: two trials). On CUDA it is the allocator's view
without rounding, workspaces and the context: the real trials start there and correct from it.

A fake trial costs the Python dispatch of the trial's ops whatever m: FakeTensorMode's own dispatch
is about 0.19 ms an op here, 1.0-1.4 s a trial for small transformers models (bench/peers.py
--suite m50), about what a real trial of those models costs at m = 50; for a ~100M-parameter model a
fake trial takes 3-4 s against 70 s for a real one at m = 8. The pre-search runs the exact search
on fake trials, reusing one fake model, and approaches a far prediction from below only when it is
very far (a fake OOM costs nothing on the device, but it measures nothing either).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autotune.errors import AutotuneError
from autotune.meters.fake import FakeMeter
from autotune.schemas import Fit, Trial
from autotune.search import FAKE_FAR_EXTRAPOLATION, SearchResult, find_max_micro_batch
from autotune.strategies import Replicated, Strategy
from autotune.task import ProbeTask
from autotune.trial import TrialRunner

__all__ = ["FakeSearch", "fake_search", "presearch_failed"]


@dataclass
class FakeSearch:
    """What the fake trials found: m_max, the fake trials (marked fake) and the line they give."""

    max_micro_batch: int
    trials: list[Trial]
    fit: Fit | None
    warnings: list[str] = field(default_factory=list)


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
) -> FakeSearch:
    """The exact search on fake trials (inside strategy's process group when it has one).

    Raises:
        NoFitError: even multiple_of does not fit (the fake trial's verdict).
        TrialError / TaskError: an op cannot run fake (the message names it), or the task misbehaves.
    """
    meter = FakeMeter(budget_bytes, device_type, device_name)
    if isinstance(strategy, Replicated) and strategy.world_size > 1:
        # DDP's constructor broadcasts the weights over gloo/nccl, which cannot carry fake tensors:
        # the fake trials leave the gradient buckets out and the real trials put them back.
        strategy = Replicated(1)
    runner = TrialRunner(task, meter, limit_bytes=limit_bytes, strategy=strategy)

    def trial(micro_batch: int) -> Trial:
        result = runner(micro_batch).model_copy(update={"fake": True})
        if on_trial is not None:
            on_trial(result)
        return result

    try:
        result: SearchResult = find_max_micro_batch(
            trial,
            limit_bytes=limit_bytes,
            max_micro_batch=max_micro_batch,
            multiple_of=multiple_of,
            far_extrapolation=FAKE_FAR_EXTRAPOLATION,
        )
    finally:
        runner.close()
    return FakeSearch(
        max_micro_batch=result.max_micro_batch, trials=result.trials, fit=result.fit, warnings=runner.warnings
    )


def presearch_failed(exc: BaseException) -> str:
    """The warning a probe carries when its fake pre-search could not run."""
    text = str(exc) if isinstance(exc, AutotuneError) else f"{type(exc).__name__}: {exc}"
    first_line = (text.strip().splitlines() or [""])[0]
    return f"fake pre-search skipped ({first_line}); the search used real trials only"
