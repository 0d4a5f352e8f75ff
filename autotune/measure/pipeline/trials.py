"""The trial of a pipeline at a micro-batch size: every stage's steps, one stage at a time on one meter, the answer
the most loaded stage's."""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from autotune.core.compositions import Dimensions, refuse_composition
from autotune.core.errors import AutotuneError, TaskError
from autotune.core.schemas import MemoryBreakdown, Trial
from autotune.measure.meters import MemoryReading, Meter
from autotune.measure.meters.compiled import compiles_on, graphs_compiled, static_shapes
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.offload import offload_params_to_host
from autotune.measure.pipeline.cutting import StageLayout, build_stage, meta_model, record_shapes, shard_on_meta
from autotune.measure.pipeline.replay import InterleavedReplay, Replay, hooks_removed
from autotune.measure.pipeline.schedules import pipeline_refusal
from autotune.measure.pipeline.stages import StageStrategy
from autotune.measure.strategies import Strategy
from autotune.measure.trial import (
    Span,
    breakdown_recorder,
    broken_down,
    build_on_meta,
    measured_span,
    recorder_of,
    trial_of,
)
from autotune.tasks.task import ProbeTask

# A compiled stage's replays at most, until one compiles nothing: the first graphs, a recompilation for the size, one
# for a stage whose inputs guard otherwise (PipelineTrials.measure_stage).
SETTLING_REPLAYS = 4

# One stage's measurement (the meter's reading, oom) -> the figure the search decides on, with oom.
StageFigure = Callable[[Callable[[], tuple[MemoryReading, bool]]], tuple[MemoryReading, bool]]


