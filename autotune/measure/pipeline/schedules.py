"""A pipeline's schedules on one rank: which blocks each stage holds, the order of its forwards and backwards
(1F1B, GPipe, interleaved 1F1B), and the schedules measured (autotune/measure/pipeline/__init__.py says how)."""

from __future__ import annotations

from typing import Literal

from autotune.core.errors import AutotuneError

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")

# ("F", micro-batch) or ("B", micro-batch).
Action = tuple[Literal["F", "B"], int]


def stage_block_ranges(blocks: int, stages: int) -> list[range]:
    """The blocks of each stage: contiguous runs, the first ``blocks % stages`` stages one more
    (``torch.tensor_split``'s cut).

    >>> stage_block_ranges(5, 2)
    [range(0, 3), range(3, 5)]
    """
    base, extra = divmod(blocks, stages)
    ranges, start = [], 0
    for stage in range(stages):
        count = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


def schedule_actions(schedule: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    """The order of one step's forwards and backwards on stage ``stage`` of ``stages``.

    >>> schedule_actions("1f1b", 0, 2, 4)
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('F', 3), ('B', 2), ('B', 3)]
    >>> schedule_actions("1f1b", 1, 2, 3)
    [('F', 0), ('B', 0), ('F', 1), ('B', 1), ('F', 2), ('B', 2)]
    >>> schedule_actions("gpipe", 1, 2, 2)
    [('F', 0), ('F', 1), ('B', 0), ('B', 1)]
    """
    k = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(k)] + [("B", i) for i in range(k)]
    if schedule != "1f1b":
        raise AutotuneError(f"--pp-schedule {schedule} has no single-stage order (measured: 1f1b, gpipe)")
    warmup = min(k, stages - stage)
    actions: list[Action] = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < k:
        actions.append(("B", backward))
        backward += 1
        if forward < k:
            actions.append(("F", forward))
            forward += 1
    return actions


def interleaved_actions(rank: int, ranks: int, microbatches: int, virtual: int) -> list[tuple[str, int, int]]:
    """The order of one step's forwards and backwards on pipeline rank ``rank`` under interleaved 1F1B with
    ``virtual`` stages per rank (rank r holds stages r, r + ranks, ...): (kind, local chunk, micro-batch).

    ScheduleInterleaved1F1B's own rule (Narayanan et al. 2021, relaxed to K not a multiple of pp): rounds of
    ``K // max(1, K // pp)`` micro-batches; a warm-up of ``(V - 1) x round + 2 (pp - 1 - rank)`` forwards (at most
    V K), the forwards going chunk by chunk a round at a time; then one forward and one backward, the backwards
    going from the last chunk down; then the remaining backwards.

    >>> interleaved_actions(1, 2, 2, 2)
    [('F', 0, 0), ('F', 0, 1), ('F', 1, 0), ('B', 1, 0), ('F', 1, 1), ('B', 1, 1), ('B', 0, 0), ('B', 0, 1)]
    """
    rounds = max(1, microbatches // ranks)
    per_round = microbatches // rounds
    warmup = min((virtual - 1) * per_round + 2 * (ranks - 1 - rank), microbatches * virtual)
    both = microbatches * virtual - warmup
    forwards: dict[int, int] = {}
    backwards: dict[int, int] = {}
    actions: list[tuple[str, int, int]] = []

    def forward(step: int) -> None:
        chunk = (step // per_round) % virtual
        actions.append(("F", chunk, forwards.get(chunk, 0)))
        forwards[chunk] = forwards.get(chunk, 0) + 1

    def backward(step: int) -> None:
        chunk = virtual - 1 - ((step - warmup) // per_round) % virtual
        actions.append(("B", chunk, backwards.get(chunk, 0)))
        backwards[chunk] = backwards.get(chunk, 0) + 1

    for step in range(warmup + both + warmup):
        if step < warmup:
            forward(step)
        elif step < warmup + both:
            forward(step)
            backward(step)
        else:
            backward(step)
    return actions


def pipeline_refusal(schedule: str, stages: int, microbatches: int, blocks: int | None) -> str | None:
    """Why this pipeline cannot be measured on this model (one line naming the flag), or None."""
    if schedule not in SCHEDULES:
        return f"--pp-schedule {schedule} is not measured yet (measured: {', '.join(SCHEDULES)})"
    if schedule != "gpipe" and microbatches < stages:
        return (
            f"--pp-microbatches {microbatches} is below --pp {stages}: under --pp-schedule {schedule} every stage "
            "needs a micro-batch in flight (K >= pp)"
        )
    rounds = max(1, microbatches // stages)
    if schedule == "interleaved-1f1b" and microbatches % rounds:
        return (
            f"--pp-microbatches {microbatches}: interleaved 1F1B runs rounds of K // max(1, K // pp) micro-batches, "
            f"and {microbatches} is not a multiple of its {rounds} rounds"
        )
    if blocks is not None and blocks < stages:
        return f"--pp {stages}: the model has {blocks} block(s) to cut, fewer than the stages"
    return None
