"""A pipeline's search on an emulated card (``--gpu NAME --pp N``), in the emulated child: each stage's fake trial
(autotune/measure/pipeline/: the stage built alone, its schedule's forwards and backwards replayed) recorded
allocation by allocation and replayed through the caching allocator's model, as a card's trial of a whole model is
(autotune/search/reserved.py). A stage is one rank: its figure is its own reserved bytes, with the cuBLAS
workspaces and the memory outside the allocator of its own card. The answer is the most loaded stage's m_max; the
result says each stage's figure at m_max and the bubble (``pipeline``, as ``autotune estimate --pp`` on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autotune.core.allocator import AllocatorConfig, replay
from autotune.core.schemas import MemoryBreakdown, Trial
from autotune.measure.meters import MemoryReading
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.pipeline import StageFigure
from autotune.search.reserved import renumbered

__all__ = ["pipeline_search_on_card", "replayed_stage"]


def replayed_stage(
    meter: FakeMeter, *, workspace_bytes: Sequence[int], budget_bytes: int, outside_bytes: int, alloc_conf: str | None
) -> StageFigure:
    """A stage's figure on the card: its events replayed through the allocator (reserved + outside bytes); an OOM
    where its live bytes or the replay cross the card's memory."""
    config = AllocatorConfig.parse(alloc_conf)
    # Each rank's workspaces come first: made at its thread's first matmul, before the stage's peak.
    workspaces = [(-(i + 1), int(n)) for i, n in enumerate(workspace_bytes)]

    def figure(measure: Callable[[], tuple[MemoryReading, bool]]) -> tuple[MemoryReading, bool]:
        meter.release()
        with meter.record_events() as recorded:
            reading, oom = measure()
        if oom:
            return reading, True
        held, events, streams = renumbered(recorded.held, recorded.events, recorded.streams)
        trace = [*workspaces, *held, *((k, n) for k, n in events if k != 0)]
        peaks = replay(trace, config, budget_bytes - outside_bytes, streams=streams)
        if peaks.oom:
            return MemoryReading(peak_bytes=budget_bytes + 1), True
        return (
            MemoryReading(
                peak_bytes=peaks.peak_reserved_bytes + outside_bytes,
                forward_backward_bytes=reading.forward_backward_bytes,
                step_bytes=reading.step_bytes,
                allocated_bytes=peaks.peak_allocated_bytes,
                outside_allocator_bytes=outside_bytes,
            ),
            False,
        )

    return figure


def pipeline_search_on_card(task: Any, request: dict[str, Any], device_name: str) -> dict[str, Any]:
    """One length's pipeline search in the child (``task`` at its length): what child_search returns per length,
    with ``pipeline`` (PipelineStages as JSON) where a size fit."""
    from autotune.core.setup import JobSetup
    from autotune.measure.strategy_choice import make_strategy
    from autotune.search.boundary import NoFitError
    from autotune.search.pipelined import search_pipeline

    job = JobSetup.model_validate(request["setup"])
    mesh = job.mesh
    budget_bytes = int(request["budget_bytes"])
    meter = FakeMeter(budget_bytes, "cuda", device_name)
    figure = replayed_stage(
        meter,
        workspace_bytes=[int(n) for n in request["workspace_bytes"]],
        budget_bytes=budget_bytes,
        outside_bytes=int(request["outside_bytes"]),
        alloc_conf=request.get("alloc_conf"),
    )
    trials: dict[int, Trial] = {}
    warnings: list[str] = []
    # With breakdown: each size's most loaded stage broken down on the card (its live parts, the allocator's reserve
    # and the memory outside it).
    breakdowns: dict[int, MemoryBreakdown] | None = {} if request.get("breakdown") else None
    found: dict[str, Any] = {"seq_len": task.seq_len, "max_micro_batch": 0, "fit": None, "no_fit": False}
    try:
        result = search_pipeline(
            task,
            meter,
            mesh,
            make_strategy(job.strategy, job.world_size, mesh),
            int(request["limit_bytes"]),
            warnings,
            lambda trial: trials.__setitem__(trial.micro_batch, trial.model_copy(update={"fake": True})),
            max_micro_batch=int(request["max_micro_batch"]),
            multiple_of=int(request["multiple_of"]),
            stage_figure=figure,
            far_extrapolation=1e9,  # fake trials: an overshoot costs no device
            extra_sizes=[int(m) for m in request.get("extra_sizes") or ()],
            breakdowns=breakdowns,
        )
        found["max_micro_batch"] = result.max_micro_batch
        # The profile keeps m_max's and the next size's (autotune/orchestrate/breakdowns.py).
        multiple_of = int(request["multiple_of"])
        found["breakdowns"] = [
            breakdowns[m].model_dump(mode="json")
            for m in (result.max_micro_batch, result.max_micro_batch + multiple_of)
            if breakdowns is not None and m in breakdowns
        ]
        found["fit"] = result.fit.model_dump(mode="json") if result.fit is not None else None
        found["pipeline"] = result.pipeline.model_dump(mode="json") if result.pipeline is not None else None
        if request.get("predict"):  # each stage's recorded step at m_max and the plan's sizes (card_steps.py)
            from autotune.emulation.card_steps import record_stage_steps, sizes_to_record

            sizes = sizes_to_record(job, result.max_micro_batch, request["predict"], multiple_of)
            found["steps"] = record_stage_steps(task, job, meter, sizes, budget_bytes)
    except NoFitError:
        found["no_fit"] = True
    warnings.extend(sorted(meter.unmodelled))
    found["trials"] = [t.model_dump(mode="json") for t in trials.values()]
    found["warnings"] = warnings
    return found
