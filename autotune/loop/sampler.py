"""Length-aware batching: micro-batches that fill the memory surface, updates that hold a token target.

A job whose samples have many lengths has two plans without this: m_max at the longest length for
every micro-batch (safe, and most of the card idle on short samples), or m_max at a typical length
(fast, until the first long batch runs out of memory). :class:`LengthBatchSampler` takes the third
way: each micro-batch holds as many samples as fit at its own padded length, by ``capacity(L)``
(:func:`autotune.core.capacity.capacity`, read off the probe's surface), and each optimizer update
holds ``target_tokens`` supervised tokens, whatever the lengths.

One epoch, from ``seed`` and the epoch (every replica computes the same plan):

1. the samples are shuffled, then grouped by padded length into buckets whose lengths differ by at
   most ``BUCKET_GROWTH`` (random order within a bucket);
2. walking the buckets from short to long, each micro-batch takes samples while its size stays within
   the capacity at its longest padded length, so micro-batches fill the memory and pad little;
3. the micro-batches are shuffled across buckets, and updates take them in turn until the next would
   pass ``target_tokens``: that one is split, its samples that fit close the update and the others
   open the next, so every update but the last holds between N - (the most tokens of one sample) and
   N tokens. The last update of the epoch holds what is left and says so (``Update.short``);
4. under DDP every update's micro-batches are cut (split further where needed) into a multiple of
   the replicas and dealt out largest first, so that every rank runs the same number of micro-batches
   per update and about the same work; the token target counts all ranks.

With ``pack_to=L`` the samples are packed into rows of L tokens instead (best fit, longest first in
pools of ``PACK_POOL``, documents never split) and a micro-batch holds ``capacity(L)`` rows; each row
is a :class:`PackedRow` with its documents' boundaries for a varlen attention mask.

    cap = capacity(profiles)                      # autotune.core.capacity
    sampler = LengthBatchSampler(lengths, cap, target_tokens=65536, pad_to_multiple_of=8)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_to_longest)
    acc = Accumulator(model, optimizer, accumulation_steps=1)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for group in sampler.groups(acc, loader, count=lambda b: (b["labels"] != -100).sum()):
            for batch in group:
                with acc.micro_step():
                    total, n = loss_sum(model, batch)
                    acc.backward(total, count=n)   # divided by the whole update's tokens
            acc.step()

Every input error (a length that is not a positive integer, a sample longer than the capacity covers,
a target below the longest sample, a capacity of 0) is one line, raised by the constructor.
"""

from __future__ import annotations

import math
import operator
import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Sampler

if TYPE_CHECKING:
    from autotune.loop.accumulate import Accumulator, Group

__all__ = ["BUCKET_GROWTH", "PACK_POOL", "LengthBatchSampler", "PackedRow", "Update"]

# Lengths in one bucket differ by at most this fraction: the padding a micro-batch within one bucket
# can carry, against the randomness of which samples meet in a micro-batch.
BUCKET_GROWTH = 1 / 16
# Packing sorts documents longest first within pools of this many (after the shuffle), so that rows
# fill well and still change from epoch to epoch.
PACK_POOL = 1024

# A micro-batch while planning: sample indices, or (packing) rows, each a list of sample indices.
_Batch = list[Any]


@dataclass(frozen=True)
class PackedRow:
    """One packed row of ``length`` tokens: the documents ``indices`` back to back, then padding.

    ``boundaries`` are the documents' offsets in the row, from 0 to the tokens used
    (``cu_seqlens`` for a varlen attention kernel): document k spans ``boundaries[k]:boundaries[k + 1]``.
    """

    indices: tuple[int, ...]
    boundaries: tuple[int, ...]
    length: int

    @property
    def tokens(self) -> int:
        """Tokens of documents in the row (the rest of ``length`` is padding)."""
        return self.boundaries[-1]


