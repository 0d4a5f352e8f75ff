"""One run over several sequence lengths: the surface, each length confirmed, the longest length.

A sequence-aware task (``batch(m, seq_len=L)``) probed at ``--seq-len 512,1024,2048,4096``:

1. seven traced fake trials give the peak surface over (m, L) and check it on a held-out trace
   (``presearch.fake_surface``; autotune/core/surface.py);
2. at each length, m_max is read off the surface and confirmed as a single-length run confirms the
   curve: real trials at m_max and one step past it for a probe, fake ones for an estimate (the
   ``measure`` callable: ``probe_with_meter`` or ``estimate`` at that length);
3. the longest length that fits at m = multiple_of (up to ``max_seq_len``, by default 4x the longest
   asked for) is read off the surface and confirmed the same way, by trials at it and one past it.

Where the surface cannot be had (traces that do not line up, an op that cannot run fake, a held-out
trace it does not predict) each length is pre-searched on its own, as a single-length probe would,
and the longest length is not searched; the profiles say so.

    profiles = probe_lengths(load_task("examples/gpt.py:task_seq"),
                             ProbeConfig(device="cpu", budget_bytes=64 << 20), [128, 256, 512])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from autotune.core import units
from autotune.core.errors import AutotuneError, BudgetError, TaskError, TrialError
from autotune.core.plan import TargetError, target_in_sequences
from autotune.core.schemas import MAX_SEQ_LEN, Fit, LongestSeqLen, Profile, Surface, Trial
from autotune.core.surface import PeakSurface
from autotune.measure.meters import Meter, make_meter, resolve_device
from autotune.measure.strategies import Strategy
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.trial import TrialRunner, frozen_heap
from autotune.orchestrate.config import EstimateConfig, ProbeConfig
from autotune.search.boundary import NoFitError, at_length
from autotune.search.lanes import FakeLanes, Point, spare_cores
from autotune.search.presearch import (
    FakeSearch,
    FakeTrials,
    SurfaceSearch,
    fake_strategy,
    fake_surface,
    hold_lane_model,
)
from autotune.tasks.optimizers import compiled_step
from autotune.tasks.task import ProbeTask
from autotune.tasks.tp_plan import sequence_multiple

__all__ = [
    "LONGEST_FACTOR",
    "LengthsRun",
    "check_lengths",
    "estimate_lengths",
    "probe_lengths",
    "target_at_length",
]

# The longest length searched at m = multiple_of, by default: this many times the longest asked for.
LONGEST_FACTOR = 4
# Trials guided by the surface in the search for the longest length, before it bisects.
MAX_LONGEST_PREDICTIONS = 4

# measure(task at L, what the surface says at L, the target batch at L) -> the profile at L.
Measure = Callable[[ProbeTask, FakeSearch | None, int | None], Profile]


@dataclass
class LengthsRun:
    """What one run over lengths found: a profile per length that fits, and the lengths where not
    even multiple_of fits (with the one-line reason)."""

    profiles: list[Profile]
    no_fit: dict[int, str] = field(default_factory=dict)
    surface: Surface | None = None


def check_lengths(task: ProbeTask, lengths: Sequence[int]) -> list[int]:
    """The lengths asked for, sorted and distinct, or a TaskError naming what is wrong."""
    if not task.sequence_aware:
        shown = ",".join(str(length) for length in lengths)
        raise TaskError(
            f"--seq-len {shown}: task {task.name!r} is not sequence-aware (its batch has no seq_len keyword; "
            "write batch(m, seq_len=L))"
        )
    if not lengths:
        raise TaskError(f"task {task.name!r} is sequence-aware: give the lengths to probe with --seq-len L1,L2,...")
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= MAX_SEQ_LEN:
            raise TaskError(f"sequence length {length!r} must be an integer from 1 to {MAX_SEQ_LEN}")
    limit = task.max_seq_len
    if limit is not None and max(lengths) > limit:
        # Before any trial: a compiled warm-up at such a length dies in the model's own check, minutes in.
        raise TaskError(
            f"--seq-len {max(lengths)} is longer than the model takes: task {task.name!r} has a maximum length of "
            f"{limit} (its config's max_position_embeddings)"
        )
    return sorted(set(lengths))


def target_at_length(
    seq_len: int, *, target_batch: int | None, target_tokens: int | None, world_size: int
) -> tuple[int | None, str | None]:
    """The target batch in sequences at seq_len (``autotune.core.plan.target_in_sequences``; no target is
    none), and what to say when the tokens do not divide evenly."""
    try:
        return target_in_sequences(target_batch, target_tokens, seq_len, world_size, required=False)
    except TargetError as exc:
        raise AutotuneError(str(exc)) from None


def _presearched(found: SurfaceSearch, seq_len: int, limit_bytes: int, cap: int, multiple_of: int) -> FakeSearch:
    """What the surface says at seq_len, in the form a single-length pre-search gives it: m_max (the
    smallest size where nothing fits, so that the real trials say so with their own figures), the
    fake trials traced at this length, and the line of the peak near m_max."""
    assert found.surface is not None
    surface = found.surface
    trials = found.trials.get(seq_len, [])
    predicted = surface.max_fitting(limit_bytes, seq_len, cap=cap, multiple_of=multiple_of)
    if predicted == 0:
        return FakeSearch(max_micro_batch=multiple_of, trials=trials, fit=None)
    low = predicted
    high = predicted + multiple_of
    slope = max(0.0, (surface.peak_bytes(high, seq_len) - surface.peak_bytes(low, seq_len)) / (high - low))
    fit = Fit(fixed_bytes=surface.peak_bytes(low, seq_len) - slope * low, bytes_per_sample=slope)
    return FakeSearch(max_micro_batch=predicted, trials=trials, fit=fit)


def _confirmations(
    found: SurfaceSearch,
    lengths: Sequence[int],
    *,
    config: ProbeConfig,
    limit_bytes: int,
    cap: int,
    unit: int = 1,
) -> list[Point]:
    """The fake trials an estimate will ask for once the surface has spoken, where every one of them
    agrees with it: each length's m_max and one step past it (or multiple_of where nothing fits),
    less those the surface traced, and the longest length's guess and one past it (lengths in multiples of
    ``unit``: sequence_multiple)."""
    assert found.surface is not None
    step, budget = config.multiple_of, config.budget_bytes
    assert budget is not None  # an estimate's setup: validate() refused None
    points: list[Point] = []
    for seq_len in lengths:
        known = {t.micro_batch for t in found.trials.get(seq_len, []) if t.fake and not t.oom}
        said = _presearched(found, seq_len, limit_bytes, config.max_micro_batch, step)
        sizes = [said.max_micro_batch, said.max_micro_batch + step] if said.fit is not None else [step]
        points += [
            Point(seq_len, m, budget, limit_bytes) for m in sizes if m not in known and m <= config.max_micro_batch
        ]
    guess = found.surface.longest_fitting(limit_bytes, step, cap=cap, shortest=lengths[0])
    if guess:
        guess = max(guess // unit * unit, lengths[0])
        points += [Point(length, step, budget, limit_bytes) for length in (guess, guess + unit) if length <= cap]
    return points


def _longest(
    surface: PeakSurface,
    trial_at: Callable[[int], Trial],
    *,
    limit_bytes: int,
    micro_batch: int,
    shortest: int,
    cap: int,
    model_limit: int | None = None,
    step: int = 1,
) -> LongestSeqLen | None:
    """The longest length that fits at micro_batch: the surface's answer, confirmed by trials at it
    and one past it, and searched by bisection between what the trials show where they disagree.
    None where the shortest length does not fit at micro_batch even by the surface. A cap that is the model's
    own maximum length (``model_limit``) reached is ``limited_by="model"``. Every length tried is a multiple of
    ``step`` (sequence parallel shards the sequence over the tp ranks: tasks/tp_plan.py, sequence_multiple)."""
    # lo: the longest known to fit; hi: the shortest known not to (or refused, or past the cap)
    lo, hi = 0, (cap // step + 1) * step
    peaks: dict[int, int] = {}
    refused: dict[int, str] = {}
    over_host: dict[int, int] = {}  # lengths within the device's limit whose host bytes are over --host-budget

    def run(seq_len: int) -> bool:
        try:
            trial = trial_at(seq_len)
        except TrialError as exc:
            # The trial's advice for m = 1 (BatchNorm) is not about lengths.
            refused[seq_len] = str(exc).split(" (a model that cannot train on one sample")[0]
            return False
        if not trial.oom:  # an OOM's peak is where the budget stopped it, not the length's peak
            peaks[seq_len] = trial.peak_bytes
            if not trial.fits and trial.peak_bytes <= limit_bytes and trial.host_peak_bytes is not None:
                over_host[seq_len] = trial.host_peak_bytes
        return trial.fits

    # Predictions from the surface, shifted by what the last trial showed above or below it (at
    # m = 1 a trace differs a little from those at 2 and 3); a confirmed prediction's next one is
    # clamped one past it, which is its verification.
    offset = 0
    for _ in range(MAX_LONGEST_PREDICTIONS):
        guess = surface.longest_fitting(limit_bytes - offset, micro_batch, cap=cap, shortest=shortest)
        if guess == 0 or hi - lo <= step:
            break
        guess = min(max(guess // step * step, lo + step, shortest), hi - step)
        if run(guess):
            lo = guess
        else:
            hi = guess
        if guess in refused:  # the model's own limit, which the surface cannot see: bisect
            break
        if guess in peaks:
            offset = peaks[guess] - surface.peak_bytes(micro_batch, guess)
    if not lo and shortest < hi:
        if not run(shortest):
            return None
        lo = shortest
    while lo and hi - lo > step:  # the predictions missed: bisection on the trials themselves
        mid = (lo + hi) // 2 // step * step
        if run(mid):
            lo = mid
        else:
            hi = mid
    if not lo:
        return None
    limited_by: Literal["memory", "cap", "model"]
    if lo + step > cap and model_limit is not None and cap >= model_limit:
        limited_by, note = "model", f"the model's maximum length {model_limit} reached (max_position_embeddings)"
    elif lo + step > cap:
        limited_by, note = "cap", f"--max-seq-len {cap} reached: longer may fit"
    elif hi in refused:
        limited_by, note = "model", refused[hi]
    elif hi in over_host:
        limited_by, note = "memory", f"L {hi} keeps {over_host[hi]} bytes on the host, over --host-budget"
    else:
        limited_by, note = "memory", ""
    return LongestSeqLen(
        micro_batch=micro_batch, seq_len=lo, peak_bytes=peaks[lo], limited_by=limited_by, cap=cap, note=note[:1024]
    )


def _surface_record(
    found: SurfaceSearch,
    profiles: list[Profile],
    longest: LongestSeqLen | None,
    *,
    cap: int,
) -> Surface:
    """The surface as profiles carry it: the pieces that can lead anywhere in the covered lengths,
    and what the device's real trials showed above it (allocator rounding, workspaces on CUDA)."""
    assert found.surface is not None
    measured = sorted(p.seq_len for p in profiles if p.seq_len is not None)
    low = min([*measured, *found.surface.lengths])
    high = max([*measured, longest.seq_len if longest else 0])
    # Every covered length where there are few; else about 512 of them, with the measured ones.
    step = (high - low) // 512 + 1
    span = sorted({*measured, *range(low, high + 1, step), high})
    pruned = found.surface.pruned(cap, span)
    offset = 0
    for profile in profiles:
        for trial in profile.deciding_trials:
            if not trial.oom and profile.seq_len is not None and not trial.fake:
                offset = max(offset, trial.peak_bytes - found.surface.peak_bytes(trial.micro_batch, profile.seq_len))
    return Surface(
        denominator=pruned.denominator,
        pieces=[list(p) for p in pruned.pieces],
        sizes=pruned.sizes,
        lengths=pruned.lengths,
        covered=(low, high),
        measured_lengths=measured or [low],
        offset_bytes=offset,
        held_out=found.held_out,
        longest=longest,
    )


