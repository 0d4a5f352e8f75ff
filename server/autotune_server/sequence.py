"""Sequence length in /suggest: which profiles answer a job at length L, and the answer from a surface.

A sequence-aware setup (its fingerprint leaves L out) has one profile per measured length, each
carrying the peak surface over (m, L) its probe measured (autotune/core/surface.py). A job at length L gets:

- the profiles measured at L, which answer as any profile does (``measured``);
- where none was measured at L but a surface covers it (between the shortest length measured and
  the longest that fit at m = multiple_of): m_max read off the surface within the job's limit, as
  ``predicted``, with a warning naming the measured lengths;
- otherwise a 404 naming the measured lengths.

A setup that is not sequence-aware has its length in its fingerprint already (the samples' fixed shapes): asked
at its own length (the task's tag ``seq_len``), a ``seq_len`` only converts the answer to tokens; asked at
another, it is a 404 naming both (the job at that length is another job, never measured); a setup that records no
length is asked without one (422: the answer cannot say which length it holds for). A sequence-aware setup asked
without ``seq_len`` is a 422: its answer depends on L.
"""

from __future__ import annotations

from dataclasses import replace

from autotune.core.plan import TargetError, target_in_sequences
from autotune.core.surface import PeakSurface
from autotune_server.candidates import Candidate, Lookup
from autotune_server.errors import InvalidPlanRequest, NoProfileForSuggestion

__all__ = [
    "at_fixed_length",
    "at_length",
    "covering",
    "measured_lengths",
    "not_measured",
    "surface_max",
    "surface_peak",
    "target_batch_for",
]


def _candidates(found: Lookup) -> tuple[Candidate, ...]:
    return (*found.here, *found.elsewhere)


def measured_lengths(found: Lookup) -> list[int]:
    """The lengths the setup's stored profiles were measured (or estimated) at."""
    return sorted({c.seq_len for c in _candidates(found) if c.seq_len is not None})


def at_length(found: Lookup, seq_len: int | None, *, fingerprint: str) -> Lookup:
    """The lookup restricted to the profiles at seq_len (all of them for a setup that is not
    sequence-aware).

    Raises:
        InvalidPlanRequest: a sequence-aware setup asked without seq_len (422 naming the field).
    """
    lengths = measured_lengths(found)
    if not lengths:
        return found
    if seq_len is None:
        raise InvalidPlanRequest(
            f"fingerprint {fingerprint} is sequence-aware (measured at seq_len {', '.join(map(str, lengths))}): "
            "pass seq_len, the job's sequence length",
            field="seq_len",
        )
    return Lookup(
        here=tuple(c for c in found.here if c.seq_len == seq_len),
        elsewhere=tuple(c for c in found.elsewhere if c.seq_len == seq_len),
        skipped=found.skipped,
    )


def at_fixed_length(found: Lookup, seq_len: int | None, *, fingerprint: str, device_name: str) -> Lookup:
    """A setup that is not sequence-aware, asked at seq_len: the lookup itself where seq_len is its own length
    (or none is asked).

    Raises:
        NoProfileForSuggestion: its length is another (404 naming both).
        InvalidPlanRequest: it records no length to hold seq_len against (422 naming seq_len).
    """
    everyone = _candidates(found)
    if seq_len is None or not everyone:
        return found
    own = sorted({c.fixed_seq_len for c in everyone if c.fixed_seq_len is not None})
    if seq_len in own:
        return Lookup(
            here=tuple(c for c in found.here if c.fixed_seq_len == seq_len),
            elsewhere=tuple(c for c in found.elsewhere if c.fixed_seq_len == seq_len),
            skipped=found.skipped,
        )
    if own:
        lengths = ", ".join(map(str, own))
        raise NoProfileForSuggestion(
            f"no profile of fingerprint {fingerprint} at seq_len {seq_len} on {device_name!r}: its task's length is "
            f"fixed at {lengths} (the tag seq_len; the fingerprint holds its samples' shapes), so a job at {seq_len} "
            f"is another job, never measured: ask at seq_len {lengths}, or probe the job at its own length (a "
            f"sequence-aware task, batch(m, seq_len=L), at --seq-len {seq_len})",
            field="seq_len",
            details={"measured_lengths": own, "covered": []},
        )
    raise InvalidPlanRequest(
        f"seq_len {seq_len}: fingerprint {fingerprint} is not sequence-aware and records no length (its task has "
        "no seq_len tag; the fingerprint holds its samples' shapes), so no answer can say it holds at "
        f"{seq_len}: ask without seq_len (the plan in sequences), or probe a sequence-aware task (batch(m, "
        f"seq_len=L)) at --seq-len {seq_len}",
        field="seq_len",
    )


