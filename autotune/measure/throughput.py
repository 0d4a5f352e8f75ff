"""Timed runs: samples per second at a policy's m_max and at its plan's sizes, on the real device.

Time never comes from the search's trials: a trial's first micro-batches pay warm-up (allocator
growth, kernel selection, lazily created optimizer state) and it runs under the meter's accounting.
A timed run builds the model as a trial does (the policy applied, wrapped by the strategy), runs one
warm-up update touching every size, then repeats updates of one micro-batch of each size followed
by the optimizer step, each part timed on its own (CUDA synchronized around it), until every size
has ``repeats`` timings and the run has taken ``min_seconds`` (fast GPU steps need many to time).
Medians per size and for the step give the seconds of any update of those sizes
(autotune/core/recommend.py); batches are made before the clock starts, as a DataLoader would have them
ready. The meter's accounting is off while timing, so the figures are the model's own speed.

A compiled task (``task.compile``) is timed compiled, as the job runs: the model compiled in the task's mode (under
``budget:R``, at that activation memory budget), each size with a static graph of its own
(``compiled.static_shapes``: a job at one m compiles one), the compilations in the warm-up, off the clock.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune.core.schemas import MicroBatchCount, Plan, Throughput
from autotune.measure.meters import Meter
from autotune.measure.meters.compiled import CompiledCpuMeter, compiled_for, compiles_on, static_shapes
from autotune.measure.oom import is_oom
from autotune.measure.strategies import Strategy
from autotune.measure.trial import build_model, build_on_meta, make_batch
from autotune.tasks.task import ProbeTask

__all__ = [
    "DEFAULT_MIN_SECONDS",
    "DEFAULT_REPEATS",
    "MAX_REPEATS",
    "Timings",
    "throughput_of",
    "time_sizes",
    "timed_updates",
]

DEFAULT_REPEATS = 3
DEFAULT_MIN_SECONDS = 1.0
MAX_REPEATS = 200


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Clock = Callable[[], float]


def _forward_backward(
    task: ProbeTask,
    strategy: Strategy,
    model: nn.Module,
    scaler: Any,
    size: int,
    device: torch.device,
    last: bool,
    clock: Clock = time.perf_counter,
) -> float:
    batch = make_batch(task, size, device)  # ready before the clock starts, as a DataLoader has it
    _synchronize(device)
    started = clock()
    with strategy.sync(model, last=last), strategy.loss_context():
        with strategy.autocast(task.precision, device):
            loss = task.compute_loss(model, batch)
        (scaler.scale(loss) if scaler is not None else loss).backward()
    _synchronize(device)
    return clock() - started


def _step(
    optimizer: torch.optim.Optimizer, scaler: Any, device: torch.device, clock: Clock = time.perf_counter
) -> float:
    _synchronize(device)
    started = clock()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _synchronize(device)
    return clock() - started


def _timed(
    task: ProbeTask,
    meter: Meter,
    strategy: Strategy,
    wanted: list[int],
    repeats: int,
    min_seconds: float,
    clock: Clock,
) -> tuple[dict[int, list[float]], list[float]]:
    """The timings; the model, optimizer and batches die with this frame."""
    device = meter.device
    model = strategy.wrap(build_model(task, meter, build_on_meta(task)), task, device)
    if task.compile is not None and compiles_on(meter):  # timed as the job runs it: compiled (module docstring)
        torch._dynamo.reset()  # a fresh compiler, as the job's process has
        model = compiled_for(task, model)
    optimizer = task.make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler(device.type) if task.precision == "fp16" else None
    per_size: dict[int, list[float]] = {size: [] for size in wanted}
    steps: list[float] = []
    for index, size in enumerate(wanted):  # warm-up: every size once, and a step
        _forward_backward(task, strategy, model, scaler, size, device, index == len(wanted) - 1, clock)
    _step(optimizer, scaler, device, clock)
    started = time.perf_counter()
    while len(steps) < MAX_REPEATS and (len(steps) < repeats or time.perf_counter() - started < min_seconds):
        for index, size in enumerate(wanted):
            last = index == len(wanted) - 1
            per_size[size].append(_forward_backward(task, strategy, model, scaler, size, device, last, clock))
        steps.append(_step(optimizer, scaler, device, clock))
    return per_size, steps


@dataclass(frozen=True)
class Timings:
    """What a timed run measured: the seconds of each repeat, per size and for the step (repeat r
    of every size and step r make up update r)."""

    per_size: dict[int, list[float]]
    steps: list[float]

    @property
    def repeats(self) -> int:
        return len(self.steps)

    def median(self, size: int) -> float:
        return statistics.median(self.per_size[size])

    @property
    def step_median(self) -> float:
        return statistics.median(self.steps)

    def update_seconds(self, micro_batches: Sequence[MicroBatchCount]) -> list[float]:
        """The seconds of an update of ``micro_batches`` in each repeat (its spread over the repeats)."""
        return [
            sum(count * self.per_size[size][r] for size, count in micro_batches) + self.steps[r]
            for r in range(self.repeats)
        ]


def time_sizes(
    task: ProbeTask,
    meter: Meter,
    strategy: Strategy,
    sizes: Sequence[int],
    *,
    repeats: int = DEFAULT_REPEATS,
    min_seconds: float = DEFAULT_MIN_SECONDS,
    clock: Clock = time.perf_counter,
) -> Timings:
    """The seconds of one forward+backward at each size and of the optimizer step, per repeat.

    Enters ``strategy.process_group`` itself; the meter gives the device and builds the model (its
    accounting is off while the clock runs). ``clock`` is wall time; a benchmark on a shared CPU may
    pass ``time.process_time`` (this process's CPU seconds: with one torch thread, the model's own
    cost whatever else runs). Raises what the run raises (an OOM included: the caller decides).
    """
    wanted = sorted(set(sizes), reverse=True)
    # The compiled meter counts what its hold spans leave (the timed model's build) into every later trial's base:
    # the timed model is gone after the run, so its bytes leave the base.
    base_bytes = meter.live_bytes if isinstance(meter, CompiledCpuMeter) else None
    base_blocks = meter.held_blocks if isinstance(meter, CompiledCpuMeter) else {}
    shapes = static_shapes() if task.compile is not None else contextlib.nullcontext()
    with strategy.process_group(meter.device), shapes:
        try:
            per_size, steps = _timed(task, meter, strategy, wanted, repeats, min_seconds, clock)
        finally:
            gc.collect()
            meter.release()
            if isinstance(meter, CompiledCpuMeter) and base_bytes is not None:
                timed_blocks = {a: n for a, n in meter.held_blocks.items() if base_blocks.get(a) != n}
                meter.forget(meter.live_bytes - base_bytes, timed_blocks)
    return Timings(per_size=per_size, steps=steps)


def timed_updates(
    task: ProbeTask,
    meter: Meter,
    strategy: Strategy,
    *,
    max_micro_batch: int,
    plan: Plan | None,
    world_size: int,
    repeats: int = DEFAULT_REPEATS,
    min_seconds: float = DEFAULT_MIN_SECONDS,
    warnings: list[str] | None = None,
) -> list[Throughput] | None:
    """The profile's timed runs: one micro-batch of m_max per update, and the plan's update when it
    differs. None (with a warning) where the run ran out of memory.

    Example:
        ``timed_updates(task, meter, strategy, max_micro_batch=26, plan=plan(26, 256), world_size=1)``
        times sizes 26 and 25 and gives two Throughputs: 1 x 26 per update, and 6 x 26 + 4 x 25.
    """
    updates: list[list[MicroBatchCount]] = [[(max_micro_batch, 1)]]
    if plan is not None and list(plan.micro_batches) != updates[0]:
        updates.append(list(plan.micro_batches))
    sizes = sorted({size for update in updates for size, _ in update})
    try:
        timings = time_sizes(task, meter, strategy, sizes, repeats=repeats, min_seconds=min_seconds)
    except Exception as exc:
        if not is_oom(exc):
            raise
        if warnings is not None:
            warnings.append(f"the timed run at micro-batch {max(sizes)} ran out of memory: throughput not timed")
        return None
    return [throughput_of(timings, update, world_size) for update in updates]


def throughput_of(timings: Timings, update: Sequence[MicroBatchCount], world_size: int = 1) -> Throughput:
    """The Throughput of updates of ``update`` (per replica) from a timed run that timed its sizes."""
    seconds = sum(count * timings.median(size) for size, count in update) + timings.step_median
    return Throughput(
        micro_batch=max(size for size, _ in update),
        samples_per_second=round(world_size * sum(size * count for size, count in update) / seconds, 4),
        seconds_per_update=round(seconds, 7),
        micro_batches=list(update),
        world_size=world_size,
        micro_batch_seconds=[(size, round(timings.median(size), 7)) for size, _ in update],
        step_seconds=round(timings.step_median, 7),
        repeats=timings.repeats,
    )
