"""A pipeline's timed steps (the probe's throughput under ``--pp``): each stage's replay timed on the device, never
the search's trials.

One device cannot run a pipeline's stages side by side, so each stage's steps run alone, as its trial runs them
(:class:`PipelineTrials`: the stage built as the job builds it, its schedule's forwards and backwards, its optimizer
step) with the meter's accounting off and a clock on; the figures are the median over the repeats of the second
step's forward+backward seconds (the first pays warm-up) and of its optimizer step, CUDA synchronized at each mark.

The pipeline's step is then composed by its schedule's arithmetic, and says so: its K micro-batches' forwards and
backwards take ``K x t / (1 - b)``, t the slowest stage's seconds per micro-batch and b the bubble
``(pp - 1) / (V K + pp - 1)`` (autotune/core/mesh.py: the share of a step the stages idle while the pipeline fills
and drains), then the slowest stage's optimizer step. A Throughput's ``micro_batch_seconds`` for a pipeline is
``t / (1 - b)``, a micro-batch's share of the step with the bubble, so that its ``seconds_per_update`` (K of them and
the step) and its samples per second over the D replicas read as any probe's (autotune/measure/throughput.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from autotune.core.mesh import Mesh
from autotune.core.schemas import Device, MicroBatchCount, Plan, Throughput
from autotune.measure.meters import FORWARD_BACKWARD, STEP, Meter
from autotune.measure.pipeline.trials import PipelineTrials
from autotune.measure.strategies import Strategy
from autotune.tasks.task import ProbeTask

__all__ = ["StageTimes", "timed_pipeline_updates"]

# A stage's timed replays at most, however short they are (its builds are not timed, but they take time).
MAX_REPEATS = 50


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Marks:
    """What the replay tells its recorder, heard as the start of each step ("inputs")."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def phase(self, name: str) -> None:
        if name == "inputs":
            self.clock.mark("start")

    def classify_model(self, model: Any) -> None:
        pass

    def classify_gradients(self, model: Any) -> None:
        pass

    def classify_optimizer(self, optimizer: Any) -> None:
        pass

    def classify(self, tensors: Any, part: str) -> None:
        pass


class _Clock(Meter):
    """A meter of time, not memory, on the probe's device: no accounting and no budget; each step's start (the
    replay's "inputs" phase) and its checkpoints (forward+backward, step) marked, the device synchronized first."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.budget_bytes = 1 << 62
        self.marks: list[tuple[str, float]] = []
        self.recorder = _Marks(self)

    def describe(self) -> Device:
        raise NotImplementedError("a clock describes no device")

    def _take_peak(self) -> tuple[int, int | None]:
        return 0, None

    def _tracking(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def mark(self, name: str) -> None:
        _synchronize(self.device)
        self.marks.append((name, time.perf_counter()))

    def checkpoint(self, phase: str) -> None:
        super().checkpoint(phase)
        if phase in (FORWARD_BACKWARD, STEP):
            self.mark(phase)

    def last_step(self) -> tuple[float, float]:
        """(forward+backward seconds, optimizer step seconds) of the last whole step marked."""
        names = [name for name, _ in self.marks]
        end = len(names) - 1 - names[::-1].index(STEP)
        if end < 2 or names[end - 1] != FORWARD_BACKWARD or names[end - 2] != "start":
            raise RuntimeError(f"the replay's marks are not start, forward_backward, step: {names}")
        start, forward_backward, step = (at for _, at in self.marks[end - 2 : end + 1])
        return forward_backward - start, step - forward_backward


@dataclass(frozen=True)
class StageTimes:
    """A pipeline's timed stages at one size: each stage's median seconds of one step's forwards and backwards (its
    K micro-batches) and of its optimizer step, over ``repeats`` replays."""

    forward_backward_seconds: list[float]
    step_seconds: list[float]
    microbatches: int
    repeats: int

    def micro_batch_seconds(self, mesh: Mesh, microbatches: int) -> float:
        """One micro-batch's share of a step of ``microbatches`` (K) micro-batches, the bubble included: the slowest
        stage's seconds per micro-batch over (1 - bubble)."""
        slowest = max(self.forward_backward_seconds) / self.microbatches
        return slowest / (1.0 - mesh.bubble_fraction(microbatches))


