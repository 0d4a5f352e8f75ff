"""A plan's micro-batches as a DataLoader's batch sampler: index lists, group after group.

A balanced plan's micro-batches differ in size (6 x 26 + 4 x 25 = 256), which a DataLoader's ``batch_size``
cannot say; :class:`PlanBatchSampler` can, and :class:`~autotune.loop.accumulate.Accumulator` takes exactly
one of its groups per update (the two are public as ``autotune.PlanBatchSampler`` and ``autotune.Accumulator``).

Imports: torch's data utilities and ``autotune.core``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence, Sized

from torch.utils.data import Sampler

from autotune.core.schemas import Plan, Suggestion

__all__ = ["PlanBatchSampler"]


class PlanBatchSampler(Sampler[list[int]]):
    """Index lists for a map-style dataset, cut into a plan's micro-batches, group after group.

    A balanced plan's micro-batches differ in size (6 x 26 + 4 x 25 = 256), which a DataLoader's
    ``batch_size`` cannot say; this batch sampler can. Each update's group is the plan's sizes in
    order, so an ``Accumulator`` with ``accumulation_steps=plan.accumulation_steps`` takes exactly
    one group per update and divides it by its true count. The last group of an epoch, when fewer
    samples than a whole group are left, is those samples in micro-batches as even as they can be,
    none larger than the plan's largest (``drop_last=True`` leaves it out).

        plan = suggest(model, 256, example=dataset[:1])
        loader = DataLoader(dataset, batch_sampler=PlanBatchSampler(RandomSampler(dataset), plan))
        acc = Accumulator(model, optimizer, accumulation_steps=plan.accumulation_steps)

    Under DDP pass each replica's ``DistributedSampler``: the plan's micro-batches are per replica.

    Args:
        sampler: the indices in the order to use them (a Sampler, any sized iterable of ints), or
            the dataset's length for 0, 1, ..., n - 1.
        plan: a Plan, a Suggestion, or the (size, count) pairs of one update's micro-batches.
        drop_last: leave out a last group smaller than a whole one.

    Raises:
        ValueError: no micro-batches, or a size or count below 1.
    """

    def __init__(
        self,
        sampler: Iterable[int] | int,
        plan: Plan | Suggestion | Sequence[tuple[int, int]],
        *,
        drop_last: bool = False,
    ) -> None:
        pairs = list(plan.micro_batches) if isinstance(plan, Plan | Suggestion) else [tuple(p) for p in plan]
        if not pairs or any(size < 1 or count < 1 for size, count in pairs):
            raise ValueError(f"micro-batches must be (size >= 1, count >= 1) pairs, got {pairs!r}")
        self.sampler: Iterable[int] = range(sampler) if isinstance(sampler, int) else sampler
        #: The sizes of one group's micro-batches, in the order they are yielded.
        self.sizes = [size for size, count in pairs for _ in range(count)]
        self.group_samples = sum(self.sizes)
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        indices = iter(self.sampler)
        while True:
            group: list[list[int]] = []
            for size in self.sizes:
                batch = list(itertools.islice(indices, size))
                if batch:
                    group.append(batch)
                if len(batch) < size:  # the sampler ran out inside this group
                    break
            if sum(len(b) for b in group) == self.group_samples:
                yield from group
                continue
            if group and not self.drop_last:
                yield from self._rebalanced([index for batch in group for index in batch])
            return

    def _rebalanced(self, indices: list[int]) -> Iterator[list[int]]:
        # ceil(n / largest) micro-batches whose sizes differ by at most one: none larger than what fits.
        parts = -(-len(indices) // max(self.sizes))
        small, extra = divmod(len(indices), parts)
        start = 0
        for part in range(parts):
            stop = start + small + (1 if part < extra else 0)
            yield indices[start:stop]
            start = stop

    def __len__(self) -> int:
        if not isinstance(self.sampler, Sized):
            raise TypeError("the sampler has no length")
        groups, rest = divmod(len(self.sampler), self.group_samples)
        tail = 0 if self.drop_last or rest == 0 else -(-rest // max(self.sizes))
        return groups * len(self.sizes) + tail
