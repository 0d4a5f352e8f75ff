"""Orchestration: device -> search -> plan -> Profile (the datasheet of one job setup).

profile = probe(load_task("examples/gpt.py:task"), ProbeConfig(device="cpu", budget_bytes=32 << 20))
profile.max_micro_batch, profile.plan
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import autotune
from autotune.core import units
from autotune.core.consistency import check_profile
from autotune.core.errors import CannotFitError, DeviceError, TaskError
from autotune.core.plan import nonnegative_fit, plan
from autotune.core.schemas import Fit, MemoryBreakdown, Plan, Profile, SingleStep, Throughput, Trial
from autotune.core.units import format_bytes
from autotune.measure.fragmentation import reserved_gap_at
from autotune.measure.meters import Meter, make_meter, resolve_device
from autotune.measure.meters.compiled import CompiledCpuMeter, compiled_job
from autotune.measure.meters.cuda import CudaMeter
from autotune.measure.offload import host_capped_hint, offload_fields
from autotune.measure.strategies import Replicated, Strategy
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.throughput import DEFAULT_MIN_SECONDS, DEFAULT_REPEATS, timed_updates
from autotune.measure.trial import TrialRunner, frozen_heap
from autotune.orchestrate.breakdowns import chosen_breakdowns
from autotune.orchestrate.config import ProbeConfig
from autotune.search.boundary import NoFitError, SearchResult, find_max_micro_batch, peaks_decrease, reported
from autotune.search.diagnose import no_fit_error
from autotune.search.pipelined import PipelineSearch, search_pipeline
from autotune.search.presearch import FakeSearch, fake_search, presearch_failed
from autotune.search.static import confirm_static
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.optimizers import compiled_step, refuse_compiled_step
from autotune.tasks.task import ProbeTask

# ProbeConfig lives in autotune/orchestrate/config.py (the config family); imported here too, where the
# callers of the probe have always found it.
__all__ = ["BATCHNORM_SMALL_MICRO_BATCH", "probe", "probe_with_meter"]

# Below this many samples per micro-batch, BatchNorm's batch statistics get noisy enough to change
# training; accumulation does not help them because BatchNorm never sees the whole group.
BATCHNORM_SMALL_MICRO_BATCH = 16


def _has_batchnorm(task: ProbeTask) -> bool:
    try:
        with torch.device("meta"):
            model = task.model()
    except Exception:
        model = task.model()
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _guide(fake: FakeSearch, real: SearchResult) -> Fit | None:
    """The fit a profile keeps: where the pre-search ran, the fake line (exact on the CPU, smooth on
    CUDA) moved to pass through the real forward/backward point at m_max; else the real trials' own."""
    if fake.fit is None:
        return real.fit
    at_max = next(
        (t for t in real.trials if t.micro_batch == real.max_micro_batch and t.forward_backward_bytes is not None),
        None,
    )
    if at_max is None or at_max.forward_backward_bytes is None:
        return real.fit
    slope = fake.fit.bytes_per_sample
    return Fit(fixed_bytes=at_max.forward_backward_bytes - slope * at_max.micro_batch, bytes_per_sample=slope)


def _search(
    task: ProbeTask,
    meter: Meter,
    config: ProbeConfig,
    strategy: Strategy,
    limit_bytes: int,
    warnings: list[str],
    on_trial: Callable[[Trial], None] | None,
    presearched: FakeSearch | None = None,
    breakdowns: dict[int, MemoryBreakdown] | None = None,
) -> tuple[SearchResult, FakeSearch | None, int | None]:
    """Pre-search on fake trials (unless turned off, impossible, or ``presearched`` already), then
    real trials from its answer; also the m_max they started from (None: no pre-search)."""
    if config.job_setup.planner == "pipeline":  # every stage's trial replays its schedule (search/pipelined.py)
        found = search_pipeline(
            task,
            meter,
            config.mesh,
            strategy,
            limit_bytes,
            warnings,
            on_trial,
            max_micro_batch=config.max_micro_batch,
            multiple_of=config.multiple_of,
            breakdowns=breakdowns,
            host_limit_bytes=config.host_budget_bytes,
        )
        return found, None, None
    fake = (
        presearched
        if presearched is not None or not config.presearch
        else _presearch(task, meter, config, strategy, limit_bytes, warnings, on_trial)
    )
    hint = fake.max_micro_batch if fake is not None else None
    if hint is not None and fake is not None and config.host_budget_bytes is not None:  # --host-budget
        hint = host_capped_hint(hint, fake.trials, config.host_budget_bytes, config.multiple_of)
    if fake is not None and fake.trials and meter.device.type == "cuda":
        hint = _reserved_hint(task, meter, config, strategy, limit_bytes, hint, warnings)
    runner = TrialRunner(
        task,
        meter,
        limit_bytes=limit_bytes,
        strategy=strategy,
        reuse_model=config.reuse_model,
        host_limit_bytes=config.host_budget_bytes,
    )
    runner.breakdowns = breakdowns  # each real trial broken down, where asked (autotune/measure/breakdown.py)

    trial = reported(runner, on_trial)

    try:
        result = find_max_micro_batch(
            trial,
            limit_bytes=limit_bytes,
            max_micro_batch=config.max_micro_batch,
            multiple_of=config.multiple_of,
            hint=hint,
            guide=fake.fit if fake is not None else None,
        )
    finally:
        runner.close()
        for warning in runner.warnings:
            if warning not in warnings:
                warnings.append(warning)
    return result, fake, hint if fake is not None and fake.trials else None