@contextmanager
def _timing(trials: PipelineTrials) -> Iterator[_Clock]:
    clock = _Clock(trials.meter.device)
    measuring = trials.meter
    trials.meter = clock
    try:
        yield clock
    finally:
        trials.meter = measuring
        measuring.release()


def time_stages(trials: PipelineTrials, micro_batch: int, *, repeats: int, min_seconds: float) -> StageTimes | None:
    """Every stage of ``trials`` timed at micro_batch (see the module docstring); None where a stage ran out of
    memory (the caller says so)."""
    forward_backward: list[list[float]] = [[] for _ in range(trials.stages)]
    steps: list[list[float]] = [[] for _ in range(trials.stages)]
    with _timing(trials) as clock:
        for stage in range(trials.stages):
            trials.measure_stage(stage, micro_batch)  # warm-up: a first build and replay, off the figures
            started = time.perf_counter()
            while len(steps[stage]) < repeats or (
                time.perf_counter() - started < min_seconds and len(steps[stage]) < MAX_REPEATS
            ):
                clock.marks.clear()
                _, oom = trials.measure_stage(stage, micro_batch)
                if oom:
                    return None
                seconds = clock.last_step()
                forward_backward[stage].append(seconds[0])
                steps[stage].append(seconds[1])
    return StageTimes(
        forward_backward_seconds=[statistics.median(s) for s in forward_backward],
        step_seconds=[statistics.median(s) for s in steps],
        microbatches=trials.microbatches,
        repeats=min(len(s) for s in steps),
    )


def _throughput(times: StageTimes, mesh: Mesh, micro_batch: int, microbatches: int, replicas: int) -> Throughput:
    per_micro_batch = times.micro_batch_seconds(mesh, microbatches)
    step = max(times.step_seconds)
    seconds = microbatches * per_micro_batch + step
    update: list[MicroBatchCount] = [(micro_batch, microbatches)]
    return Throughput(
        micro_batch=micro_batch,
        samples_per_second=round(replicas * micro_batch * microbatches / seconds, 4),
        seconds_per_update=round(seconds, 7),
        micro_batches=update,
        world_size=replicas,
        micro_batch_seconds=[(micro_batch, round(per_micro_batch, 7))],
        step_seconds=round(step, 7),
        repeats=times.repeats,
    )


def timed_pipeline_updates(
    task: ProbeTask,
    meter: Meter,
    strategy: Strategy,
    mesh: Mesh,
    *,
    max_micro_batch: int,
    plan: Plan | None,
    replicas: int,
    repeats: int,
    min_seconds: float,
    warnings: list[str] | None = None,
) -> list[Throughput] | None:
    """A pipeline profile's timed runs: an update of K micro-batches of m_max (K the one its stages were measured at),
    and the plan's (its m and K) where it differs. None (with a warning) where a stage ran out of memory. Inside the
    strategy's process group (the probe's, entered around its search and its timing)."""
    microbatches = mesh.pp_microbatches or mesh.pp
    trials = PipelineTrials(
        task,
        meter,
        limit_bytes=meter.budget_bytes,
        stages=mesh.pp,
        schedule=mesh.pp_schedule,
        microbatches=microbatches,
        virtual_stages=mesh.virtual_stages,
        strategy=strategy,
    )
    updates: list[tuple[int, int]] = [(max_micro_batch, microbatches)]
    if plan is not None and (plan.micro_batch, plan.accumulation_steps) != updates[0]:
        updates.append((plan.micro_batch, plan.accumulation_steps))
    timed: dict[int, StageTimes] = {}
    try:
        with strategy.process_group(meter.device):
            for size in sorted({size for size, _ in updates}, reverse=True):
                found = time_stages(trials, size, repeats=repeats, min_seconds=min_seconds)
                if found is None:
                    if warnings is not None:
                        warnings.append(f"the timed run at micro-batch {size} ran out of memory: throughput not timed")
                    return None
                timed[size] = found
    finally:
        trials.close()
    return [_throughput(timed[size], mesh, size, k, replicas) for size, k in updates]

