"""The recorded step of a deep model (autotune/emulation/card_steps.py) from the steps of the model cut to a few of its
blocks, as the depth shortcut makes its trials (autotune/search/depth.py): the predicted step time's cost follows the
kinds of blocks, not their count.

Identical blocks do the same ops and collectives, so what a step records grows with the depth in two ways only: a
count grows by the same amount with each block (the calls of a bag where no collective separates the blocks, a
segment's repeat, a foreach kernel's bytes over every parameter), or the run of segments gains the same stretches of
segments with each block (FSDP's gather of each block in the forward, its gather and reduction in the backward). Three
cuts, ``s`` blocks apart (``s`` the policy's period), show which: the third cut must be the first with the stretches
the second adds taken twice, and every count must grow by the same amount twice. The record at the model's depth is
then the first cut's with the stretches (or the growth) taken ``(depth - first) / s`` times, its segments folded as
the op counter folds them (consecutive equal segments as one with a repeat), which is what recording the whole model
gives (tests/autotune/test_depth.py holds the two to each other on emulated cards). Anything else, a field that
changes otherwise, raises :class:`NoRepetition`, and the caller records the whole model.

    >>> from autotune.core.step_records import CollectiveRecord, OpRecord, Segment, StepRecord
    >>> mm = OpRecord(op="aten.mm.default", kind="gemm", dtype="bf16", phase="forward", flops=8, bytes=12)
    >>> gather = CollectiveRecord(kind="all_gather", bytes=64, group_size=8, phase="forward", overlap="prefetched")
    >>> def cut(blocks: int) -> StepRecord:
    ...     stretch = [Segment(ops=[(0, 3)], collective=gather), Segment(ops=[(0, 1)])]
    ...     last = [Segment(ops=[(0, 2)]), *stretch * blocks]
    ...     return StepRecord(micro_batch=1, ops=[mm], last=last, other=[], step=[])
    >>> whole = extrapolate([cut(3), cut(4), cut(5)], (3, 4, 5), 32)
    >>> whole == cut(32)
    True
    >>> len(whole.last)
    65
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import TypeVar

from autotune.core.step_records import CollectiveRecord, OpRecord, Segment, StepRecord
from autotune.search.depth_template import NoRepetition

_Counted = TypeVar("_Counted", OpRecord, CollectiveRecord)

__all__ = ["NoRepetition", "extrapolate", "grown", "record_depths"]

# What the first cut keeps but the two after it: the first and last blocks differ from the middle ones (FSDP2's
# prefetch, the embedding's output), so the first cut has one middle block at least.
FIRST_CUT = 3


def record_depths(count: int, period: int) -> tuple[int, int, int] | None:
    """The three cuts whose records make the record of ``count`` blocks (``period``: the blocks after which the
    policy's choice repeats), or None where the deepest would be the model itself. Below about 12 blocks the three
    cost more than the whole model; the depth shortcut starts at 8 (autotune/search/depth.py), and so do they, so
    that a model of 8 blocks shows the records at the whole depth made as a deep model's are.

    >>> record_depths(32, 1)
    (3, 4, 5)
    >>> record_depths(31, 2)
    (3, 5, 7)
    >>> record_depths(5, 1) is None
    True
    """
    first = FIRST_CUT + (count - FIRST_CUT) % period
    depths = (first, first + period, first + 2 * period)
    return depths if depths[-1] < count else None


def grown(values: Sequence[int], depths: Sequence[int], depth: int) -> int:
    """A count at ``depth`` from its counts at three cuts, where it grows by the same amount each ``s`` blocks.

    >>> grown([10, 14, 18], (3, 4, 5), 32)
    126
    >>> grown([10, 14, 19], (3, 4, 5), 32)
    Traceback (most recent call last):
    ...
    autotune.search.depth_template.NoRepetition: a count grows by 4 then 5 over the cuts
    """
    first, second, third = values
    if third - second != second - first:
        raise NoRepetition(f"a count grows by {second - first} then {third - second} over the cuts")
    steps, left = divmod(depth - depths[0], depths[1] - depths[0])
    if left:
        raise NoRepetition(f"{depth} blocks are not the first cut and whole periods")
    found = first + steps * (second - first)
    if found < 0:
        raise NoRepetition(f"a count falls below 0 at {depth} blocks")
    return found


def extrapolate(records: Sequence[StepRecord], depths: Sequence[int], depth: int) -> StepRecord:
    """The record of the model at ``depth`` blocks from its records at the three cuts ``depths`` (the module
    docstring); its ``flops_per_token`` is left to the caller (it reads the whole model's parameters).

    Raises:
        NoRepetition: the records do not grow as identical blocks make them grow.
    """
    first, second, third = records
    same = ("micro_batch", "seq_len", "ddp_buckets", "tokens_per_sample", "notes", "stage", "microbatches")
    for name in same:
        if not getattr(first, name) == getattr(second, name) == getattr(third, name):
            raise NoRepetition(f"the records' {name} differ over the cuts")
    if not len(first.ops) == len(second.ops) == len(third.ops):
        raise NoRepetition("the cuts run different kinds of ops")
    ops = [_grown_op(trio, depths, depth) for trio in zip(first.ops, second.ops, third.ops, strict=True)]
    runs = {
        name: _grown_segments([getattr(r, name) for r in records], depths, depth) for name in ("last", "other", "step")
    }
    return first.model_copy(update={"ops": ops, **runs, "flops_per_token": None})


def _grown_op(trio: tuple[OpRecord, OpRecord, OpRecord], depths: Sequence[int], depth: int) -> OpRecord:
    """An op kind of the table: the same op at the same shape, whose FLOPs and bytes may grow (a foreach kernel over
    every parameter)."""
    return _grown_fields(trio, ("flops", "bytes"), f"the op table's {trio[0].op}", depths, depth)


def _grown_fields(trio: Sequence[_Counted], counts: tuple[str, ...], what: str, depths: Sequence[int],
                  depth: int) -> _Counted:  # fmt: skip
    """One record of the three cuts', equal but for ``counts``, with those grown to ``depth``."""
    if len({item.model_copy(update=dict.fromkeys(counts, 0)) for item in trio}) != 1:
        raise NoRepetition(f"{what} differs over the cuts")
    return trio[0].model_copy(
        update={name: grown([getattr(item, name) for item in trio], depths, depth) for name in counts}
    )


def _grown_segments(runs: list[list[Segment]], depths: Sequence[int], depth: int) -> list[Segment]:
    """A run of segments at ``depth``: the same segments with counts that grow, or a stretch the cuts add."""
    unfolded = [_unfold(run) for run in runs]
    lengths = [len(run) for run in unfolded]
    if lengths[0] == lengths[1] == lengths[2]:
        return _fold([_grown_segment(trio, depths, depth) for trio in zip(*unfolded, strict=True)])
    return _fold(_stretched(unfolded, depths, depth))


def _stretched(runs: list[list[Segment]], depths: Sequence[int], depth: int) -> list[Segment]:
    """The first cut's run with what the second cut adds to it (a stretch at each place blocks run: FSDP's forward
    gathers, its backward's gathers and reductions) taken once per period; the third cut must be the first with each
    stretch taken twice."""
    first, second, third = runs
    keys = [[segment.model_dump_json() for segment in run] for run in (first, second)]
    matched = difflib.SequenceMatcher(None, keys[0], keys[1], autojunk=False).get_opcodes()
    if any(tag not in ("equal", "insert") for tag, *_ in matched):
        raise NoRepetition("the second cut's segments are not the first's with stretches added")

    def taken(times: int) -> list[Segment]:
        made: list[Segment] = []
        for tag, i1, i2, j1, j2 in matched:
            made.extend(first[i1:i2] if tag == "equal" else second[j1:j2] * times)
        return made

    if taken(2) != third:
        raise NoRepetition("the third cut's segments are not the first's with each stretch taken twice")
    return taken(grown([0, 1, 2], depths, depth))


def _grown_segment(trio: tuple[Segment, Segment, Segment], depths: Sequence[int], depth: int) -> Segment:
    """One segment at ``depth``: the same ops and collective, whose calls and bytes may grow."""
    first, second, third = trio
    if not [i for i, _ in first.ops] == [i for i, _ in second.ops] == [i for i, _ in third.ops]:
        raise NoRepetition("a segment's ops differ over the cuts")
    ops = [
        (index, grown([a, b, c], depths, depth))
        for (index, a), (_, b), (_, c) in zip(first.ops, second.ops, third.ops, strict=True)
    ]
    return Segment(ops=ops, collective=_grown_collective([s.collective for s in trio], depths, depth))


def _grown_collective(
    trio: list[CollectiveRecord | None], depths: Sequence[int], depth: int
) -> CollectiveRecord | None:
    first, second, third = trio
    if first is None or second is None or third is None:
        if not first is second is third:
            raise NoRepetition("a segment's collective differs over the cuts")
        return None
    return _grown_fields((first, second, third), ("bytes",), f"a segment's {first.kind}", depths, depth)


def _unfold(run: list[Segment]) -> list[Segment]:
    """Each repeated segment as that many segments of its own."""
    return [segment.model_copy(update={"repeat": 1}) for segment in run for _ in range(segment.repeat)]


def _fold(run: list[Segment]) -> list[Segment]:
    """Consecutive equal segments as one with a repeat, as the op counter folds them (and an empty segment dropped,
    as it drops one)."""
    folded: list[Segment] = []
    for segment in run:
        if not segment.ops and segment.collective is None:
            continue
        if folded and folded[-1].model_copy(update={"repeat": 1}) == segment:
            folded[-1] = folded[-1].model_copy(update={"repeat": folded[-1].repeat + 1})
        else:
            folded.append(segment)
    return folded
