"""An emulated estimate's predicted throughput: the recorded fake steps (autotune/emulation/card_steps.py) priced on
the card and its fabric (autotune/core/step_time.py), one Throughput per update the profile lists (one micro-batch of
m_max, and the plan's update where it differs), each saying it is a prediction.

Where a figure the prediction needs is missing (a card the catalog has no peaks for, a group over nodes without the
network's figure), the estimate still answers memory and says in one line which figure is missing and the flag that
gives it: no throughput is guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autotune.core.cards import Card
from autotune.core.mesh import Mesh
from autotune.core.schemas import Plan, PredictedParts, Throughput
from autotune.core.step_records import StepRecord
from autotune.core.step_time import FigureOverrides, Figures, UpdateTime, predict_update, resolve_figures

__all__ = ["PREDICTED_NOTE", "predicted_throughput"]

# The first words of the datasheet's line on a prediction (a warning of the profile).
PREDICTED_NOTE = "predicted step time: "


def _missing_line(what: str) -> str:
    return f"no predicted step time: {what}; the memory figures stand"


def predicted_throughput(
    steps: Sequence[dict[str, Any]],
    card: Card,
    *,
    precision: str,
    world_size: int,
    mesh: Mesh,
    max_micro_batch: int,
    plan: Plan | None,
    overrides: FigureOverrides,
    warnings: list[str],
) -> list[Throughput] | None:
    """The predicted Throughputs of an estimate on card, or None with a line in warnings saying why (a figure
    missing, or no step recorded)."""
    if not steps:
        return None
    # Each pipeline stage's records apart (None: the rank of a job without one); the slowest stage sets the pace.
    stages: dict[int | None, dict[int, StepRecord]] = {}
    for record in (StepRecord.model_validate(raw) for raw in steps):
        stages.setdefault(record.stage, {})[record.micro_batch] = record
    figures = resolve_figures(
        card.short_name,
        card.performance,
        sm_count=card.sm_count,
        capability_major=card.compute_capability[0],
        precision=precision,
        overrides=overrides,
    )
    if figures.missing is not None:
        warnings.append(_missing_line(figures.missing))
        return None
    # One micro-batch of m_max (a pipeline's K of them, at the K its stages were measured at), and the plan's update.
    first = [(max_micro_batch, (mesh.pp_microbatches or mesh.pp) if mesh.pp > 1 else 1)]
    planned = [(int(size), int(count)) for size, count in plan.micro_batches] if plan is not None else first
    updates = [first] if planned == first else [first, planned]
    updates = [u for u in updates if all(size in records for records in stages.values() for size, _ in u)]
    replicas = mesh.data_parallel(world_size)
    priced: list[tuple[list[tuple[int, int]], UpdateTime, dict[int, StepRecord]]] = []
    for update in updates:
        try:
            slowest = max(
                ((_priced(records, update, figures, mesh), records) for records in stages.values()),
                key=lambda pair: pair[0].seconds,
            )
        except KeyError as exc:
            warnings.append(_missing_line(_missing_figure(str(exc.args[0]), card, overrides)))
            return None
        priced.append((update, *slowest))
    if not priced:
        return None
    made = [_throughput(records, update, time, replicas, world_size, figures) for update, time, records in priced]
    warnings.append(_note(priced[-1][1], made[-1], card, figures, overrides))
    return made


def _priced(records: dict[int, StepRecord], update: list[tuple[int, int]], figures: Figures, mesh: Mesh) -> UpdateTime:
    assert figures.speed is not None and figures.fabric is not None
    return predict_update(
        records, update, figures.speed, figures.fabric, pipeline_stages=mesh.pp, virtual_stages=mesh.virtual_stages
    )


def _missing_figure(key: str, card: Card, overrides: FigureOverrides) -> str:
    if key == "network":
        return (
            f"a group of the mesh spans nodes of {overrides.gpus_per_node or 8} GPUs and the network between them is "
            f"not known for a {card.short_name} (give --network-gbits-per-s, or --gpus-per-node)"
        )
    return (
        f"the {card.short_name} has no dense {key} peak on its data sheet, which the step's {key} kernels need "
        "(give --peak-tflops for the job's precision)"
    )


def _throughput(
    records: dict[int, StepRecord],
    update: list[tuple[int, int]],
    time: UpdateTime,
    replicas: int,
    world_size: int,
    figures: Figures,
) -> Throughput:
    samples = replicas * sum(size * count for size, count in update)
    per_second = samples / time.seconds
    last = records[update[-1][0]]
    tokens = None
    mfu = None
    if last.tokens_per_sample:
        tokens = per_second * last.tokens_per_sample / world_size
        if last.flops_per_token and figures.peak_flops:
            mfu = round(last.flops_per_token * tokens / figures.peak_flops, 4)
    return Throughput(
        micro_batch=max(size for size, _ in update),
        samples_per_second=round(per_second, 4),
        seconds_per_update=round(time.seconds, 7),
        micro_batches=update,
        world_size=replicas,
        micro_batch_seconds=[(size, round(time.micro_batch_seconds[size], 7)) for size, _ in update],
        step_seconds=round(time.optimizer_seconds, 7),
        predicted=True,
        per_update_seconds=round(time.per_update_seconds, 7),
        tokens_per_second_per_gpu=None if tokens is None else round(tokens, 2),
        mfu=mfu,
        parts=PredictedParts(
            compute_seconds=round(time.compute_seconds, 7),
            exposed_communication_seconds=round(time.exposed_communication_seconds, 7),
            bubble_seconds=round(time.bubble_seconds, 7),
            optimizer_seconds=round(time.optimizer_seconds, 7),
            recompute_seconds=round(time.recompute_seconds, 7),
        ),
    )


def _note(time: UpdateTime, made: Throughput, card: Card, figures: Figures, overrides: FigureOverrides) -> str:
    """The datasheet's line on where the prediction comes from."""
    given = overrides.flags()
    source = f"the {card.short_name}'s figures ({card.performance.source if card.performance else 'given'})"
    if given:
        source += f", with {', '.join(given)}"
    assumed = [*([card.performance.assumed] if card.performance and card.performance.assumed else []),
               *figures.assumed]  # fmt: skip
    host = ""
    if time.host_bound_seconds > 0.05 * time.compute_seconds:
        host = (
            f"; {time.host_bound_seconds:.3g} s of compute is the host's dispatch of small kernels (assumed 8 us an op)"
        )
    return (
        f"{PREDICTED_NOTE}each operator of the recorded fake step against {source}, each collective by NCCL's model, "
        f"with the overlap the strategy allows (autotune/core/step_time.py); a prediction, not a measurement"
        + (f"; assumed: {'; '.join(assumed)}" if assumed else "")
        + host
    )