@dataclass
class _Lengths:
    """One run over lengths, in named steps: what a probe and an estimate share. ``measure`` runs one
    length as a single-length run would (from what the surface says there); ``trial_runner`` makes a
    runner for the trials at m = multiple_of that confirm a no-fit and find the longest length."""

    task: ProbeTask
    measure: Measure
    # One trial of the task at a length at m = multiple_of (the no-fit confirmations, the longest
    # length's search), and what drops its model after a batch of them (a real probe's model dies
    # between steps; an estimate's fake model serves the whole run).
    trial_at: Callable[[ProbeTask], Trial]
    release: Callable[[], None]
    # The process group the trials run in: entered per step by a probe, held by an estimate's caller.
    group: Callable[[], AbstractContextManager[Any]]
    strategy: Strategy
    device: torch.device
    limit_bytes: int
    fake_limit: int
    config: ProbeConfig  # the setup (an estimate's config.probe)
    on_trial: Callable[[Trial], None] | None
    fakes: FakeTrials | None = None

    @property
    def length_step(self) -> int:
        """What every length of the run is a multiple of: tp under sequence parallel, else 1."""
        return sequence_multiple(self.task, self.config.mesh.tp)

    def surface(self, lengths: Sequence[int], device_name: str | None) -> SurfaceSearch:
        with self.group(), frozen_heap():
            found = fake_surface(
                self.task,
                lengths,
                limit_bytes=self.fake_limit,
                device_type=str(self.device),
                strategy=self.strategy,
                multiple_of=self.config.multiple_of,
                device_name=device_name,
                on_trial=self.on_trial,
                fakes=self.fakes,
                length_step=self.length_step,
            )
        if found.refused in lengths:
            raise TaskError(f"--seq-len {found.refused}: the model cannot take this length ({found.failed})")
        return found

    def _at_multiple_of(self, seq_len: int) -> Trial:
        """One trial at (multiple_of, seq_len)."""
        with self.group(), frozen_heap():
            try:
                trial = self.trial_at(self.task.at_length(seq_len))
            finally:
                self.release()
        if self.on_trial is not None:
            self.on_trial(trial.at_length(seq_len))
        return trial

    def no_fit_confirmed(self, seq_len: int) -> str | None:
        """Where the surface says not even multiple_of fits: one trial there confirms it (the reason),
        without the search and the diagnosis a single-length run spends on it; None where it fits."""
        smallest = self._at_multiple_of(seq_len)
        if smallest.fits:
            return None
        return (
            f"micro-batch {self.config.multiple_of} peaks at {smallest.peak_bytes} bytes"
            + (" or more (out of memory)" if smallest.oom else "")
            + f", over the limit of {self.limit_bytes} bytes"
        )

    def measure_each(
        self, lengths: Sequence[int], found: SurfaceSearch | None, target_tokens: int | None, notes: list[str]
    ) -> LengthsRun:
        """A profile per length that fits; the others' reasons in ``no_fit``. Raises the shortest
        length's own no-fit error where none fits."""
        config = self.config
        run = LengthsRun(profiles=[])
        errors: dict[int, BudgetError] = {}
        for seq_len in lengths:
            target, token_note = target_at_length(
                seq_len, target_batch=config.target_batch, target_tokens=target_tokens, world_size=config.data_parallel
            )
            presearched = (
                _presearched(found, seq_len, self.fake_limit, config.max_micro_batch, config.multiple_of)
                if found is not None and found.surface is not None
                else None
            )
            if presearched is not None and presearched.fit is None:
                reason = self.no_fit_confirmed(seq_len)
                if reason is not None:
                    run.no_fit[seq_len] = reason
                    continue
            try:
                profile = self.measure(self.task.at_length(seq_len), presearched, target)
            except BudgetError as exc:
                run.no_fit[seq_len] = str(exc)
                errors[seq_len] = exc
                continue
            except NoFitError as exc:  # on the shared fake model: the diagnosis comes after the run
                run.no_fit[seq_len] = str(exc)
                continue
            except AutotuneError as exc:  # the model refused this length (or failed at it): say which
                raise TaskError(f"--seq-len {seq_len}: {exc}") from None
            if token_note:
                profile.warnings.append(token_note)
            profile.warnings.extend(note for note in notes if note not in profile.warnings)
            run.profiles.append(profile)
        if not run.profiles:
            # Nothing fits at any length: the shortest one's own run says what the job needs, where
            # its error does not already (the caller runs it outside any process group held here).
            shortest = lengths[0]
            raise _NothingFits(shortest, errors.get(shortest))
        return run

    def longest(
        self, surface: PeakSurface, shortest: int, cap: int, *, model_limit: int | None = None
    ) -> LongestSeqLen | None:
        """The longest length at m = multiple_of, on one model that serves every length (``model_limit``: the
        model's own maximum length, at which ``cap`` stands when it is the smaller)."""

        def trial_at(seq_len: int) -> Trial:
            trial = self.trial_at(self.task.at_length(seq_len))
            if self.on_trial is not None:
                self.on_trial(trial.at_length(seq_len))
            return trial

        with self.group(), frozen_heap():
            try:
                return _longest(
                    surface,
                    trial_at,
                    limit_bytes=self.fake_limit,
                    micro_batch=self.config.multiple_of,
                    shortest=shortest,
                    cap=cap,
                    model_limit=model_limit,
                    step=self.length_step,
                )
            finally:
                self.release()


