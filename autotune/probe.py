"""Orchestration: device -> search -> plan -> Profile (the datasheet of one job setup).

profile = probe(load_task("examples/gpt.py:task"), ProbeConfig(device="cpu", budget_bytes=32 << 20))
profile.max_micro_batch, profile.plan
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import autotune
from autotune.errors import AutotuneError, BudgetError, DeviceError
from autotune.fingerprint import task_fingerprint
from autotune.meters import Meter, make_meter, resolve_device
from autotune.plan import MAX_TARGET_BATCH, plan
from autotune.schemas import PRECISIONS, Profile, Trial
from autotune.search import NoFitError, find_max_micro_batch
from autotune.task import ProbeTask
from autotune.trial import measure_weights, run_trial

__all__ = ["BATCHNORM_SMALL_MICRO_BATCH", "ProbeConfig", "probe", "probe_with_meter"]

# Below this many samples per micro-batch, BatchNorm's batch statistics get noisy enough to change
# training; accumulation does not help them because BatchNorm never sees the whole group.
BATCHNORM_SMALL_MICRO_BATCH = 16


@dataclass(frozen=True)
class ProbeConfig:
    """What to probe and under which budget (the CLI flags of `autotune probe`)."""

    device: str = "auto"
    budget_bytes: int | None = None
    headroom: float = 0.10
    target_batch: int | None = None
    world_size: int = 1
    max_micro_batch: int = 4096
    multiple_of: int = 1
    precision: str | None = None

    def validate(self) -> None:
        if not 0 <= self.headroom < 1:
            raise BudgetError(f"headroom must be in [0, 1), got {self.headroom}")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise BudgetError(f"budget must be positive, got {self.budget_bytes} bytes")
        for name in ("world_size", "max_micro_batch", "multiple_of"):
            value = getattr(self, name)
            if value < 1:
                raise AutotuneError(f"{name.replace('_', '-')} must be a positive integer, got {value}")
        if self.multiple_of > self.max_micro_batch:
            raise AutotuneError(f"multiple-of {self.multiple_of} is larger than max-micro-batch {self.max_micro_batch}")
        if self.target_batch is not None:
            if self.target_batch < 1:
                raise AutotuneError(f"target-batch must be a positive integer, got {self.target_batch}")
            if self.target_batch > MAX_TARGET_BATCH:
                raise AutotuneError(f"target-batch {self.target_batch} is larger than {MAX_TARGET_BATCH}")
            if self.target_batch < self.world_size:
                raise AutotuneError(
                    f"target-batch {self.target_batch} is smaller than world-size {self.world_size}: "
                    "every replica needs at least one sample per update"
                )
        if self.precision is not None and self.precision not in PRECISIONS:
            raise AutotuneError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


@contextmanager
def _single_process_group(world_size: int, device: torch.device) -> Iterator[Any]:
    """A one-process group so DDP allocates its gradient buckets; None when world_size == 1."""
    if world_size <= 1:
        yield None
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Inside a running job: its default group is the real one; DDP over it would talk to the
        # other ranks. Measure the buckets only when that group is this process alone.
        yield dist.group.WORLD if dist.get_world_size() == 1 else None
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _has_batchnorm(task: ProbeTask) -> bool:
    try:
        with torch.device("meta"):
            model = task.model()
    except Exception:
        model = task.model()
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def probe_with_meter(
    task: ProbeTask,
    meter: Meter,
    config: ProbeConfig,
    *,
    on_trial: Callable[[Trial], None] | None = None,
) -> Profile:
    """Probe on a meter that is already set up (tests use this to share one meter)."""
    config.validate()
    if config.precision is not None and config.precision != task.precision:
        task = dataclasses.replace(task, precision=config.precision)
    started = time.perf_counter()
    fingerprint = task_fingerprint(task)
    limit_bytes = int(meter.budget_bytes * (1.0 - config.headroom))

    with _single_process_group(config.world_size, meter.device) as group:
        warnings: list[str] = []
        if config.world_size > 1 and group is None:
            warnings.append("a multi-process group is already running: DDP gradient buckets were not measured")

        def trial(micro_batch: int) -> Trial:
            result = run_trial(task, meter, micro_batch, limit_bytes=limit_bytes, process_group=group)
            if on_trial is not None:
                on_trial(result)
            return result

        # Objects alive now (modules, the task, torch's own) are never garbage of a trial: freezing
        # them makes the collection after every trial walk only what the trial made.
        # A process that froze its own heap (some servers do) is left as it was.
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            result = find_max_micro_batch(
                trial,
                limit_bytes=limit_bytes,
                max_micro_batch=config.max_micro_batch,
                multiple_of=config.multiple_of,
            )
        except NoFitError as exc:
            static_bytes = measure_weights(task, meter)
            what = (
                f"weights, gradients and optimizer state alone take {static_bytes} bytes "
                "(with the optimizer step's temporaries)"
                if static_bytes is not None
                else "weights, gradients and optimizer state alone do not fit on the device"
            )
            raise BudgetError(
                f"micro-batch {config.multiple_of} does not fit in budget {meter.budget_bytes} bytes "
                f"(limit {limit_bytes} with headroom {config.headroom}): {what}; "
                f"micro-batch {config.multiple_of} peaked at {exc.trial.peak_bytes} bytes"
            ) from None
        finally:
            if freeze:
                gc.unfreeze()

    m_max = result.max_micro_batch
    the_plan = None
    if config.target_batch:
        try:
            the_plan = plan(m_max, config.target_batch, config.world_size, multiple_of=config.multiple_of)
        except ValueError as exc:  # the measurement stands even where no plan reaches the target
            warnings.append(f"no plan: {exc}")
    if the_plan is not None and not the_plan.exact:
        warnings.append(the_plan.note)
    if m_max >= config.max_micro_batch:
        warnings.append(f"micro-batch reached the cap {config.max_micro_batch}: more may fit")
    chosen = the_plan.micro_batch if the_plan else m_max
    if chosen < BATCHNORM_SMALL_MICRO_BATCH and _has_batchnorm(task):
        warnings.append(
            f"the model has BatchNorm and the micro-batch is {chosen}: BatchNorm normalises each "
            "micro-batch on its own, and accumulation does not change that"
        )
    device = meter.describe()
    return Profile(
        fingerprint=fingerprint,
        task=task.name,
        device=device,
        devices=[device],
        precision=task.precision,  # type: ignore[arg-type]
        tags=dict(task.tags),
        budget_bytes=meter.budget_bytes,
        headroom=config.headroom,
        max_micro_batch=m_max,
        micro_batch_cap=config.max_micro_batch,
        multiple_of=config.multiple_of,
        world_size=config.world_size,
        plan=the_plan,
        trials=result.trials,
        fit=result.fit,
        trial_count=len(result.trials),
        oom_count=result.oom_count,
        seconds=round(time.perf_counter() - started, 3),
        warnings=warnings,
        torch_version=torch.__version__,
        autotune_version=autotune.__version__,
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
        The Profile (DESIGN.md "Contracts").

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
            "use `autotune probe file.py:name --device all` or autotune.multi.probe_all_devices(spec, config)"
        )
    meter = make_meter(device, config.budget_bytes)
    try:
        return probe_with_meter(task, meter, config, on_trial=on_trial)
    finally:
        meter.close()