def _presearch(
    task: ProbeTask,
    meter: Meter,
    config: ProbeConfig,
    strategy: Strategy,
    limit_bytes: int,
    warnings: list[str],
    on_trial: Callable[[Trial], None] | None,
) -> FakeSearch | None:
    """The boundary by fake trials (autotune/search/presearch.py), where the real trials start: an empty one where not
    even the smallest size fits fake (the real trials will say so, with the real figures), None where an op cannot
    run fake (real trials only, with a warning)."""
    try:
        # What the device holds that fake tensors never show (the CUDA context) is not theirs.
        unseen = meter.unseen_bytes()
        fake = fake_search(
            task,
            budget_bytes=max(1, meter.budget_bytes - unseen),
            limit_bytes=max(1, limit_bytes - unseen),
            device_type=str(meter.device),
            strategy=strategy,
            max_micro_batch=config.max_micro_batch,
            multiple_of=config.multiple_of,
            on_trial=on_trial,
        )
    except NoFitError:
        return FakeSearch(max_micro_batch=config.multiple_of, trials=[], fit=None)
    except Exception as exc:  # an op that cannot run fake: real trials only
        warnings.append(presearch_failed(exc))
        return None
    warnings.extend(fake.warnings)
    return fake


def single_step_cap(
    task: ProbeTask, config: ProbeConfig, m_max: int, trials: list[Trial] | None = None, limit_bytes: int | None = None
) -> int | None:
    """The micro-batch per replica that meets the target in one step (A = 1), where measuring that case can
    change the plan: above the accumulating m_max (at or below it the accumulating trial, which holds a
    gradient set more, already bounds it) and within the cap. None where it cannot:

    - no target: no plan depends on it (the profile's m_max stays the accumulating job's);
    - a job that keeps its gradients between steps (--zero-grad keep) holds them in a single step's forward too;
    - the activations alone at that size are above the limit: a single step saves one gradient set, at most
      the part of the peak that does not grow with m, so the per-sample bytes the accumulating trials measured
      (the fitting m_max and the first size above it that did not fit) times the size bound it from below.
    """
    if not task.zero_grad_to_none or config.job_setup.planner == "pipeline":  # its step runs its K micro-batches
        return None
    if not config.target_batch:
        return None
    try:
        one_step = plan(
            config.max_micro_batch, config.target_batch, config.data_parallel, multiple_of=config.multiple_of
        )
    except ValueError:
        return None
    if one_step.accumulation_steps != 1 or not one_step.exact:  # above the cap, or no exact one-step plan
        return None
    cap = one_step.micro_batch
    if cap <= m_max:
        return None
    if trials and limit_bytes is not None:
        at_max = [t for t in trials if t.micro_batch == m_max and t.fits and not t.oom and not t.fake]
        above = sorted(
            # An OOM's peak is where the meter stopped it, below its whole peak: the slope only reads lower.
            (t for t in trials if t.micro_batch > m_max and not t.fake and t.peak_bytes > 0),
            key=lambda t: t.micro_batch,
        )
        if at_max and above and above[0].peak_bytes > at_max[0].peak_bytes:
            per_sample = (above[0].peak_bytes - at_max[0].peak_bytes) / (above[0].micro_batch - m_max)
            if per_sample * cap > limit_bytes:
                return None
    return cap


