"""Which trial runs a job: the one place that asks whether it is a pipeline (docs/design.md, "One job setup").

A pipeline's trial at a size is every stage's steps, each replaying its schedule on a model of its own
(:class:`~autotune.measure.pipeline.PipelineTrials`), the most loaded stage's figure the trial's; any other job's is
the whole model's steps (:class:`~autotune.measure.trial.TrialRunner`). Both are called with m and give a Trial, keep
their warnings and (given a dict) their breakdowns, and close; both run inside the strategy's process group, which the
caller enters, and both measure through the one envelope of a trial's work (``trial.measured_span``).
"""

from __future__ import annotations

from typing import Protocol

from autotune.core.mesh import Mesh
from autotune.core.schemas import MemoryBreakdown, Trial
from autotune.measure.meters import Meter
from autotune.measure.pipeline import PipelineTrials, StageFigure
from autotune.measure.strategies import Strategy
from autotune.measure.trial import TrialRunner
from autotune.tasks.task import ProbeTask

__all__ = ["JobTrials", "job_trials", "measured_microbatches"]


class JobTrials(Protocol):
    """What a job's trials give, whatever runs them."""

    warnings: list[str]
    breakdowns: dict[int, MemoryBreakdown] | None

    def __call__(self, micro_batch: int) -> Trial: ...

    def build(self) -> float: ...

    def close(self) -> None: ...


def measured_microbatches(mesh: Mesh) -> int:
    """K a pipeline's stages are measured at: ``--pp-microbatches``, else pp (the least 1F1B runs; the plan may choose
    any K up to it, since a stage's peak grows with K)."""
    return mesh.pp_microbatches or mesh.pp


def job_trials(
    task: ProbeTask,
    meter: Meter,
    strategy: Strategy,
    mesh: Mesh,
    *,
    limit_bytes: int,
    host_limit_bytes: int | None = None,
    reuse_model: bool = True,
    stage_figure: StageFigure | None = None,
) -> TrialRunner | PipelineTrials:
    """The trials of the job ``mesh`` lays out: a pipeline's stages (pp > 1, the schedule's K; ``stage_figure``: an
    emulated card's figure of a stage), else the whole model's steps (``reuse_model``: one model for every trial).

    Raises:
        AutotuneError: a pipeline whose schedule or stages cannot be measured (the line says why)."""
    if mesh.pp > 1:
        return PipelineTrials(
            task,
            meter,
            limit_bytes=limit_bytes,
            stages=mesh.pp,
            schedule=mesh.pp_schedule,
            microbatches=measured_microbatches(mesh),
            virtual_stages=mesh.virtual_stages,
            strategy=strategy,
            stage_figure=stage_figure,
            host_limit_bytes=host_limit_bytes,
        )
    return TrialRunner(
        task,
        meter,
        limit_bytes=limit_bytes,
        strategy=strategy,
        reuse_model=reuse_model,
        host_limit_bytes=host_limit_bytes,
    )