class Update(list[Any]):
    """The micro-batches one rank runs for one optimizer update (lists of indices, or of
    :class:`PackedRow` when packing).

    Attributes:
        position: the update's place in the epoch (0, 1, ...).
        tokens: supervised tokens of the whole update, over all ranks.
        samples: samples of the whole update, over all ranks.
        short: the epoch's last update, holding what was left (its tokens may be well under the target).
        repeated: samples run a second time this epoch (DDP only: a last update that cannot be cut into
            a micro-batch per rank otherwise, as DistributedSampler pads its last batch).
    """

    def __init__(
        self,
        micro_batches: list[Any],
        *,
        position: int,
        tokens: int,
        samples: int,
        short: bool,
        repeated: tuple[int, ...] = (),
    ) -> None:
        super().__init__(micro_batches)
        self.position = position
        self.tokens = tokens
        self.samples = samples
        self.short = short
        self.repeated = repeated

    def __repr__(self) -> str:
        return (
            f"Update(position={self.position}, micro_batches={len(self)}, tokens={self.tokens}, "
            f"samples={self.samples}, short={self.short}{f', repeated={list(self.repeated)}' if self.repeated else ''})"
        )


def _positive(value: Any, what: str) -> int:
    """value as an int >= 1, or a one-line ValueError naming what it is."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return number


def _replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """(num_replicas, rank) as DistributedSampler takes them: the process group's where not given."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    if num_replicas is None:
        num_replicas = torch.distributed.get_world_size() if initialized else 1
    if rank is None:
        rank = torch.distributed.get_rank() if initialized else 0
    replicas = _positive(num_replicas, "num_replicas")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < replicas:
        raise ValueError(f"rank must be an integer from 0 to {replicas - 1}, got {rank!r}")
    return replicas, rank