def _search_single_step(
    task: ProbeTask,
    meter: Meter,
    config: ProbeConfig,
    strategy: Strategy,
    limit_bytes: int,
    m_max: int,
    cap: int,
    guide: Fit | None,
    warnings: list[str],
    on_trial: Callable[[Trial], None] | None,
) -> SingleStep | None:
    """m_max of the job that does not accumulate (one micro-batch per step), up to cap, by trials of its own
    (TrialRunner(accumulation=1)), starting from the accumulating job's m_max, which holds a gradient set
    more and so fits here too."""
    runner = TrialRunner(
        task,
        meter,
        limit_bytes=limit_bytes,
        strategy=strategy,
        reuse_model=config.reuse_model,
        accumulation=1,
        host_limit_bytes=config.host_budget_bytes,
    )

    trial = reported(runner, on_trial)

    try:
        found = find_max_micro_batch(
            trial, limit_bytes=limit_bytes, max_micro_batch=cap, multiple_of=config.multiple_of, hint=m_max, guide=guide
        )
    except NoFitError:  # not even the accumulating m_max: nothing to add
        return None
    finally:
        runner.close()
        for warning in runner.warnings:
            if warning not in warnings:
                warnings.append(warning)
    return SingleStep(max_micro_batch=found.max_micro_batch, cap=cap, trials=found.trials)


def _single_step_warning(single: SingleStep, m_max: int, config: ProbeConfig) -> str:
    """What the datasheet says of the job that does not accumulate: which case applies."""
    gain = f"{single.max_micro_batch} fits (the accumulating job's {m_max}: its forwards hold a gradient set)"
    if not config.target_batch:
        return (
            f"without accumulation (A = 1: one micro-batch, then the step) micro-batch {gain}; measured by "
            f"single-step trials up to {single.cap}"
        )
    if single.max_micro_batch >= single.cap:
        return (
            f"target {config.target_batch} is met without accumulation (A = 1): micro-batch {single.cap} per replica "
            f"in one step, measured by single-step trials; an accumulating job fits {m_max}"
        )
    return (
        f"target {config.target_batch} needs micro-batch {single.cap} per replica without accumulation, and a "
        f"single step fits {single.max_micro_batch}: the plan accumulates (A >= 2, micro-batch at most {m_max})"
    )


# The warning's opening, where the caching allocator's model predicted the real search's start.
RESERVED_PREDICTION = "the caching allocator's model predicted max micro-batch"


def _reserved_hint(
    task: ProbeTask,
    meter: Meter,
    config: ProbeConfig,
    strategy: Strategy,
    limit_bytes: int,
    live_hint: int | None,
    warnings: list[str],
) -> int | None:
    """On a card: where the real trials start, by fake trials replayed through the caching allocator's
    model (autotune/search/reserved.py) with this process's memory outside the allocator, as the card's
    own figure is (reserved + outside): the step of the allocator's staircase that crosses the limit,
    where the live bytes' line crosses it elsewhere. A model that cannot run leaves the live bytes' hint."""
    from autotune.search.reserved import CUBLAS_HANDLES, cublas_workspace_bytes, reserved_search

    try:
        major = torch.cuda.get_device_capability(meter.device)[0]
        found = reserved_search(
            task,
            device_type=str(meter.device),
            device_name=meter.describe().name,
            budget_bytes=meter.budget_bytes,
            limit_bytes=limit_bytes,
            outside_bytes=meter.unseen_bytes(),
            workspace_bytes=[cublas_workspace_bytes(major, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))] * CUBLAS_HANDLES,
            strategy=strategy,
            max_micro_batch=config.max_micro_batch,
            multiple_of=config.multiple_of,
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            hint=live_hint,
        )
    except Exception as exc:  # the live bytes' hint still stands
        warnings.append(f"the caching allocator's model could not predict the boundary: {presearch_failed(exc)}")
        return live_hint
    if found.no_fit:
        return config.multiple_of
    return found.max_micro_batch