class _NothingFits(Exception):
    """Not even multiple_of fits at any length: the shortest length and its error, where its run
    gave one that says what the job needs (a run on a shared fake model leaves it undiagnosed)."""

    def __init__(self, seq_len: int, error: BudgetError | None) -> None:
        super().__init__(seq_len)
        self.seq_len = seq_len
        self.error = error


def _nothing_fits(nothing: _NothingFits, measure_alone: Callable[[int], object]) -> BudgetError:
    """The error of a run where nothing fits: the shortest length's diagnosis, run on its own where
    the run did not diagnose it."""
    error: BudgetError | None = nothing.error
    if error is None:
        try:
            measure_alone(nothing.seq_len)
        except BudgetError as exc:
            error = exc
    if error is None:  # fits when run on its own: the run over lengths said otherwise
        error = BudgetError(f"micro-batch does not fit at seq_len {nothing.seq_len} in the run over lengths")
    return type(error)(f"at seq_len {nothing.seq_len}: {error}")


def _over_lengths(
    steps: _Lengths,
    lengths: Sequence[int],
    *,
    max_seq_len: int | None,
    target_tokens: int | None,
    presearch: bool,
    device_name: str | None,
) -> LengthsRun:
    """The run: the surface, each length, the longest length, and what the profiles carry of it."""
    started = time.perf_counter()
    lengths = check_lengths(steps.task, lengths)
    cap = max_seq_len or LONGEST_FACTOR * lengths[-1]
    if cap < lengths[-1]:
        raise AutotuneError(f"--max-seq-len {cap} is shorter than the longest --seq-len {lengths[-1]}")
    model_limit = steps.task.max_seq_len
    if model_limit is not None and cap > model_limit:
        cap = model_limit  # the longest-length search stops at the model's own maximum, and says so
    found = steps.surface(lengths, device_name) if presearch else None
    notes: list[str] = []
    if found is None:
        notes.append("no pre-search: each length searched on its own, the longest length not searched")
    elif found.surface is None:
        notes.append(f"no surface over lengths ({found.failed}): each length pre-searched on its own")
    if steps.fakes is not None and found is not None and found.surface is not None:
        # Independent trials, all known now: run side by side where there are lanes.
        steps.fakes.prefetch(
            steps.task,
            _confirmations(
                found,
                lengths,
                config=steps.config,
                limit_bytes=steps.fake_limit,
                cap=cap,
                unit=steps.length_step,
            ),
        )
    run = steps.measure_each(lengths, found, target_tokens, notes)
    if found is not None and found.surface is not None:
        try:
            longest = steps.longest(found.surface, lengths[0], cap, model_limit=model_limit)
        except Exception as exc:  # noqa: BLE001  # late in the run: keep every length measured, say what failed
            longest = None
            failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
            for profile in run.profiles:
                profile.warnings.append(f"the longest-length search failed after every length was measured ({failed})")
        run.surface = _surface_record(found, run.profiles, longest, cap=steps.config.max_micro_batch)
    multiple_of = steps.config.multiple_of
    for seq_len, reason in run.no_fit.items():
        for profile in run.profiles:
            profile.warnings.append(f"at seq_len {seq_len} not even micro-batch {multiple_of} fits: {reason}")
    seconds = round(time.perf_counter() - started, 3)
    for profile in run.profiles:
        profile.surface = run.surface
        profile.seconds = seconds  # one measurement: the whole run's time, in each of its profiles
    return run