class LengthBatchSampler(Sampler[list[Any]]):
    """Micro-batches of a map-style dataset's indices that fit at their own padded length, grouped into
    updates of ``target_tokens`` supervised tokens (see the module docstring).

    Iterating it yields this rank's micro-batches of the epoch, update after update (feed it to a
    DataLoader as ``batch_sampler``); :meth:`updates` yields them grouped per update, and
    :meth:`groups` hands each update to an :class:`~autotune.loop.accumulate.Accumulator` as one group.

    Args:
        lengths: each sample's length in tokens (what it pads from).
        capacity: ``capacity(L)`` -> the largest micro-batch that fits at padded length L
            (:func:`autotune.core.capacity.capacity`, or any callable).
        target_tokens: N, supervised tokens per optimizer update over all ranks.
        seed, shuffle: as DistributedSampler takes them; the order depends on seed and the epoch.
        pad_to_multiple_of: micro-batches are padded to a multiple of this (what the collate does);
            capacity is read at the padded length.
        num_replicas, rank: the data-parallel replicas and this one (default: the process group's).
        drop_last: leave out the epoch's short last update.
        pack_to: pack samples into rows of this many tokens (documents never split); micro-batches
            of ``capacity(pack_to)`` rows, each a :class:`PackedRow`.
        supervised_tokens: each sample's supervised tokens (default its length), what the target counts.

    Raises:
        ValueError: one line, before any batch: a length that is not a positive integer, a sample
            longer than the capacity covers (or than ``pack_to``), a capacity of 0 or one that fails,
            ``target_tokens`` below the longest sample (below num_replicas x it under DDP), or another
            argument out of range.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        capacity: Callable[[int], int],
        *,
        target_tokens: int,
        seed: int = 0,
        shuffle: bool = True,
        pad_to_multiple_of: int = 1,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        pack_to: int | None = None,
        supervised_tokens: Sequence[int] | None = None,
    ) -> None:
        self.lengths = [_positive(length, f"length of sample {i}") for i, length in enumerate(lengths)]
        if not self.lengths:
            raise ValueError("lengths is empty: there is nothing to batch")
        self.supervised = self._supervised(supervised_tokens)
        self.target_tokens = _positive(target_tokens, "target_tokens")
        self.pad_to_multiple_of = _positive(pad_to_multiple_of, "pad_to_multiple_of")
        self.pack_to = None if pack_to is None else _positive(pack_to, "pack_to")
        self.num_replicas, self.rank = _replicas(num_replicas, rank)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed, self.shuffle, self.drop_last = seed, bool(shuffle), bool(drop_last)
        self.capacity = capacity
        self._check_target()
        # Capacity at each padded length, made non-increasing in L: any part of a micro-batch that
        # fits (fewer samples, no longer) then fits too, which the splits below rely on.
        self._room = self._packed_room() if self.pack_to is not None else self._rooms()
        self.epoch = 0
        self._plan_cache: tuple[int, list[list[Update]]] | None = None

    # -- checks --------------------------------------------------------------------------------

    def _supervised(self, supervised: Sequence[int] | None) -> list[int]:
        if supervised is None:
            return list(self.lengths)
        counts = list(supervised)
        if len(counts) != len(self.lengths):
            raise ValueError(f"supervised_tokens has {len(counts)} entries for {len(self.lengths)} samples")
        out = []
        for i, count in enumerate(counts):
            try:
                number = -1 if isinstance(count, bool) else operator.index(count)
            except TypeError:
                number = -1
            if number < 0:
                raise ValueError(f"supervised tokens of sample {i} must be a non-negative integer, got {count!r}")
            out.append(number)
        return out

    def _check_target(self) -> None:
        most = max(range(len(self.supervised)), key=self.supervised.__getitem__)
        need = self.supervised[most] * self.num_replicas
        if self.target_tokens < need:
            per = f"{self.num_replicas} replicas x " if self.num_replicas > 1 else ""
            raise ValueError(
                f"target_tokens {self.target_tokens} is below {per}the longest sample (sample {most}: "
                f"{self.supervised[most]} tokens): every update must hold it"
                + (" on every replica" if self.num_replicas > 1 else "")
            )

    def _capacity_at(self, padded: int, sample: int) -> int:
        """capacity(padded) as a checked int, or the one-line error naming the sample that needs it."""
        length = self.lengths[sample]
        shown = f"length {length}" + (f" (padded to {padded})" if padded != length else "")
        try:
            value = self.capacity(padded)
        except Exception as exc:
            longest = getattr(exc, "longest", None) or getattr(self.capacity, "longest", None)
            if longest is not None and padded > longest:
                raise ValueError(
                    f"sample {sample} has {shown}, longer than the capacity covers (up to {longest})"
                ) from None
            first_line = (str(exc).strip().splitlines() or [""])[0]
            raise ValueError(
                f"capacity({padded}) failed for sample {sample} ({shown}): {type(exc).__name__}: {first_line}"
            ) from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"capacity({padded}) returned {value!r}, not a micro-batch size (sample {sample})")
        if value == 0:
            raise ValueError(
                f"capacity({padded}) is 0: not even one sample of {shown} (sample {sample}) fits the budget"
            )
        return value

    def _rooms(self) -> dict[int, int]:
        first: dict[int, int] = {}
        for i in range(len(self.lengths)):
            first.setdefault(self._padded(self.lengths[i]), i)
        rooms: dict[int, int] = {}
        smallest = math.inf
        for padded in sorted(first):
            smallest = min(smallest, self._capacity_at(padded, first[padded]))
            rooms[padded] = int(smallest)
        return rooms

    def _packed_room(self) -> dict[int, int]:
        assert self.pack_to is not None
        longest = max(range(len(self.lengths)), key=self.lengths.__getitem__)
        if self.lengths[longest] > self.pack_to:
            raise ValueError(
                f"sample {longest} has length {self.lengths[longest]}, longer than pack_to {self.pack_to}: "
                "documents are never split"
            )
        return {self.pack_to: self._capacity_at(self.pack_to, longest)}

    def _padded(self, length: int) -> int:
        step = self.pad_to_multiple_of
        return -(-length // step) * step

    # -- the public side -----------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Use epoch's order (as DistributedSampler.set_epoch): call it before each epoch's loader."""
        self.epoch = int(epoch)

    def padded_length(self, micro_batch: Sequence[Any]) -> int:
        """The length a micro-batch pads to: its longest sample rounded up to pad_to_multiple_of, or
        pack_to when packing."""
        if self.pack_to is not None:
            return self.pack_to
        return self._padded(max(self.lengths[i] for i in micro_batch))

    def updates(self) -> Iterator[Update]:
        """This rank's micro-batches of the epoch, one :class:`Update` (a list of them) per optimizer update."""
        return iter(self._plan()[self.rank])

    def __iter__(self) -> Iterator[list[Any]]:
        for update in self.updates():
            yield from update

    def __len__(self) -> int:
        """This rank's micro-batches in the current epoch."""
        return sum(len(update) for update in self._plan()[self.rank])

    def groups(self, accumulator: Accumulator, loader: Any, count: Any = None) -> Iterator[Group]:
        """``accumulator.groups(loader, count)`` with one group per update of this epoch: each group
        holds the update's micro-batches (their number varies), so the Accumulator divides each by the
        whole update's supervised tokens. ``loader`` must yield this sampler's micro-batches (a
        DataLoader with ``batch_sampler=self``), in the same epoch.

        Raises:
            ValueError: the loader yields fewer or more micro-batches than the epoch's updates hold.
        """
        sizes = [len(update) for update in self.updates()]
        groups = accumulator.groups(loader, count=count)
        for index, size in enumerate(sizes):
            # Read by groups() when it fetches the next group, i.e. after the previous one was stepped.
            accumulator.accumulation_steps = size
            group = next(groups, None)
            if group is None or len(group) != size:
                raise ValueError(
                    f"the loader ran out at update {index} of {len(sizes)}: give it this sampler as its "
                    "batch_sampler, in the same epoch"
                )
            yield group
        accumulator.accumulation_steps = 1
        if next(groups, None) is not None:  # also where groups() checks that the last group was stepped
            raise ValueError(
                "the loader yields more micro-batches than this epoch's updates hold: give it this sampler "
                "as its batch_sampler, in the same epoch"
            )

    # -- one epoch's plan ------------------------------------------------------------------------

    def _plan(self) -> list[list[Update]]:
        if self._plan_cache is None or self._plan_cache[0] != self.epoch:
            self._plan_cache = (self.epoch, _Planner(self).per_rank())
        return self._plan_cache[1]


