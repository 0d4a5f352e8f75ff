"""m_max at every sequence length: the capacity a length-aware sampler fills. Pure arithmetic, no torch.

A run over lengths (``autotune probe --seq-len 128,256,512``) gives one profile per length, each with
its measured m_max and the peak surface over (m, L) they share (autotune/core/surface.py). ``capacity``
turns them into one callable, ``L -> m_max(L)``:

- at a measured length, that length's m_max (confirmed by real trials);
- between, the largest m the surface predicts within the profiles' limit (budget x (1 - headroom),
  less the offset the device's real trials showed above the surface), held between what trials
  confirmed: never above the m_max of a shorter measured length, never below what fits at a longer
  one (peaks grow with L);
- shorter than the shortest covered length, the answer there (what fits a longer sequence fits a
  shorter one);
- longer than the surface covers (the longest length that fits at m = multiple_of): a one-line
  :class:`CapacityError`.

    >>> from tests.factories import surface_gpt_payloads
    >>> cap = capacity(surface_gpt_payloads())  # measured at 128, 256, 512 under 64 MiB
    >>> cap(128), cap(256), cap(384), cap(2048)
    (36, 18, 12, 2)
    >>> cap(4096)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autotune.core.capacity.CapacityError: seq_len 4096 is longer than the profiles cover (128..2048): ...

Profiles of a run whose surface could not be had (``surface`` None) still give a capacity: m_max at
each measured length, and between them the m_max of the next longer one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from autotune.core import units
from autotune.core.errors import AutotuneError
from autotune.core.schemas import Profile
from autotune.core.surface import PeakSurface

__all__ = ["Capacity", "CapacityError", "capacity"]


class CapacityError(AutotuneError, ValueError):
    """Profiles that cannot give a capacity (not of one run over lengths), or a length they do not
    cover. ``seq_len`` and ``longest`` are set for a length beyond the covered ones."""

    def __init__(self, message: str, *, seq_len: int | None = None, longest: int | None = None) -> None:
        super().__init__(message)
        self.seq_len = seq_len
        self.longest = longest


@dataclass(frozen=True)
class Capacity:
    """``capacity(L)``: the largest micro-batch that fits at sequence length L (see the module
    docstring). Build it with :func:`capacity`.

    Attributes:
        shortest, longest: the lengths the profiles cover, inclusive (longer ones raise).
        measured: m_max at each measured length.
        floors: (L, m) pairs confirmed to fit by real trials (the measured lengths, and the
            longest length at m = multiple_of): m fits at every length up to L.
        limit_bytes: the peak that still fits (budget x (1 - headroom)).
        surface: the peak surface, or None where the run had none.
    """

    shortest: int
    longest: int
    measured: Mapping[int, int]
    floors: tuple[tuple[int, int], ...]
    limit_bytes: int
    offset_bytes: int = 0
    multiple_of: int = 1
    micro_batch_cap: int = 4096
    surface: PeakSurface | None = None
    _cache: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def covered(self) -> tuple[int, int]:
        """(shortest, longest): the lengths this capacity answers for (shorter ones as the shortest)."""
        return self.shortest, self.longest

    def __call__(self, seq_len: int) -> int:
        """The largest micro-batch that fits at seq_len.

        Raises:
            CapacityError: seq_len is not a positive integer, or longer than the profiles cover.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise CapacityError(f"seq_len must be a positive integer, got {seq_len!r}")
        if seq_len > self.longest:
            raise CapacityError(
                f"seq_len {seq_len} is longer than the profiles cover ({self.shortest}..{self.longest}): "
                f"probe with --seq-len {seq_len}",
                seq_len=seq_len,
                longest=self.longest,
            )
        at = max(seq_len, self.shortest)
        found = self._cache.get(at)
        if found is None:
            found = self._cache[at] = self._at(at)
        return found

    def _at(self, seq_len: int) -> int:
        if seq_len in self.measured:
            return self.measured[seq_len]
        # Peaks grow with L: a size that failed at a shorter length fails here; one that fit at a
        # longer length fits here.
        above = [m for length, m in self.measured.items() if length < seq_len]
        below = [m for length, m in self.floors if length >= seq_len]
        ceiling = min(above, default=self.micro_batch_cap)
        floor = max(below, default=0)
        if self.surface is None:
            return min(floor, ceiling)
        predicted = self.surface.max_fitting(
            self.limit_bytes - self.offset_bytes, seq_len, cap=self.micro_batch_cap, multiple_of=self.multiple_of
        )
        return min(max(predicted, floor), ceiling)


