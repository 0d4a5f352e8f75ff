"""An estimate's datasheet: the Profile of fake trials, whichever semantics ran them (CPU, or an emulated
card's: autotune/orchestrate/estimate.py, card_estimate.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import autotune
from autotune.core.consistency import check_profile
from autotune.core.plan import nonnegative_fit
from autotune.core.schemas import Device, Fit, Lever, MemoryBreakdown, Profile, Trial
from autotune.measure.offload import offload_fields
from autotune.orchestrate.config import EstimateConfig
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.task import ProbeTask

__all__ = ["estimated_profile", "non_monotone_sizes"]


def non_monotone_sizes(trials: Sequence[Trial]) -> list[int]:
    """The sizes that fit above the smallest size that did not (none where the figure is monotone)."""
    failed = [t.micro_batch for t in trials if not t.fits]
    if not failed:
        return []
    first = min(failed)
    return sorted({t.micro_batch for t in trials if t.fits and t.micro_batch > first})


def estimated_profile(
    task: ProbeTask,
    config: EstimateConfig,
    *,
    device: Device,
    max_micro_batch: int,
    trials: Sequence[Trial],
    fit: Fit | None,
    warnings: list[str],
    started: float,
    torch_version: str,
    breakdown: list[MemoryBreakdown] | None = None,
    levers: list[Lever] | None = None,
) -> Profile:
    """The estimate's Profile, checked as the store would check it (``source: estimate``; the plan for
    config's target)."""
    setup = config.probe
    assert setup.budget_bytes is not None
    # DDP over the data-parallel replicas (under --tp and --pp over the dp dimension, under --cp over every rank):
    # its buckets are held by the fake trials, so nothing is said of them.
    if task.tags.get("quantize"):
        from autotune.tasks.quantize import fake_kernel_note

        warnings.append(fake_kernel_note(str(task.tags["quantize"]), config.device_kind))
    the_plan = setup.plan_for(max_micro_batch, warnings)
    above = non_monotone_sizes(trials)
    if above:
        # The caching allocator's staircase is not monotone in m: a size past the first one over the limit
        # can fit again (the H200 read 1.81 GiB at m = 1225 and 1.79 at 1212).
        warnings.append(
            f"the figure is not monotone in m: {', '.join(str(m) for m in above[:5])}"
            f"{' ...' if len(above) > 5 else ''} fit(s) above the first size over the limit; max micro-batch "
            f"{max_micro_batch} is the largest below it, so every size up to it fits"
        )
    profile = Profile(
        fingerprint=task_fingerprint(task, strategy=setup.strategy, world_size=setup.world_size, mesh=setup.mesh),
        task=task.name,
        device=device,
        devices=[device],
        precision=task.precision,
        tags=dict(task.tags),
        budget_bytes=setup.budget_bytes,
        headroom=setup.headroom,
        max_micro_batch=max_micro_batch,
        micro_batch_cap=setup.max_micro_batch,
        multiple_of=setup.multiple_of,
        world_size=setup.world_size,
        strategy=setup.strategy,
        mesh=setup.mesh.as_dict() or None,
        activation_checkpointing=task.activation_checkpointing,
        source="estimate",
        seq_len=task.seq_len,
        plan=the_plan,
        trials=list(trials),
        fit=nonnegative_fit(fit),
        trial_count=len(trials),
        oom_count=sum(1 for t in trials if t.oom),
        seconds=round(time.perf_counter() - started, 3),
        warnings=warnings,
        torch_version=torch_version,
        autotune_version=autotune.__version__,
        **offload_fields(task.offload, None, list(trials), max_micro_batch, config.device_kind, warnings),
        non_monotone=bool(above),
        breakdown=breakdown,
        levers=levers,
    )
    # A profile the store would refuse is a bug here, not something to write or upload.
    check_profile(profile)
    return profile
