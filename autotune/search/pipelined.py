"""The search of a pipeline-parallel job (``--pp N``): the boundary search over every stage's trial
(autotune/measure/pipeline/), the answer the most loaded stage's, and what the datasheet says of each stage.

Used by the probe and the CPU-semantics estimate (autotune/orchestrate/pipelined.py) and, with each stage's trial
replayed through the caching allocator, by an emulated card's child (autotune/emulation/card_pipeline.py): it takes
the mesh and the search's bounds, not a ProbeConfig, so that the emulated floor can run it. K is
``--pp-microbatches``, or pp where it is not given (the least 1F1B runs; the plan may choose any K up to the one
measured, since a stage's peak grows with K).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autotune.core.mesh import Mesh
from autotune.core.schemas import MemoryBreakdown, PipelineStages, Trial
from autotune.core.units import format_bytes
from autotune.measure.meters import Meter
from autotune.measure.pipeline import PipelineTrials, StageFigure
from autotune.measure.runners import job_trials, measured_microbatches
from autotune.measure.strategies import Strategy
from autotune.search.boundary import FAR_EXTRAPOLATION, SearchResult, find_max_micro_batch, reported
from autotune.tasks.task import ProbeTask

__all__ = ["PipelineSearch", "measured_microbatches", "pipeline_trials", "search_pipeline"]


@dataclass
class PipelineSearch(SearchResult):
    """The search's result with what the profile says of the stages (None when no size fit)."""

    pipeline: PipelineStages | None = None


def _blocks_text(blocks: range) -> str:
    return str(blocks.start) if len(blocks) == 1 else f"{blocks.start}-{blocks.stop - 1}"


def pipeline_trials(
    task: ProbeTask,
    meter: Meter,
    mesh: Mesh,
    strategy: Strategy,
    limit_bytes: int,
    *,
    stage_figure: StageFigure | None = None,
    host_limit_bytes: int | None = None,
) -> PipelineTrials:
    """The trial of a pipeline of ``mesh`` at m (every stage's, the most loaded stage's peak), at the K its stages are
    measured at: the job's trials (autotune/measure/runners.py) of a pipeline."""
    trials = job_trials(
        task,
        meter,
        strategy,
        mesh,
        limit_bytes=limit_bytes,
        stage_figure=stage_figure,
        host_limit_bytes=host_limit_bytes,
    )
    assert isinstance(trials, PipelineTrials), "a pipeline's mesh has pp > 1"
    return trials


def search_pipeline(
    task: ProbeTask,
    meter: Meter,
    mesh: Mesh,
    strategy: Strategy,
    limit_bytes: int,
    warnings: list[str],
    on_trial: Callable[[Trial], None] | None,
    *,
    max_micro_batch: int,
    multiple_of: int,
    stage_figure: StageFigure | None = None,
    far_extrapolation: float = FAR_EXTRAPOLATION,
    extra_sizes: Sequence[int] = (),
    breakdowns: dict[int, MemoryBreakdown] | None = None,
    host_limit_bytes: int | None = None,
) -> PipelineSearch:
    """m_max of the pipeline: the largest m at which every stage fits, by the boundary search over
    :class:`PipelineTrials`, with each stage's peak at m_max, the most loaded stage and the bubble (also a
    line of the warnings, for the datasheet). ``extra_sizes`` (``--micro-batches``): sizes tried besides the
    search's, their trials with the others. ``breakdowns``: a dict each size's most loaded stage's peak, broken
    down, is put in (autotune/measure/breakdown.py; on a CPU or fake meter). ``host_limit_bytes`` (``--host-budget``
    under ``--offload``): a size whose stages hold more host bytes does not fit either."""
    k = measured_microbatches(mesh)
    trials = pipeline_trials(
        task, meter, mesh, strategy, limit_bytes, stage_figure=stage_figure, host_limit_bytes=host_limit_bytes
    )
    trials.breakdowns = breakdowns

    trial = reported(trials, on_trial)

    try:
        # A sharded stage's process group: the probe has entered it around its search already; the estimate and an
        # emulated card's child enter it here (a ddp stage's is none).
        with strategy.process_group(meter.device):
            result = find_max_micro_batch(
                trial,
                limit_bytes=limit_bytes,
                max_micro_batch=max_micro_batch,
                multiple_of=multiple_of,
                far_extrapolation=far_extrapolation,
            )
            tried = {t.micro_batch for t in result.trials}
            result.trials.extend(trial(int(m)) for m in extra_sizes if int(m) not in tried)
    finally:
        trials.close()
        warnings.extend(w for w in trials.warnings if w not in warnings)
    peaks = trials.stage_peaks.get(result.max_micro_batch)
    if peaks is not None:
        heaviest = trials.most_loaded(result.max_micro_batch)
        ranges = trials.layout.ranges  # rank i holds stages i, i + pp, ... (one but under interleaved 1F1B)
        held = [", ".join(_blocks_text(ranges[s]) for s in range(i, len(ranges), mesh.pp)) for i in range(mesh.pp)]
        stages = ", ".join(f"stage {i} (blocks {held[i]}) {format_bytes(p)}" for i, p in enumerate(peaks))
        warnings.append(
            f"pipeline {mesh.describe()}, at K = {k}: each stage's peak at m = {result.max_micro_batch}: "
            f"{stages}; the most loaded is stage {heaviest}, whose m_max is the answer; bubble "
            f"{'(pp - 1) / (V K + pp - 1)' if mesh.virtual_stages > 1 else '(pp - 1) / (K + pp - 1)'} "
            f"= {mesh.bubble_fraction(k):.3f}"
        )
        stages_said = PipelineStages(
            microbatches=k,
            stage_peak_bytes=peaks,
            most_loaded_stage=heaviest,
            bubble_fraction=mesh.bubble_fraction(k),
        )
    else:
        stages_said = None
    return PipelineSearch(result.max_micro_batch, result.trials, result.fit, pipeline=stages_said)