def _as_profile(item: Profile | Mapping[str, Any]) -> Profile:
    return item if isinstance(item, Profile) else Profile.model_validate(item)


# What every profile of one run shares: (what it is called in the message, how to read it).
_SHARED = (
    ("fingerprint", lambda p: p.fingerprint),
    ("device", lambda p: p.device.name),
    ("budget_bytes", lambda p: p.budget_bytes),
    ("headroom", lambda p: p.headroom),
    ("multiple_of", lambda p: p.multiple_of),
    ("micro_batch_cap", lambda p: p.micro_batch_cap),
    ("strategy", lambda p: (p.strategy, p.world_size)),
    ("activation_checkpointing", lambda p: p.activation_checkpointing),
    ("surface", lambda p: p.surface),
)


def capacity(profiles: Iterable[Profile | Mapping[str, Any]]) -> Capacity:
    """The capacity ``L -> m_max(L)`` of one run over lengths (see the module docstring).

    Args:
        profiles: the run's profiles (``autotune probe --seq-len ... --json`` prints them as a JSON
            array; ``probe_lengths(...).profiles``; Profile objects or their JSON dicts).

    Returns:
        A :class:`Capacity`; call it with a length.

    Raises:
        CapacityError: no profiles, a profile without ``seq_len`` (not sequence-aware), profiles of
            different runs (another fingerprint, device, budget, surface, ...), or two that disagree
            at one length.
    """
    run = [_as_profile(p) for p in profiles]
    if not run:
        raise CapacityError("capacity needs the profiles of a run over lengths (autotune probe --seq-len ...)")
    for profile in run:
        if profile.seq_len is None:
            raise CapacityError(
                f"profile of task {profile.task!r} has no seq_len: capacity needs the profiles of a run over "
                "lengths (autotune probe --seq-len L1,L2,...)"
            )
    first = run[0]
    for name, read in _SHARED:
        values = {repr(read(p)) for p in run}
        if len(values) > 1:
            raise CapacityError(f"the profiles are not of one run over lengths: their {name} differ")
    measured: dict[int, int] = {}
    for profile in run:
        assert profile.seq_len is not None
        known = measured.setdefault(profile.seq_len, profile.max_micro_batch)
        if known != profile.max_micro_batch:
            raise CapacityError(
                f"two profiles at seq_len {profile.seq_len} disagree (m_max {known} and {profile.max_micro_batch})"
            )
    floors = list(measured.items())
    record = first.surface
    limit_bytes = units.limit_bytes(first.budget_bytes, first.headroom)
    if record is None:
        return Capacity(
            shortest=min(measured),
            longest=max(measured),
            measured=measured,
            floors=tuple(sorted(floors)),
            limit_bytes=limit_bytes,
            multiple_of=first.multiple_of,
            micro_batch_cap=first.micro_batch_cap,
        )
    if record.longest is not None:
        floors.append((record.longest.seq_len, record.longest.micro_batch))
    surface = PeakSurface.from_dict(record.model_dump(mode="python"))
    return Capacity(
        shortest=record.covered[0],
        longest=record.covered[1],
        measured=measured,
        floors=tuple(sorted(floors)),
        limit_bytes=limit_bytes,
        offset_bytes=record.offset_bytes,
        multiple_of=first.multiple_of,
        micro_batch_cap=first.micro_batch_cap,
        surface=surface,
    )