@dataclass
class _Job:
    """A probe's job as its steps share it: the task with the setup applied, the config, the strategy, the limit, the
    datasheet's warnings so far, the breakdowns asked for, and where the trials are reported."""

    task: ProbeTask
    config: ProbeConfig
    strategy: Strategy
    limit_bytes: int
    warnings: list[str]
    breakdowns: dict[int, MemoryBreakdown] | None
    on_trial: Callable[[Trial], None] | None
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Found:
    """What the search found: its result, the pre-search it started from (None: none ran) and the m_max that one
    predicted (None: none), and the case without accumulation where it was measured."""

    result: SearchResult
    fake: FakeSearch | None
    predicted: int | None
    single: SingleStep | None = None


@frozen_heap()
def probe_with_meter(
    task: ProbeTask,
    meter: Meter,
    config: ProbeConfig,
    *,
    on_trial: Callable[[Trial], None] | None = None,
    presearched: FakeSearch | None = None,
) -> Profile:
    """Probe on a meter that is already set up (tests use this to share one meter).

    ``presearched``: what a pre-search already found (the surface of a probe over lengths, read at
    this task's length): the real trials start from it instead of from a fake search of their own.
    """
    job = _prepared(task, meter, config, on_trial, presearched)
    found = _searched(job, meter, presearched)
    if isinstance(found, NoFitError):  # diagnosed by fake trials, outside the job's process group
        raise _diagnosed(job, meter, found)
    the_plan = _planned(job, meter, found)
    profile = _profile_of(job, meter, found, the_plan)
    task, config, m_max = job.task, job.config, found.result.max_micro_batch
    profile.breakdown = chosen_breakdowns(job.breakdowns, task, config, m_max, meter.device.type, profile.warnings)
    if config.levers:  # what each change of the setup would buy, by fake trials (autotune/orchestrate/levers.py)
        from autotune.orchestrate.estimate import estimate
        from autotune.orchestrate.levers import pull_levers

        profile.levers = pull_levers(
            task, config, at_micro_batch=m_max, device_type=meter.device.type, estimator=estimate
        )
    if config.throughput:  # timed runs, never the search's trials
        profile.throughput = _timed(task, meter, job.strategy, config, m_max, the_plan, profile.warnings)
    # A profile the store would refuse is a bug here, not something to write or upload.
    check_profile(profile)
    return profile


def _prepared(
    task: ProbeTask,
    meter: Meter,
    config: ProbeConfig,
    on_trial: Callable[[Trial], None] | None,
    presearched: FakeSearch | None,
) -> _Job:
    """The job checked and its setup applied to the task, before any trial."""
    config.validate()
    if task.sequence_aware and task.seq_len is None:
        raise TaskError(
            f"task {task.name!r} is sequence-aware (its batch takes seq_len=): probe it at its lengths with "
            "--seq-len L1,L2,... (autotune.orchestrate.lengths.probe_lengths), or bind one with task.at_length(L)"
        )
    task = config.applied_to(task)
    if compiled_step(task.optimizer) is not None:  # torchao's: the allocator's count, no fake pre-search
        allocator_count = isinstance(meter, CompiledCpuMeter | CudaMeter)
        refuse_compiled_step(task.optimizer, allocator_count=allocator_count)
        config = config.with_setup(presearch=False)
    warnings: list[str] = []
    if task.compile is not None:  # what runs compiled and what was estimated eager (docs/compile.md)
        warnings += compiled_job(task, meter, presearch=config.presearch and presearched is None, stages=config.mesh.pp)
    return _Job(
        task,
        config,
        make_strategy(config.strategy, config.world_size, config.mesh),
        units.limit_bytes(meter.budget_bytes, config.headroom),
        warnings,
        {} if config.breakdown else None,
        on_trial,
    )


def _searched(job: _Job, meter: Meter, presearched: FakeSearch | None) -> _Found | NoFitError:
    """The search in the job's process group: m_max (a compiled one confirmed by static compiles), and the case
    without accumulation where it can change the plan; the NoFitError where not even the smallest size fits."""
    task, config, strategy, limit_bytes, warnings = job.task, job.config, job.strategy, job.limit_bytes, job.warnings
    with strategy.process_group(meter.device):
        if isinstance(strategy, Replicated) and config.world_size > 1 and not strategy.measures_buckets:
            warnings.append("a multi-process group is already running: DDP gradient buckets were not measured")
        try:
            result, fake, predicted = _search(
                task, meter, config, strategy, limit_bytes, warnings, job.on_trial, presearched, job.breakdowns
            )
            # A compiled search's answer, confirmed by static compiles at m_max and above (docs/compile.md).
            result = confirm_static(
                task, meter, config, strategy, limit_bytes, result, warnings, job.on_trial, job.breakdowns
            )
            found = _Found(result, fake, predicted)
            cap = single_step_cap(task, config, result.max_micro_batch, result.trials, limit_bytes)
            if cap is not None:  # A = 1 can apply: measured as a case of its own
                guide = fake.fit if fake is not None else None
                found.single = _search_single_step(
                    task,
                    meter,
                    config,
                    strategy,
                    limit_bytes,
                    result.max_micro_batch,
                    cap,
                    guide,
                    warnings,
                    job.on_trial,
                )
            return found
        except NoFitError as exc:
            return exc