def _checked(task: ProbeTask, config: ProbeConfig | EstimateConfig, lengths: Sequence[int]) -> ProbeTask:
    """The run's configuration and lengths checked, and the task as the config sets it up (the
    surface's trials too, not only each length's, run at its precision and memory policy)."""
    config.validate()
    check_lengths(task, lengths)
    return config.applied_to(task)


# Said in every profile of a pipeline's run over lengths: what it measured and what it did not.
PIPELINE_LENGTHS = (
    "a pipeline's lengths are each searched on their own, stage by stage (--pp with --seq-len): no surface over "
    "lengths is traced and the longest length is not searched"
)


def _each_length_on_its_own(
    task: ProbeTask,
    lengths: Sequence[int],
    measure: Callable[[ProbeTask, int | None], Profile],
    *,
    config: ProbeConfig,
    target_tokens: int | None,
) -> LengthsRun:
    """A run over lengths where no surface can be traced (a pipeline's stages replay a schedule per length): each
    length measured by its own single-length search, the lengths where not even multiple_of fits said in the
    others' profiles, and the shortest length's own error where none fits."""
    started = time.perf_counter()
    run = LengthsRun(profiles=[])
    errors: dict[int, BudgetError] = {}
    for seq_len in lengths:
        target, token_note = target_at_length(
            seq_len, target_batch=config.target_batch, target_tokens=target_tokens, world_size=config.data_parallel
        )
        try:
            profile = measure(task.at_length(seq_len), target)
        except BudgetError as exc:
            run.no_fit[seq_len] = str(exc)
            errors[seq_len] = exc
            continue
        if token_note:
            profile.warnings.append(token_note)
        profile.warnings.append(PIPELINE_LENGTHS)
        run.profiles.append(profile)
    if not run.profiles:
        shortest = min(lengths)
        raise type(errors[shortest])(f"at seq_len {shortest}: {errors[shortest]}")
    seconds = round(time.perf_counter() - started, 3)
    for profile in run.profiles:
        for seq_len, reason in run.no_fit.items():
            profile.warnings.append(f"at seq_len {seq_len} not even micro-batch {config.multiple_of} fits: {reason}")
        profile.seconds = seconds
    return run


