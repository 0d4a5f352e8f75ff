"""Fake-tensor trials: the pre-search that finds the boundary before any real trial, and estimates.

A fake trial is the real trial under FakeTensorMode (meters/fake.py): the same model, optimizer,
precision and strategy, counted like the CPU meter, with no storage and no compute. On the CPU its
peak equals the real one byte for byte, so the boundary it finds is the real boundary, and the real
search only confirms it (m and m + multiple_of: two trials). On CUDA it is the allocator's view
without rounding, workspaces and the context: the real trials start there and correct from it.

A fake trial costs the Python dispatch of the trial's ops whatever m (about 0.3 s for the gpt
example, 7 s for the 7B configuration), so the pre-search spends as few as it can: two traced trials
at 2 and 3 times multiple_of give the whole curve (autotune/core/curve.py: every op's live bytes are
affine in m), and its largest m under the limit is the answer. Where the traces do not line up, or
the small sizes do not fit, it runs the exact search on fake trials instead, reusing one fake model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from autotune.core.curve import PeakCurve
from autotune.core.errors import AutotuneError
from autotune.core.schemas import MAX_BYTES, Fit, Trial
from autotune.core.surface import PeakSurface
from autotune.measure.meters.fake import FakeMeter, moe_routing
from autotune.measure.strategies import FakeReplicas, Replicated, Strategy
from autotune.measure.trial import TrialRunner
from autotune.search.boundary import FAKE_FAR_EXTRAPOLATION, find_max_micro_batch, measured_fit
from autotune.search.lanes import SLOW_BUILD_SECONDS, SLOW_TRIAL_SECONDS, FakeLanes, LaneSetup, Point
from autotune.tasks.task import ProbeTask

__all__ = [
    "hold_lane_model",
    "TRACED_SIZES",
    "FakeSearch",
    "FakeTrials",
    "SurfaceSearch",
    "fake_search",
    "fake_strategy",
    "fake_surface",
    "presearch_failed",
    "surface_points",
]

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


def fake_strategy(strategy: Strategy) -> Strategy:
    """The strategy fake trials run under. DDP's constructor broadcasts the weights over gloo/nccl,
    which cannot carry fake tensors: the fake trials hold DDP's gradient buckets without DDP
    (:class:`~autotune.measure.strategies.FakeReplicas`)."""
    if type(strategy) is Replicated and strategy.world_size > 1:
        return FakeReplicas(strategy.world_size)
    return strategy


class FakeTrials:
    """One fake meter and one fake model for every fake trial of a run: the trials of a surface over
    lengths, each length's confirmations, the longest length's search. A fake model of a 7B
    configuration takes seconds to build and its FakeTensorMode's dispatch cache a trial to warm;
    built once, every later trial costs its ops alone. The model is the same at every length and
    the budget is the meter's: both are set per trial. Use inside the strategy's process group,
    which must outlive it (the model holds the group); ``close()`` drops the model.

    With ``lanes`` (autotune/search/lanes.py), ``prefetch`` runs trials that will be asked for on
    worker processes beside this one; ``run`` then hands out what they found.
    """

    def __init__(
        self,
        task: ProbeTask,
        *,
        device_type: str,
        strategy: Strategy,
        device_name: str | None = None,
        lanes: FakeLanes | None = None,
    ) -> None:
        self.meter = FakeMeter(MAX_BYTES, device_type, device_name)
        self.meter.keep_trace = True
        self.runner = TrialRunner(task, self.meter, limit_bytes=MAX_BYTES, strategy=fake_strategy(strategy))
        self.lanes = lanes
        self.last_seconds = 0.0  # the last trial run here: whether lanes would pay
        self.ran_elsewhere = 0  # trials the lanes ran (that this process did not)
        self._ready: dict[Point, tuple[Trial, list[int] | None]] = {}

    @property
    def warnings(self) -> list[str]:
        return self.runner.warnings

    def run(
        self, task: ProbeTask, micro_batch: int, *, budget_bytes: int, limit_bytes: int
    ) -> tuple[Trial, list[int] | None]:
        """One fake trial of task (this run's task, at a length) at micro_batch under budget_bytes:
        the trial, marked fake, and its trace (None after an OOM, whose trace stops short)."""
        point = Point(task.seq_len or 0, micro_batch, budget_bytes, limit_bytes)
        ready = self._ready.pop(point, None)
        if ready is not None:
            return ready
        return self._run_here(task, point)

    def run_here(self, task: ProbeTask, micro_batch: int, *, budget_bytes: int, limit_bytes: int) -> Trial:
        """The fake trial at micro_batch run in this process, never a lane's."""
        trial, _ = self._run_here(task, Point(task.seq_len or 0, micro_batch, budget_bytes, limit_bytes))
        return trial

    def _run_here(self, task: ProbeTask, point: Point) -> tuple[Trial, list[int] | None]:
        self.runner.task = task
        self.runner.limit_bytes = point.limit_bytes
        self.meter.budget_bytes = point.budget_bytes
        trial = self.runner(point.micro_batch).model_copy(update={"fake": True})
        self.last_seconds = trial.seconds
        return trial, (None if trial.oom else self.meter.last_trace)

    def prefetch(self, task: ProbeTask, points: Sequence[Point]) -> None:
        """Run the trials at points (of task, sequence-aware, at each point's length) ahead of being
        asked for them, shared between this process and the lanes' workers. Nothing happens without
        lanes, or where a fake trial is too quick to pay for a worker (the first point runs here
        to find out). A trial that fails here or on a worker is left to run again where it is
        asked for, and to fail there in its place."""
        todo = [point for point in dict.fromkeys(points) if point not in self._ready]
        if self.lanes is None or len(todo) < 2:
            return
        if self.last_seconds == 0.0:
            # A model that is slow to build makes slow trials (both are its ops' dispatch): the
            # workers start now, their imports and builds beside this process's first trial.
            # Otherwise the first trial, run here, says whether they would pay.
            self.runner.task = task.at_length(todo[0].seq_len)
            try:
                slow_build = self.runner.build() >= SLOW_BUILD_SECONDS
            except Exception:  # the first trial will meet it again, where it is asked for
                return
            if not slow_build:
                self._prefetch_here(task, todo.pop(0))
                if self.last_seconds < SLOW_TRIAL_SECONDS:
                    return
        running: dict[Future[Any], Point] = {}
        while todo or running:
            while todo and len(running) < self.lanes.workers and not self.lanes.broken:
                point = todo.pop()  # the workers from the end, this process from the front
                future = self.lanes.submit(point)
                if future is None:  # the pool could not start or broke: this process runs the rest
                    todo.append(point)
                    break
                running[future] = point
            if todo:
                self._prefetch_here(task, todo.pop(0))
            for point, result in self.lanes.finished(running, block=not todo):
                if result is not None:
                    self._ready[point] = (Trial.model_validate(result[0]), result[1])
                    self.ran_elsewhere += 1

    def _prefetch_here(self, task: ProbeTask, point: Point) -> None:
        try:
            self._ready[point] = self._run_here(task.at_length(point.seq_len), point)
        except Exception:  # asked for again, it fails where it is asked for
            return

    def close(self) -> None:
        self.runner.close()
        if self.lanes is not None:
            self.lanes.close()


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
    hint: int | None = None,
    known: Sequence[Trial] = (),
    fakes: FakeTrials | None = None,
    breakdowns: dict[int, Any] | None = None,
) -> FakeSearch:
    """m_max by fake trials (inside strategy's process group when it has one): read off the curve of
    two traced trials, or found by the exact search where the curve cannot be had.

    Args:
        confirm: also run fake trials at the curve's m_max and one step past it. An estimate has no
            real trials to confirm it, so it stands on fake trials that show m_max fits and the next
            size does not; the search goes on from them where they disagree with the curve.
        hint: m_max predicted already (by a surface over lengths): no traced trials, the search
            starts there (with confirm: fake trials at it and one step past it).
        known: fake trials of this very setup already run (the surface's traced trials at this
            length): a size among them is not run again.
        fakes: the run's shared fake model and meter (a run over lengths); None makes its own.
        breakdowns: a dict that each fake trial's peak, broken down, is put in by micro-batch
            (autotune/measure/breakdown.py: the estimate's datasheet); None records nothing.

    Raises:
        NoFitError: even multiple_of does not fit (the fake trial's verdict).
        TrialError / TaskError: an op cannot run fake (the message names it), or the task misbehaves.
    """
    own = fakes is None
    shared = fakes or FakeTrials(task, device_type=device_type, strategy=strategy, device_name=device_name)
    shared.runner.breakdowns = breakdowns
    done: dict[int, Trial] = {trial.micro_batch: trial for trial in known if trial.fake and not trial.oom}
    traces: dict[int, list[int]] = {}

    def trial(micro_batch: int) -> Trial:
        if micro_batch not in done:  # the exact search may ask again for a traced size
            result, trace = shared.run(task, micro_batch, budget_bytes=budget_bytes, limit_bytes=limit_bytes)
            done[micro_batch] = result
            if trace is not None:
                traces[micro_batch] = trace
            if on_trial is not None:
                on_trial(result)
        return done[micro_batch]

    try:
        curve = None if hint else _traced_curve(trial, traces, max_micro_batch=max_micro_batch, multiple_of=multiple_of)
        predicted = curve.max_fitting(limit_bytes, cap=max_micro_batch, multiple_of=multiple_of) if curve else hint
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
        if own:
            shared.close()
    trials = list(done.values())
    return FakeSearch(
        max_micro_batch=m_max, trials=trials, fit=measured_fit(trials), warnings=list(shared.warnings), curve=curve
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


@dataclass
class SurfaceSearch:
    """What the traced fake trials over (m, L) gave: the surface where it could be had and was
    confirmed on a held-out trace, else None with the reason in ``failed``; the fake trials per
    length (traced trials count as trials of their own length)."""

    surface: PeakSurface | None
    trials: dict[int, list[Trial]]
    held_out: tuple[int, int] | None = None
    failed: str | None = None
    warnings: list[str] = field(default_factory=list)
    # A length the model refused where a shorter one ran (past its position table, say).
    refused: int | None = None


def surface_points(
    lengths: Sequence[int], multiple_of: int, length_step: int = 1
) -> tuple[tuple[int, int], tuple[int, ...], tuple[int, int]]:
    """The sizes and three lengths to trace, and the held-out (m, L) to check the surface on.

    The lengths are the smallest, a middle and the largest asked for, with halves of the smallest
    added below where fewer than three were asked; the held-out point is a fourth asked-for length
    where there is one, else halfway between the two smallest traced, at a size past the traced ones.
    Every length is a multiple of ``length_step`` (sequence parallel's tp: the asked ones are already).
    """
    sizes = (TRACED_SIZES[0] * multiple_of, TRACED_SIZES[1] * multiple_of)
    asked = sorted(set(lengths))
    traced = list(asked)
    while len(traced) < 3 and traced[0] // 2 >= length_step:
        half = traced[0] // 2 // length_step * length_step
        if half in traced:
            break
        traced.insert(0, half)
    if len(traced) > 3:
        traced = [traced[0], traced[len(traced) // 2], traced[-1]]
    spare = [length for length in asked if length not in traced]
    between = (traced[0] + traced[1]) // 2 // length_step * length_step if len(traced) > 1 else traced[0]
    held_length = spare[0] if spare else between
    return sizes, tuple(traced), ((TRACED_SIZES[1] + 1) * multiple_of, held_length)


def fake_surface(
    task: ProbeTask,
    lengths: Sequence[int],
    *,
    limit_bytes: int,
    device_type: str,
    strategy: Strategy,
    multiple_of: int,
    device_name: str | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    fakes: FakeTrials | None = None,
    length_step: int = 1,
) -> SurfaceSearch:
    """The peak surface over (m, L) of a sequence-aware task from seven traced fake trials: two
    sizes at three lengths give it (autotune/core/surface.py), a seventh held out checks it trace for
    trace. The trials run without a budget (fake tensors take no memory), so that long lengths that
    do not fit still give whole traces; ``fits`` says what the limit says of them.

    A failed trial (an op that cannot run fake, a length the model refuses) or traces that do not
    line up give ``surface=None`` and the reason, and the probe falls back length by length.
    """
    sizes, traced, held_out = surface_points(lengths, multiple_of, length_step)
    own = fakes is None
    shared = fakes or FakeTrials(task, device_type=device_type, strategy=strategy, device_name=device_name)
    trials: dict[int, list[Trial]] = {}
    traces: dict[tuple[int, int], list[int]] = {}
    points = [*((m, length) for length in traced for m in sizes), held_out]
    shared.prefetch(task, [Point(length, m, MAX_BYTES, limit_bytes) for m, length in points])
    try:
        for micro_batch, seq_len in points:
            # No budget worth the name: the largest the wire contract allows (fake tensors take nothing).
            result, trace = shared.run(
                task.at_length(seq_len), micro_batch, budget_bytes=MAX_BYTES, limit_bytes=limit_bytes
            )
            trials.setdefault(seq_len, []).append(result)
            if on_trial is not None:
                on_trial(result.at_length(seq_len))
            if trace is None:
                failed = f"the fake trial at m={micro_batch}, L={seq_len} did not finish"
                return SurfaceSearch(None, trials, failed=failed)
            traces[(micro_batch, seq_len)] = trace
    except Exception as exc:  # an op that cannot run fake, a length the model refuses: per length
        reason = (
            presearch_failed(exc)
            .removeprefix("fake pre-search skipped (")
            .removesuffix("); the search used real trials only")
        )
        # Where a shorter length ran and this one did not, the model refuses the length itself.
        refused = seq_len if any(length < seq_len for length in trials) else None
        return SurfaceSearch(None, trials, failed=f"at L={seq_len}: {reason}", refused=refused)
    finally:
        if own:
            shared.close()
    held_trace = traces.pop(held_out)
    surface = PeakSurface.from_traces(traces)
    if surface is None:
        return SurfaceSearch(None, trials, failed="the traces at different sizes and lengths do not line up")
    if not surface.predicts(*held_out, held_trace):
        m, length = held_out
        return SurfaceSearch(
            None,
            trials,
            failed=f"the surface does not predict the held-out trace at m={m}, L={length} "
            f"(peak {surface.peak_bytes(m, length)} predicted, {max(held_trace)} traced)",
        )
    return SurfaceSearch(surface, trials, held_out=held_out, warnings=list(shared.warnings))


def presearch_failed(exc: BaseException) -> str:
    """The warning a probe carries when its fake pre-search could not run."""
    text = str(exc) if isinstance(exc, AutotuneError) else f"{type(exc).__name__}: {exc}"
    first_line = (text.strip().splitlines() or [""])[0]
    return f"fake pre-search skipped ({first_line}); the search used real trials only"


def hold_lane_model(setup: LaneSetup) -> tuple[ProbeTask, ExitStack, FakeTrials]:
    """In a lane's worker (autotune/search/lanes.py): the run's task loaded from its spec, and its fake
    model held inside a fake process group and a frozen heap that live as long as the returned stack."""
    from autotune.core.library_logs import quiet_if_asked
    from autotune.measure.strategy_choice import make_strategy
    from autotune.measure.trial import frozen_heap
    from autotune.tasks.load import load_task

    quiet_if_asked()  # before the task's libraries are imported here
    job = setup.job
    task = load_task(setup.spec).with_setup(job)
    strategy = fake_strategy(make_strategy(job.strategy, job.world_size, job.mesh))  # held before the model
    stack = ExitStack()
    stack.enter_context(moe_routing(setup.moe_load_factor))  # the run's routing, for the worker's life
    stack.enter_context(strategy.process_group(torch.device(setup.device_type)))
    stack.enter_context(frozen_heap())
    fakes = FakeTrials(task, device_type=setup.device_type, strategy=strategy, device_name=setup.device_name)
    return task, stack, fakes