def _diagnosed(job: _Job, meter: Meter, no_fit: NoFitError) -> CannotFitError:
    """The one line of a job whose smallest size does not fit: over the host budget, or what it needs and the
    cheapest change that fits it (by fake trials; a pipeline's on its most loaded stage)."""
    task, config = job.task, job.config
    over_host = _over_host_budget(no_fit.trial, config.host_budget_bytes, job.limit_bytes)
    if over_host is not None:
        return CannotFitError(over_host)
    error = no_fit_error(
        task,
        config,
        budget_bytes=meter.budget_bytes,
        device_type=str(meter.device),
        unseen_bytes=meter.unseen_bytes(),
        # What the real trial held: a compiled step's buffers, which the eager fake trial does not.
        # (An OOM's figure is where the budget stopped it, a floor, not a peak: left out.)
        measured_bytes=None if no_fit.trial.fake or no_fit.trial.oom else no_fit.trial.peak_bytes,
    )
    from autotune.orchestrate.levers import with_cheapest_lever

    return with_cheapest_lever(
        error, task, config, budget_bytes=meter.budget_bytes, device_type=meter.device.type,
        unseen_bytes=meter.unseen_bytes(),
    )  # fmt: skip


def _planned(job: _Job, meter: Meter, found: _Found) -> Plan | None:
    """The one plan every reader of the stored profile makes (autotune.core.plan.plan_with_single_step), and what the
    datasheet says of the search: a peak that went down as m went up, a prediction the real trials corrected, the
    case without accumulation, BatchNorm at a small micro-batch."""
    warnings, result, single = job.warnings, found.result, found.single
    m_max = result.max_micro_batch
    decrease = peaks_decrease(result.trials)
    if decrease is not None:
        low, high = decrease
        warnings.append(
            f"the peak is not monotone in m on this device (m={low.micro_batch} peaked at {low.peak_bytes} bytes, "
            f"m={high.micro_batch} at {high.peak_bytes}): max micro-batch {m_max} is the largest m below the "
            "smallest size measured not to fit, and only measured sizes are planned"
        )
    if found.predicted is not None and found.predicted != m_max:
        what = RESERVED_PREDICTION if meter.device.type == "cuda" else "the fake pre-search predicted max micro-batch"
        warnings.append(f"{what} {found.predicted}; the real trials found {m_max}")
    if single is not None:
        warnings.append(_single_step_warning(single, m_max, job.config))
    the_plan = job.config.plan_for(m_max, warnings, single.max_micro_batch if single is not None else None)
    chosen = the_plan.micro_batch if the_plan else m_max
    if chosen < BATCHNORM_SMALL_MICRO_BATCH and _has_batchnorm(job.task):
        warnings.append(
            f"the model has BatchNorm and the micro-batch is {chosen}: BatchNorm normalises each "
            "micro-batch on its own, and accumulation does not change that"
        )
    return the_plan