class PipelineTrials:
    """Trials of every stage of a pipeline at a micro-batch size, one stage at a time on one meter.

    Called with m, it measures each stage's two steps (the stage built inside the measured span, so its
    weights are counted and only one stage is alive at a time) and returns one Trial for the pipeline: the
    most loaded stage's peak (``stage_peaks[m]`` keeps every stage's), fitting when every stage fits; an OOM
    on any stage is the size's OOM.
    """

    def __init__(
        self,
        task: ProbeTask,
        meter: Meter,
        *,
        limit_bytes: int,
        stages: int,
        schedule: str,
        microbatches: int,
        virtual_stages: int = 1,
        strategy: Strategy | None = None,
        stage_figure: StageFigure | None = None,
        host_limit_bytes: int | None = None,
    ) -> None:
        refusal = pipeline_refusal(schedule, stages, microbatches, None)
        if refusal is not None:
            raise AutotuneError(refusal)
        self.task, self.meter, self.limit_bytes = task, meter, limit_bytes
        # --host-budget under --offload: a size whose most loaded rank holds more host bytes does not fit either.
        self.host_limit_bytes = host_limit_bytes
        self.stages, self.schedule, self.microbatches = stages, schedule, microbatches
        self.virtual_stages = virtual_stages if schedule == "interleaved-1f1b" else 1
        strategy = strategy or StageStrategy(1)
        if not isinstance(strategy, StageStrategy):  # autotune/measure/strategy_choice.py makes one for pp > 1
            raise AutotuneError(f"--pp {stages}: a stage is held by a stage strategy, not {type(strategy).__name__}")
        self.strategy: StageStrategy = strategy
        # The task's own compile and offload too (a task file's), not only the flags', over the stages' strategy.
        refuse_composition(
            Dimensions(
                strategy=getattr(strategy, "inner", "ddp"),
                world_size=max(stages, getattr(strategy, "world_size", stages)),
                pp=stages,
                tp=getattr(strategy, "tp", 1),
                cp=getattr(strategy, "cp", 1),
                compile=task.compile,
                offload=task.offload,
            )
        )
        # An emulated card's figure of a stage (autotune/emulation/card_search.py): the stage's allocations
        # replayed through the caching allocator; None: the meter's own reading.
        self.stage_figure = stage_figure
        self.warnings: list[str] = []
        self.stage_peaks: dict[int, list[int]] = {}
        # Under --offload: each stage's host bytes (autotune/measure/offload.py) at the size being measured.
        self.stage_host_peaks: dict[int, int] = {}
        # With a dict here, each stage's steps on a CPU or fake meter are recorded (autotune/measure/breakdown.py)
        # and the most loaded stage's peak broken down, kept by micro-batch (its stage named).
        self.breakdowns: dict[int, MemoryBreakdown] | None = None
        self.stage_breakdowns: dict[int, MemoryBreakdown | None] = {}  # the size being measured, by stage
        recorder = build_on_meta(task, self.warnings)
        if recorder is None:
            raise TaskError(
                f"--pp: model() of task {task.name!r} cannot be built on the meta device to cut it into stages"
            )
        # A meta copy of the whole model, whose forward at each size says what crosses the stages' boundaries.
        self._recorder: nn.Module = recorder
        flag = f"--pp {stages}" + (
            f" x --pp-virtual-stages {self.virtual_stages} = {stages * self.virtual_stages} stages"
            if self.virtual_stages > 1
            else ""
        )
        self.layout = StageLayout.of(task, recorder, stages * self.virtual_stages, 1, flag)

    def most_loaded(self, micro_batch: int) -> int:
        """The stage with the largest peak at micro_batch (the first of equals)."""
        peaks = self.stage_peaks[micro_batch]
        return peaks.index(max(peaks))

    def measure_stage(self, stage_index: int, micro_batch: int) -> tuple[MemoryReading, bool]:
        """(the meter's reading, oom) of one stage's two steps at micro_batch; a compiled job's as a job that trains
        at micro_batch runs them: compiled static there by a fresh compiler, where its compilation has settled.

        A graph compiled for another size first (dynamo's automatic dynamic shapes make the second size's graph
        dynamic) holds other bytes than the static one a job at one m compiles (3,968 B less at m = 2 on the tiny tp
        Llama's stage 0 after m = 1), so each size starts from a fresh compiler at its first stage (as the static
        confirmation of a compiled trial does, autotune/search/static.py), whose later stages' graphs are static
        too. And a replay's first steps compile (the blocks' graphs, a recompilation for a stage whose inputs guard
        otherwise), where dynamo's guard tensors are made, the compiler's bytes and not the job's: a replay that
        compiled is replayed again, and the one that compiled nothing is the stage's (as a compiled trial is measured
        after its warm-up)."""
        if self.task.compile is None or not compiles_on(self.meter):
            return self._recorded_stage(stage_index, micro_batch)
        if stage_index == 0:
            torch._dynamo.reset()
            gc.collect()
        with static_shapes():
            for _ in range(SETTLING_REPLAYS):
                compiled_before = graphs_compiled()
                reading, oom = self._recorded_stage(stage_index, micro_batch)
                if graphs_compiled() == compiled_before:  # an OOM's too: its figure is the settled one's
                    break
        return reading, oom

    def _recorded_stage(self, stage_index: int, micro_batch: int) -> tuple[MemoryReading, bool]:
        recorder = self._breakdown_recorder()
        with recorder.recording(self.meter) if recorder is not None else nullcontext():
            reading, oom = self._measure_stage(stage_index, micro_batch)
        if recorder is not None:
            fits = not oom and reading.peak_bytes <= self.limit_bytes
            host_peak = self.stage_host_peaks.get(stage_index)
            self.stage_breakdowns[stage_index] = broken_down(recorder, micro_batch, fits, reading.peak_bytes, host_peak)
        return reading, oom

    def _breakdown_recorder(self) -> Any:
        """A breakdown's recorder for a stage's steps where breakdowns are asked for (the trial's rule:
        autotune/measure/trial.py, breakdown_recorder); an emulated card's stage's live parts are then completed to its
        figure (:meth:`__call__`)."""
        return breakdown_recorder(self.task, self.meter) if self.breakdowns is not None else None

    def _measure_stage(self, stage_index: int, micro_batch: int) -> tuple[MemoryReading, bool]:
        shapes = record_shapes(self.task, self._recorder, self.layout, micro_batch)
        meter = self.meter
        # Rank r holds stages r, r + pp, ... (one but under interleaved 1F1B).
        indices = [stage_index + chunk * self.stages for chunk in range(self.virtual_stages)]
        metas = [meta_model(self.task) for _ in indices]
        # A sharding strategy cuts and wraps each stage on meta first, each on its own (torchtitan's model parts):
        # only its shards are ever given storage.
        not_held = [
            shard_on_meta(self.task, self.layout, index, meta, self.strategy) if self.strategy.shards else None
            for index, meta in zip(indices, metas, strict=True)
        ]
        # A compiled job's blocks run compiled where the meter runs real tensors (fake ones run eager: dynamo does not
        # trace them, autotune/measure/meters/compiled.py).
        compiled = compiles_on(meter)

        def steps() -> None:
            replays = []
            recorder = recorder_of(meter)
            for index, held in zip(indices, not_held, strict=True):
                stage = build_stage(
                    self.task, self.layout, index, meter.device, metas.pop(0), held, compile_blocks=compiled
                )
                self.strategy.stage_built(stage.model)
                # --offload params: the stage's shards and, from their reduce-scatter on, its gradients'
                # are host memory (FSDP2's CPUOffloadPolicy, applied where fsdp shards the stage).
                offload_params_to_host(stage.model, self.task.offload, meter)
                # DDP's buckets over the stage's replicas: what the mesh adds (ddp with D > 1).
                recorder.classify(getattr(stage.model, "_autotune_ddp_buckets", ()), "collectives")
                stage.flow.shapes = shapes
                replays.append(
                    Replay(
                        self.task,
                        stage,
                        self.strategy,
                        meter.device,
                        self.schedule,
                        self.microbatches,
                        micro_batch,
                        recorder,
                    )
                )
            del stage
            with hooks_removed([replay.stage for replay in replays]):
                if self.schedule == "interleaved-1f1b":
                    InterleavedReplay(replays, self.stages).run(meter)
                else:
                    replays[0].run(meter)
            del replays

        # The one envelope of a trial's measured work (autotune/measure/trial.py): the host's peak restarted with the
        # stage's, an error classified as a trial's is, a failed backward let go.
        span = measured_span(self.task, meter, micro_batch, steps, where=f" (stage {stage_index})")
        if span.host_peak_bytes is not None:
            self.stage_host_peaks[stage_index] = span.host_peak_bytes
        meter.release()
        return span.reading, span.oom

    def __call__(self, micro_batch: int) -> Trial:
        started = time.perf_counter()
        readings: list[MemoryReading] = []
        oom = False
        self.stage_breakdowns = {}
        self.stage_host_peaks = {}
        for stage_index in range(self.stages):
            if self.stage_figure is None:
                reading, oom = self.measure_stage(stage_index, micro_batch)
            else:
                reading, oom = self.stage_figure(functools.partial(self.measure_stage, stage_index, micro_batch))
                self._on_card(stage_index, reading, oom)
            readings.append(reading)
            if oom:
                break
        peaks = [reading.peak_bytes for reading in readings]
        if not oom:
            self.stage_peaks[micro_batch] = peaks
        heaviest_index = len(readings) - 1 if oom else peaks.index(max(peaks))
        heaviest = readings[heaviest_index]
        found = self.stage_breakdowns.get(heaviest_index)
        if self.breakdowns is not None and found is not None:
            self.breakdowns[micro_batch] = found.model_copy(update={"stage": heaviest_index})
        # Each rank's host bytes are its own (a stage's offloaded activations): the trial's is the most any holds.
        host_peak = max(self.stage_host_peaks.values()) if self.stage_host_peaks else None
        return trial_of(
            micro_batch,
            Span(heaviest, oom, host_peak),
            limit_bytes=self.limit_bytes,
            host_limit_bytes=self.host_limit_bytes,
            seconds=time.perf_counter() - started,
            fake=isinstance(self.meter, FakeMeter),
        )

    def _on_card(self, stage_index: int, reading: MemoryReading, oom: bool) -> None:
        """A stage's live breakdown completed to its card figure (reserved + outside the allocator: the allocator's
        reserve beyond the live peak and the memory outside it as parts of their own), or dropped where the figure
        cannot be broken down (an OOM, a reserve below the live peak)."""
        from autotune.measure.breakdown import with_card_parts

        live = self.stage_breakdowns.pop(stage_index, None)
        if live is None or oom:
            return
        outside = reading.outside_allocator_bytes or 0
        on_card = with_card_parts(
            live,
            reserved_bytes=reading.peak_bytes - outside,
            outside_bytes=outside,
            fits=reading.peak_bytes <= self.limit_bytes,
        )
        if on_card is not None:
            self.stage_breakdowns[stage_index] = on_card

    def build(self) -> float:
        return 0.0

    def close(self) -> None:
        self.meter.release()