def _covers(c: Candidate, seq_len: int) -> bool:
    surface = c.surface
    if not surface:
        return False
    low, high = surface.get("covered", (0, 0))
    return int(low) <= seq_len <= int(high)


def covering(found: Lookup, seq_len: int) -> tuple[Candidate, ...]:
    """The profiles on this device model whose surface covers seq_len, newest first (the lookup's
    order), as candidates at seq_len: what ``compute`` ranks when nothing was measured there."""
    return tuple(replace(c, seq_len=seq_len, trials=()) for c in found.here if _covers(c, seq_len))


def surface_max(c: Candidate, seq_len: int, limit_bytes: float) -> int:
    """m_max at seq_len within limit_bytes by c's surface, raised by what the device's real trials
    showed above it; 0 where not even multiple_of fits."""
    assert c.surface is not None
    offset = int(c.surface.get("offset_bytes", 0))
    surface = PeakSurface.from_dict(c.surface)
    return surface.max_fitting(int(limit_bytes) - offset, seq_len, cap=c.micro_batch_cap, multiple_of=c.multiple_of)


def surface_peak(c: Candidate, micro_batch: int, seq_len: int) -> int:
    """The peak c's surface predicts at (micro_batch, seq_len), with the device's offset."""
    assert c.surface is not None
    return PeakSurface.from_dict(c.surface).peak_bytes(micro_batch, seq_len) + int(c.surface.get("offset_bytes", 0))


def not_measured(found: Lookup, seq_len: int, *, fingerprint: str, device_name: str) -> NoProfileForSuggestion:
    """The 404 for a length nobody measured and no surface covers."""
    lengths = measured_lengths(found)
    ranges = sorted(
        {
            (int(c.surface["covered"][0]), int(c.surface["covered"][1]))
            for c in _candidates(found)
            if c.surface and c.device_name == device_name
        }
    )
    covered = "; the surfaces cover " + ", ".join(f"{lo}..{hi}" for lo, hi in ranges) if ranges else ""
    return NoProfileForSuggestion(
        f"no profile of fingerprint {fingerprint} at seq_len {seq_len} on {device_name!r}: measured at seq_len "
        f"{', '.join(map(str, lengths))}{covered}; probe it with --seq-len {seq_len}",
        field="seq_len",
        details={"measured_lengths": lengths, "covered": [list(r) for r in ranges]},
    )


def target_batch_for(
    target_batch: int | None, target_tokens: int | None, seq_len: int | None, world_size: int
) -> tuple[int, str | None]:
    """The target in sequences: target_batch, or target_tokens over seq_len (with what to say where
    they do not divide evenly), as ``autotune.core.plan.target_in_sequences`` decides it.

    Raises:
        InvalidPlanRequest: neither or both given, or tokens without a length (422 naming the field).
    """
    try:
        batch, note = target_in_sequences(target_batch, target_tokens, seq_len, world_size)
    except TargetError as exc:
        raise InvalidPlanRequest(str(exc), field=exc.field) from None
    assert batch is not None  # required
    return batch, note