class _Planner:
    """One epoch's plan for every rank (the same on every one: seeded by seed and epoch)."""

    def __init__(self, sampler: LengthBatchSampler) -> None:
        self.s = sampler
        self.rng = random.Random(sampler.seed * 1_000_003 + sampler.epoch)
        self.order = list(range(len(sampler.lengths)))
        if sampler.shuffle:
            self.rng.shuffle(self.order)

    # What is a micro-batch's item: a sample, or a packed row of samples.
    def _tokens(self, item: Any) -> int:
        supervised = self.s.supervised
        return supervised[item] if isinstance(item, int) else sum(supervised[i] for i in item)

    def _batch_tokens(self, batch: _Batch) -> int:
        return sum(self._tokens(item) for item in batch)

    def _samples(self, batch: _Batch) -> int:
        return sum(1 if isinstance(item, int) else len(item) for item in batch)

    def _cost(self, batch: _Batch) -> int:
        """Padded tokens: what a micro-batch costs in time and memory."""
        if self.s.pack_to is not None:
            return len(batch) * self.s.pack_to
        return len(batch) * self.s.padded_length(batch)

    # 1-2. micro-batches that fill the capacity
    def chunks(self) -> list[_Batch]:
        if self.s.pack_to is not None:
            rows = self._packed_rows()
            if self.s.shuffle:
                self.rng.shuffle(rows)
            per = self.s._room[self.s.pack_to]
            return [rows[i : i + per] for i in range(0, len(rows), per)]
        padded = [self.s._padded(length) for length in self.s.lengths]
        growth = math.log1p(BUCKET_GROWTH)
        order = sorted(self.order, key=lambda i: math.floor(math.log(padded[i]) / growth))
        chunks: list[_Batch] = []
        batch: _Batch = []
        longest = 0
        for i in order:
            longer = max(longest, padded[i])
            if batch and len(batch) + 1 > self.s._room[longer]:
                chunks.append(batch)
                batch, longer = [], padded[i]
            batch.append(i)
            longest = longer
        chunks.append(batch)
        if self.s.shuffle:
            self.rng.shuffle(chunks)
        return chunks

    def _packed_rows(self) -> list[list[int]]:
        """Best fit, longest first within pools of PACK_POOL documents (in shuffled order): each
        document goes to the open row with the least room that holds it, else opens a row."""
        assert self.s.pack_to is not None
        size, lengths = self.s.pack_to, self.s.lengths
        rows: list[list[int]] = []
        free = _RoomIndex(size)  # rows by their room left
        for start in range(0, len(self.order), PACK_POOL):
            pool = sorted(self.order[start : start + PACK_POOL], key=lambda i: -lengths[i])
            for i in pool:
                found = free.take(lengths[i])
                if found is None:
                    row, room = len(rows), size
                    rows.append([])
                else:
                    row, room = found
                rows[row].append(i)
                free.put(row, room - lengths[i])
        return rows

    # 3. updates of target_tokens
    def updates(self) -> list[tuple[list[_Batch], bool, tuple[int, ...]]]:
        """(micro-batches, short, repeated) per update, over all ranks."""
        target, replicas = self.s.target_tokens, self.s.num_replicas
        stream = deque(self.chunks())
        out: list[tuple[list[_Batch], bool, tuple[int, ...]]] = []
        current: list[_Batch] = []
        tokens = 0
        while stream:
            batch = stream.popleft()
            need = self._batch_tokens(batch)
            if tokens + need <= target:
                current.append(batch)
                tokens += need
                continue
            taken, rest = self._split_at(batch, target - tokens)
            if taken:
                current.append(taken)
            if rest:
                stream.appendleft(rest)
            shed = self._per_rank(current, replicas)
            stream.extendleft(reversed(shed))
            out.append((current, False, ()))
            current, tokens = [], 0
        if current and not self.s.drop_last:
            repeated = self._pad_last(current, replicas) if replicas > 1 else ()
            out.append((current, True, repeated))
        return out

    def _split_at(self, batch: _Batch, room: int) -> tuple[_Batch, _Batch]:
        """The items of batch (and, packing, documents of a row) that fit in room tokens, and the rest."""
        taken: _Batch = []
        rest: _Batch = []
        for item in batch:
            need = self._tokens(item)
            if need <= room:
                taken.append(item)
                room -= need
            elif isinstance(item, int):
                rest.append(item)
            else:  # a packed row: its documents that fit stay, the others make a row of their own
                fits, left = [], []
                for doc in item:
                    if self.s.supervised[doc] <= room:
                        fits.append(doc)
                        room -= self.s.supervised[doc]
                    else:
                        left.append(doc)
                if fits:
                    taken.append(fits)
                rest.append(left)
        return taken, rest

    # 4. the same number of micro-batches on every rank
    def _split_one(self, batches: list[_Batch]) -> bool:
        """Split the micro-batch with the most items (a packed row with the most documents, where
        every micro-batch is one row) in two; False where nothing can be split."""
        best = max(range(len(batches)), key=lambda k: len(batches[k]))
        batch = batches[best]
        if len(batch) >= 2:
            half = len(batch) // 2
            batches[best : best + 1] = [batch[:half], batch[half:]]
            return True
        if self.s.pack_to is None:
            return False
        rows = [k for k in range(len(batches)) if len(batches[k][0]) >= 2]
        if not rows:
            return False
        best = max(rows, key=lambda k: len(batches[k][0]))
        row = batches[best][0]
        half = len(row) // 2
        batches[best : best + 1] = [[row[:half]], [row[half:]]]
        return True

    def _per_rank(self, batches: list[_Batch], replicas: int) -> list[_Batch]:
        """Split micro-batches until their number is a multiple of replicas (at least one each); where
        they cannot be split further, give back the smallest to the next update (returned)."""
        target = max(1, -(-len(batches) // replicas)) * replicas
        while len(batches) < target and self._split_one(batches):
            pass
        shed: list[_Batch] = []
        extra = len(batches) % replicas
        if extra and len(batches) > replicas:
            by_tokens = sorted(range(len(batches)), key=lambda k: self._batch_tokens(batches[k]))[:extra]
            shed = [batches[k] for k in sorted(by_tokens)]
            batches[:] = [b for k, b in enumerate(batches) if k not in set(by_tokens)]
        return shed

    def _pad_last(self, batches: list[_Batch], replicas: int) -> tuple[int, ...]:
        """The last update cut into a multiple of replicas; where it cannot be, samples from the start
        of the epoch run again, one per micro-batch, as DistributedSampler pads (returned)."""
        target = max(1, -(-len(batches) // replicas)) * replicas
        while len(batches) < target and self._split_one(batches):
            pass
        repeated: list[int] = []
        while len(batches) % replicas:
            sample = self.order[len(repeated) % len(self.order)]
            repeated.append(sample)
            batches.append([sample] if self.s.pack_to is None else [[sample]])
        return tuple(repeated)

    def per_rank(self) -> list[list[Update]]:
        replicas = self.s.num_replicas
        plans: list[list[Update]] = [[] for _ in range(replicas)]
        for index, (batches, short, repeated) in enumerate(self.updates()):
            tokens = sum(self._batch_tokens(b) for b in batches)
            samples = sum(self._samples(b) for b in batches)
            # Largest first, dealt out back and forth: every rank the same number, about the same work.
            ordered = sorted(batches, key=self._cost, reverse=True)
            shares: list[list[Any]] = [[] for _ in range(replicas)]
            for k, batch in enumerate(ordered):
                lap, seat = divmod(k, replicas)
                shares[seat if lap % 2 == 0 else replicas - 1 - seat].append(self._output(batch))
            for rank in range(replicas):
                plans[rank].append(
                    Update(shares[rank], position=index, tokens=tokens, samples=samples, short=short, repeated=repeated)
                )
        return plans

    def _output(self, batch: _Batch) -> list[Any]:
        if self.s.pack_to is None:
            return list(batch)
        lengths = self.s.lengths
        out = []
        for row in batch:
            bounds = [0]
            for i in row:
                bounds.append(bounds[-1] + lengths[i])
            out.append(PackedRow(indices=tuple(row), boundaries=tuple(bounds), length=self.s.pack_to))
        return out


class _RoomIndex:
    """Open rows by the room they have left (0..size), for best fit: the row with the least room
    that still holds a length, in O(log size) (a Fenwick tree over the rooms' counts)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.tree = [0] * (size + 2)
        self.rows: list[list[int]] = [[] for _ in range(size + 1)]
        self.top = 1 << (size + 1).bit_length()

    def _add(self, room: int, delta: int) -> None:
        k = room + 1
        while k < len(self.tree):
            self.tree[k] += delta
            k += k & -k

    def _count_below(self, room: int) -> int:
        """Open rows with less than room left."""
        k, total = room, 0
        while k > 0:
            total += self.tree[k]
            k -= k & -k
        return total

    def put(self, row: int, room: int) -> None:
        if room <= 0:
            return  # full: never a candidate again
        self.rows[room].append(row)
        self._add(room, 1)

    def take(self, length: int) -> tuple[int, int] | None:
        """Remove and return the open row with the least room >= length, and its room (None: there is none)."""
        rank = self._count_below(length)  # rows that are too full; the next one up is the best fit
        position, remaining = 0, rank + 1
        step = self.top
        while step:
            nxt = position + step
            if nxt < len(self.tree) and self.tree[nxt] < remaining:
                position = nxt
                remaining -= self.tree[nxt]
            step >>= 1
        room = position  # tree index position + 1 holds room `position`
        if room > self.size:
            return None
        row = self.rows[room].pop()
        self._add(room, -1)
        return row, room