def probe_lengths(
    task: ProbeTask,
    config: ProbeConfig,
    lengths: Sequence[int],
    *,
    max_seq_len: int | None = None,
    target_tokens: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> LengthsRun:
    """Probe a sequence-aware task at every length in one run (see the module docstring).

    Args:
        task: a sequence-aware ProbeTask (its batch takes ``seq_len``).
        config: the ProbeConfig (target_batch is in sequences; ``target_tokens`` replaces it).
        lengths: the lengths to answer.
        max_seq_len: the cap of the longest-length search (default 4x the longest asked for).
        target_tokens: tokens per update, planned in sequences at each length.

    Raises:
        TaskError: the task is not sequence-aware, or a length is not a positive integer.
        BudgetError: not even multiple_of fits at any of the lengths.
        AutotuneError: as ``probe`` raises.
    """
    from autotune.orchestrate.probe import probe_with_meter

    task = _checked(task, config, lengths)
    # A compiled task's trials at every length run compiled, on the meter that sees the compiled code's buffers: each
    # length's probe compiles and confirms static as a single-length probe does (docs/compile.md).
    # A torchao optimizer's step is compiled too (autotune/tasks/optimizers.py), as probe() reads it.
    compiled = task.compile is not None or compiled_step(task.optimizer) is not None
    meter = make_meter(resolve_device(config.device), config.budget_bytes, compiled=compiled)
    try:
        if config.job_setup.planner == "pipeline":  # each length's stages replay their schedule
            return _probe_pipeline_lengths(task, config, lengths, meter, target_tokens, on_trial)
        limit_bytes = units.limit_bytes(meter.budget_bytes, config.headroom)
        strategy = make_strategy(config.strategy, config.world_size, config.mesh)

        def measure(task_at: ProbeTask, presearched: FakeSearch | None, target: int | None) -> Profile:
            # One length's probe: its target in sequences, and no lengths of its own.
            at_config = config.with_setup(target_batch=target, target_tokens=None, seq_lens=())
            return probe_with_meter(
                task_at, meter, at_config, on_trial=at_length(on_trial, task_at.seq_len), presearched=presearched
            )

        # The host budget (--host-budget under an offload) decides the longest length as it decides m_max.
        runner = TrialRunner(
            task, meter, limit_bytes=limit_bytes, strategy=strategy, host_limit_bytes=config.host_budget_bytes
        )

        def trial_at(task_at: ProbeTask) -> Trial:
            runner.task = task_at  # the model is the same at every length
            return runner(config.multiple_of)

        steps = _Lengths(
            task=task,
            measure=measure,
            trial_at=trial_at,
            release=runner.close,
            group=lambda: strategy.process_group(meter.device),
            strategy=strategy,
            device=meter.device,
            limit_bytes=limit_bytes,
            # What the device holds that fake tensors never show (the CUDA context) is not theirs.
            fake_limit=max(1, limit_bytes - meter.unseen_bytes()),
            config=config,
            on_trial=on_trial,
        )
        try:
            return _over_lengths(
                steps,
                lengths,
                max_seq_len=max_seq_len,
                target_tokens=target_tokens,
                presearch=config.presearch,
                device_name=None,
            )
        except _NothingFits as nothing:
            raise _nothing_fits(
                nothing, lambda seq_len: measure(task.at_length(seq_len), None, config.target_batch)
            ) from None
    finally:
        meter.close()


def _probe_pipeline_lengths(
    task: ProbeTask,
    config: ProbeConfig,
    lengths: Sequence[int],
    meter: Meter,
    target_tokens: int | None,
    on_trial: Callable[[Trial], None] | None,
) -> LengthsRun:
    """A pipeline's probe at each length on its own (probe_with_meter's pipeline search): no surface is traced over
    its stages."""
    from autotune.orchestrate.probe import probe_with_meter

    def one_length(task_at: ProbeTask, target: int | None) -> Profile:
        at_config = config.with_setup(target_batch=target, target_tokens=None, seq_lens=())
        return probe_with_meter(task_at, meter, at_config, on_trial=at_length(on_trial, task_at.seq_len))

    ordered = check_lengths(task, lengths)
    return _each_length_on_its_own(task, ordered, one_length, config=config, target_tokens=target_tokens)


def _estimate_pipeline_lengths(
    task: ProbeTask,
    config: EstimateConfig,
    lengths: Sequence[int],
    target_tokens: int | None,
    on_trial: Callable[[Trial], None] | None,
) -> LengthsRun:
    """A pipeline's estimate at each length on its own (estimate's pipeline search)."""
    from autotune.orchestrate.estimate import estimate

    def one_length(task_at: ProbeTask, target: int | None) -> Profile:
        return estimate(task_at, config.with_setup(target_batch=target), on_trial=at_length(on_trial, task_at.seq_len))

    ordered = check_lengths(task, lengths)
    return _each_length_on_its_own(task, ordered, one_length, config=config.probe, target_tokens=target_tokens)


def _lanes(
    task: ProbeTask, setup: ProbeConfig, workers: int | None, device_type: str, device_name: str
) -> FakeLanes | None:
    """The worker processes that run a run's independent fake trials beside this one (autotune/search/lanes.py)."""
    return FakeLanes.for_task(
        task,
        spare_cores() if workers is None else workers,
        device_type=device_type,
        strategy=setup.strategy,
        world_size=setup.world_size,
        device_name=device_name,
        hold=hold_lane_model,
        mesh=setup.mesh.label(),
    )


def estimate_lengths(
    task: ProbeTask,
    config: EstimateConfig,
    lengths: Sequence[int],
    *,
    max_seq_len: int | None = None,
    target_tokens: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    workers: int | None = 0,
) -> LengthsRun:
    """``probe_lengths`` with fake trials only (``autotune estimate --seq-len``): each length's m_max
    and the longest length are confirmed by fake trials at them and one step past them.

    ``workers``: processes that run independent fake trials beside this one (autotune/search/lanes.py),
    for a task loaded from a spec whose fake trials are slow; None: one per idle core (at most 3).
    They are spawned: a script that asks for them needs an ``if __name__ == "__main__":`` guard.
    """
    from autotune.orchestrate.estimate import estimate, estimate_device_type

    task = _checked(task, config, lengths)
    setup = config.probe
    assert setup.budget_bytes is not None  # validate() refused None
    if setup.job_setup.planner == "pipeline":  # each length's stages replay their schedule: estimate's own search
        return _estimate_pipeline_lengths(task, config, lengths, target_tokens, on_trial)
    limit_bytes = units.limit_bytes(setup.budget_bytes, setup.headroom)
    device_type, _ = estimate_device_type(config.device_kind)
    strategy = make_strategy(setup.strategy, setup.world_size, setup.mesh)
    held = fake_strategy(strategy)
    device_name = config.device_name or f"{config.device_kind} (estimate)"

    def measure(task_at: ProbeTask, presearched: FakeSearch | None, target: int | None) -> Profile:
        at_config = config.with_setup(target_batch=target)
        reporting = at_length(on_trial, task_at.seq_len)
        if presearched is None:
            return estimate(task_at, at_config, on_trial=reporting, fakes=fakes)
        # The surface's trials at this length are this estimate's own fake trials: not run twice.
        return estimate(
            task_at,
            at_config,
            on_trial=reporting,
            hint=presearched.max_micro_batch,
            known=presearched.trials,
            fakes=fakes,
        )

    def trial_at(task_at: ProbeTask) -> Trial:
        trial, _ = fakes.run(task_at, setup.multiple_of, budget_bytes=budget_bytes, limit_bytes=limit_bytes)
        return trial

    budget_bytes = setup.budget_bytes
    # One fake model and meter for the whole run, in one process group held around it: the surface,
    # every length's confirmations and the longest length's search run on it (a 7B model takes
    # seconds to build and its dispatch cache a trial to warm).
    try:
        with held.process_group(torch.device(device_type)), frozen_heap():
            lanes = _lanes(task, setup, workers, device_type, device_name)
            fakes = FakeTrials(task, device_type=device_type, strategy=held, device_name=device_name, lanes=lanes)
            steps = _Lengths(
                task=task,
                measure=measure,
                trial_at=trial_at,
                release=lambda: None,
                group=nullcontext,
                strategy=held,
                device=torch.device(device_type),
                limit_bytes=limit_bytes,
                fake_limit=limit_bytes,
                config=setup,
                on_trial=on_trial,
                fakes=fakes,
            )
            try:
                return _over_lengths(
                    steps,
                    lengths,
                    max_seq_len=max_seq_len,
                    target_tokens=target_tokens,
                    presearch=True,
                    device_name=device_name,
                )
            finally:
                fakes.close()
    except _NothingFits as nothing:
        # Outside the held group: the shortest length's own estimate diagnoses what the job needs.
        raise _nothing_fits(
            nothing,
            lambda seq_len: estimate(task.at_length(seq_len), config.with_setup(target_batch=None)),
        ) from None