def _profile_of(job: _Job, meter: Meter, found: _Found, the_plan: Plan | None) -> Profile:
    """The datasheet of the job's search (docs/design.md, "Contracts")."""
    task, config, result, fake = job.task, job.config, found.result, found.fake
    m_max = result.max_micro_batch
    device = meter.describe()
    return Profile(
        fingerprint=task_fingerprint(task, strategy=config.strategy, world_size=config.world_size, mesh=config.mesh),
        task=task.name,
        device=device,
        devices=[device],
        precision=task.precision,
        tags=dict(task.tags),
        budget_bytes=meter.budget_bytes,
        headroom=config.headroom,
        max_micro_batch=m_max,
        micro_batch_cap=config.max_micro_batch,
        multiple_of=config.multiple_of,
        world_size=config.world_size,
        strategy=config.strategy,
        mesh=config.mesh.as_dict() or None,
        activation_checkpointing=task.activation_checkpointing,
        seq_len=task.seq_len,
        non_monotone=peaks_decrease(result.trials) is not None,
        expandable_segments=meter.expandable_segments(),
        reserved_gap_bytes=reserved_gap_at(result.trials, m_max),
        plan=the_plan,
        single_step=found.single,
        pipeline=result.pipeline if isinstance(result, PipelineSearch) else None,
        trials=[*(fake.trials if fake is not None else []), *result.trials],
        fit=nonnegative_fit(_guide(fake, result) if fake is not None and task.compile is None else result.fit),
        trial_count=len(result.trials),
        oom_count=result.oom_count,
        seconds=round(time.perf_counter() - job.started, 3),
        compile_seconds=None if meter.compile_seconds is None else round(meter.compile_seconds, 3),
        warnings=job.warnings,
        torch_version=torch.__version__,
        autotune_version=autotune.__version__,
        **offload_fields(task.offload, config.host_budget_bytes, result.trials, m_max, meter.device.type, job.warnings),
    )


def _timed(
    task: ProbeTask,
    meter: Meter,
    strategy: Strategy,
    config: ProbeConfig,
    m_max: int,
    the_plan: Plan | None,
    warnings: list[str],
) -> list[Throughput] | None:
    """The profile's timed runs at m_max and the plan's sizes: a pipeline's stage by stage, composed by its schedule
    (autotune/measure/pipeline/timing.py). Samples per update are counted over the replicas (D), which the plan's
    world size is: tp, pp and cp ranks share one micro-batch."""
    setup = config.job_setup
    if setup.planner == "pipeline":
        from autotune.measure.pipeline.timing import timed_pipeline_updates

        return timed_pipeline_updates(
            task,
            meter,
            strategy,
            setup.mesh,
            max_micro_batch=m_max,
            plan=the_plan,
            replicas=setup.data_parallel,
            repeats=DEFAULT_REPEATS,
            min_seconds=DEFAULT_MIN_SECONDS,
            warnings=warnings,
        )
    return timed_updates(
        task, meter, strategy, max_micro_batch=m_max, plan=the_plan, world_size=setup.data_parallel, warnings=warnings
    )


def _over_host_budget(trial: Trial, host_budget_bytes: int | None, limit_bytes: int) -> str | None:
    """The one line of a smallest micro-batch that fit the device but not the host budget (--offload keeps its
    bytes there); None where the device's limit is what it crossed."""
    host = trial.host_peak_bytes
    if host_budget_bytes is None or host is None or host <= host_budget_bytes or trial.oom:
        return None
    if trial.peak_bytes > limit_bytes:
        return None
    return (
        f"micro-batch {trial.micro_batch} does not fit the host budget: it keeps {host} bytes "
        f"({format_bytes(host)}) on the host, over --host-budget {host_budget_bytes} bytes "
        f"({format_bytes(host_budget_bytes)}); on the device it peaks at {trial.peak_bytes} bytes, within the "
        f"limit of {limit_bytes}: raise --host-budget to at least {host} bytes, or offload less"
    )


def probe(
    task: ProbeTask,
    config: ProbeConfig | None = None,
    *,
    on_trial: Callable[[Trial], None] | None = None,
) -> Profile:
    """Measure the largest micro-batch that fits and plan the target batch.

    Args:
        task: the job setup.
        config: device, budget, headroom, target batch, world size, caps.
        on_trial: called after each trial (progress output).

    Returns:
        The Profile (docs/design.md, "Contracts").

    Raises:
        AutotuneError: bad configuration, a device that does not exist, a budget too small for one
            sample (the message says what the weights and optimizer take), a misbehaving task.
    """
    config = config or ProbeConfig()
    config.validate()
    device = resolve_device(config.device)
    if device == "all":
        raise DeviceError(
            "--device all runs one process per GPU, each loading the task again: "
            "use `autotune probe file.py:name --device all` or "
            "autotune.orchestrate.multi.probe_all_devices(spec, config)"
        )
    compiled = config.applied_to(task).compile is not None or compiled_step(task.optimizer) is not None
    meter = make_meter(device, config.budget_bytes, compiled=compiled)
    try:
        return probe_with_meter(task, meter, config, on_trial=on_trial)
    finally:
        meter.close()
