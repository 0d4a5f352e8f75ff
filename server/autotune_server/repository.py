"""The store's reads and writes: a session in, ORM rows (or plain values) out.

Routes stay thin and never build queries themselves; conversion to wire models lives in
``convert.py``. Writes commit here, so a route never has a half-finished transaction. The read model
/suggest answers from (``Candidate``, ``Lookup``, ``lookup``) is ``autotune_server.candidates``.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import ColumnElement, Connection, and_, delete, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from autotune.core.schemas import DeviceContext, Observation, Profile
from autotune_server.errors import InvalidCursor, ProfileNotFound
from autotune_server.models import ObservationRow, ProfileRow, TrialRow, utcnow
from autotune_server.wire import content_hash

__all__ = [
    "ProfileFilters",
    "add_observation",
    "add_profile",
    "count_profiles",
    "deciding_trial",
    "decode_cursor",
    "delete_profile",
    "device_context",
    "encode_cursor",
    "get_profile",
    "list_observations",
    "list_profiles",
    "major_minor",
    "newest_profile",
    "observation_count",
    "to_utc",
]


def to_utc(value: datetime) -> datetime:
    """Aware UTC datetime; a naive one is taken as UTC (SQLite hands timestamps back naive)."""
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


def _naive_utc(value: datetime) -> datetime:
    # SQLite's DateTime drops the offset without converting, so store everything as UTC wall time.
    return to_utc(value).replace(tzinfo=None)


def _profile_row(profile: Profile, digest: str, uploader: str | None) -> ProfileRow:
    row = ProfileRow(
        content_hash=digest,
        schema_version=profile.schema_version,
        fingerprint=profile.fingerprint,
        task=profile.task,
        device_kind=profile.device.kind,
        device_name=profile.device.name,
        device=profile.device.model_dump(mode="json"),
        devices=[d.model_dump(mode="json") for d in profile.devices],
        precision=profile.precision,
        tags=profile.model_dump(mode="json", include={"tags"})["tags"],
        budget_bytes=profile.budget_bytes,
        headroom=profile.headroom,
        max_micro_batch=profile.max_micro_batch,
        micro_batch_cap=profile.micro_batch_cap,
        multiple_of=profile.multiple_of,
        world_size=profile.world_size,
        strategy=profile.strategy,
        source=profile.source,
        non_monotone=profile.non_monotone,
        plan=profile.plan.model_dump(mode="json") if profile.plan is not None else None,
        activation_checkpointing=profile.activation_checkpointing,
        throughput=[t.model_dump(mode="json") for t in profile.throughput] if profile.throughput else None,
        seq_len=profile.seq_len,
        surface=profile.surface.model_dump(mode="json") if profile.surface is not None else None,
        fit_fixed_bytes=profile.fit.fixed_bytes if profile.fit is not None else None,
        fit_bytes_per_sample=profile.fit.bytes_per_sample if profile.fit is not None else None,
        trial_count=profile.trial_count,
        oom_count=profile.oom_count,
        seconds=profile.seconds,
        warnings=list(profile.warnings),
        torch_version=profile.torch_version,
        autotune_version=profile.autotune_version,
        created_at=_naive_utc(profile.created_at),
        uploaded_at=_naive_utc(utcnow()),
        uploader=uploader,
        document=profile.model_dump(mode="json"),
    )
    row.trials = [
        TrialRow(
            position=i,
            micro_batch=t.micro_batch,
            peak_bytes=t.peak_bytes,
            fits=t.fits,
            oom=t.oom,
            seconds=t.seconds,
            forward_backward_bytes=t.forward_backward_bytes,
            step_bytes=t.step_bytes,
            allocated_bytes=t.allocated_bytes,
            outside_allocator_bytes=t.outside_allocator_bytes,
            fake=t.fake,
        )
        for i, t in enumerate(profile.trials)
    ]
    return row


def _by_hash(session: Session, digest: str) -> ProfileRow | None:
    return session.scalars(select(ProfileRow).where(ProfileRow.content_hash == digest)).one_or_none()


def add_profile(session: Session, profile: Profile, *, uploader: str | None) -> tuple[ProfileRow, bool]:
    """Store a profile unless one with the same content hash exists.

    Returns:
        (row, created): created is False when an identical profile was already stored.

    The look-up first is only a fast path: two uploads of the same body can both miss it, and then
    the unique index on content_hash lets one insert win and the other's IntegrityError is read as
    "already stored". That keeps uploads idempotent across threads, workers and server processes.
    """
    digest = content_hash(profile)
    existing = _by_hash(session, digest)
    if existing is not None:
        return existing, False
    # Close the read's transaction so the insert starts a fresh one (matters for SQLite's locking).
    session.rollback()
    row = _profile_row(profile, digest, uploader)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        existing = _by_hash(session, digest)
        if existing is None:  # a different constraint failed: that is a real error
            raise
        return existing, False
    return row, True


def get_profile(session: Session, profile_id: int) -> ProfileRow:
    """The profile with this id.

    Raises:
        ProfileNotFound: no such id.
    """
    row = session.get(ProfileRow, profile_id)
    if row is None:
        raise ProfileNotFound(f"no profile with id {profile_id}", field="profile_id")
    return row


def delete_profile(session: Session, profile_id: int) -> None:
    """Delete a profile with its trials and observations.

    Raises:
        ProfileNotFound: no such id (deleting twice is a 404 the second time).
    """
    # Explicit child deletes first: correct even where a connection lacks SQLite's foreign_keys pragma.
    session.execute(delete(TrialRow).where(TrialRow.profile_id == profile_id))
    session.execute(delete(ObservationRow).where(ObservationRow.profile_id == profile_id))
    result = session.execute(delete(ProfileRow).where(ProfileRow.id == profile_id))
    if result.rowcount == 0:  # type: ignore[attr-defined]
        session.rollback()
        raise ProfileNotFound(f"no profile with id {profile_id}", field="profile_id")
    session.commit()


@dataclass(frozen=True)
class ProfileFilters:
    """Equality filters of GET /profiles; None means "any"."""

    fingerprint: str | None = None
    task: str | None = None
    device_name: str | None = None
    precision: str | None = None
    strategy: str | None = None
    world_size: int | None = None
    source: str | None = None
    activation_checkpointing: str | None = None
    seq_len: int | None = None


_CURSOR_PREFIX = "p1:"


def encode_cursor(last_id: int) -> str:
    """An opaque cursor: the id of the last item on the page (pages go newest upload first)."""
    return base64.urlsafe_b64encode(f"{_CURSOR_PREFIX}{last_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    """The id a cursor stands for.

    Raises:
        InvalidCursor: not a cursor this server handed out.
    """
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        text = base64.urlsafe_b64decode(padded.encode("ascii")).decode("ascii")
        if not text.startswith(_CURSOR_PREFIX):
            raise ValueError(text)
        value = int(text[len(_CURSOR_PREFIX) :])
        if value < 0:
            raise ValueError(text)
        return value
    except (ValueError, UnicodeError, binascii.Error):
        raise InvalidCursor("cursor is not one this server handed out", field="cursor") from None


def list_profiles(
    session: Session, filters: ProfileFilters, *, limit: int, before_id: int | None
) -> tuple[list[ProfileRow], int | None]:
    """A page of profiles, newest upload first.

    Returns:
        (rows, next_before_id): next_before_id is None on the last page.
    """
    query = select(ProfileRow)
    if filters.fingerprint is not None:
        # The whole fingerprint, or its start as listings show it (autotune_server.fingerprints).
        query = query.where(ProfileRow.fingerprint.startswith(filters.fingerprint, autoescape=True))
    if filters.task is not None:
        query = query.where(ProfileRow.task == filters.task)
    if filters.device_name is not None:
        query = query.where(ProfileRow.device_name == filters.device_name)
    if filters.precision is not None:
        query = query.where(ProfileRow.precision == filters.precision)
    if filters.strategy is not None:
        query = query.where(ProfileRow.strategy == filters.strategy)
    if filters.world_size is not None:
        query = query.where(ProfileRow.world_size == filters.world_size)
    if filters.source is not None:
        query = query.where(ProfileRow.source == filters.source)
    if filters.activation_checkpointing is not None:
        query = query.where(ProfileRow.activation_checkpointing == filters.activation_checkpointing)
    if filters.seq_len is not None:
        query = query.where(ProfileRow.seq_len == filters.seq_len)
    if before_id is not None:
        query = query.where(ProfileRow.id < before_id)
    # One extra row tells whether there is a next page without a count query.
    rows = list(session.scalars(query.order_by(ProfileRow.id.desc()).limit(limit + 1)))
    if len(rows) > limit:
        return rows[:limit], rows[limit - 1].id
    return rows, None


def newest_profile(session: Session, fingerprint: str, device_name: str) -> ProfileRow | None:
    """The most recently measured profile of a fingerprint on a device model."""
    query = (
        select(ProfileRow)
        .where(ProfileRow.fingerprint == fingerprint, ProfileRow.device_name == device_name)
        .order_by(ProfileRow.created_at.desc(), ProfileRow.id.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def add_observation(
    session: Session, profile_id: int, observation: Observation, *, uploader: str | None
) -> ObservationRow:
    """Record a job's observation against a stored profile.

    Raises:
        ProfileNotFound: no such profile.
    """
    get_profile(session, profile_id)
    session.rollback()
    row = ObservationRow(
        profile_id=profile_id,
        micro_batch=observation.micro_batch,
        peak_bytes=observation.peak_bytes,
        oom=observation.oom,
        world_size=observation.world_size,
        note=observation.note,
        created_at=_naive_utc(utcnow()),
        uploader=uploader,
    )
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        # The profile was deleted between the check and the insert (PostgreSQL enforces the key).
        session.rollback()
        raise ProfileNotFound(f"no profile with id {profile_id}", field="profile_id") from None
    return row


def list_observations(session: Session, profile_id: int) -> list[ObservationRow]:
    """The observations of a profile, oldest first.

    Raises:
        ProfileNotFound: no such profile.
    """
    get_profile(session, profile_id)
    query = select(ObservationRow).where(ObservationRow.profile_id == profile_id).order_by(ObservationRow.id)
    return list(session.scalars(query))


def observation_count(session: Session, profile_id: int) -> int:
    """How many observations a profile has."""
    query = select(func.count()).select_from(ObservationRow).where(ObservationRow.profile_id == profile_id)
    return int(session.scalar(query) or 0)


# The newest trials a device's context is read from: enough for a median, bounded for a large store.
CONTEXT_TRIALS = 10_000


def major_minor(version: str) -> str:
    """A torch version's major.minor ("2.5.1+cu121" -> "2.5"), which a card's measured context is kept by."""
    return ".".join(version.split("+")[0].split(".")[:2])


def device_context(
    session: Session | Connection, device_name: str, torch_version: str | None = None
) -> DeviceContext | None:
    """The memory outside the allocator that measured CUDA profiles of device_name record (real trials
    only: a fake trial's figure is an estimate's assumption), with torch_version's major.minor where given;
    None where none does.

    The figure is the lower median, over profiles, of each profile's decisive trial: the fitting trial at
    its largest micro-batch (where none fitted, its smallest). A process's memory outside the allocator
    grows as it loads the kernels of larger shapes (CUDA loads modules lazily: on the H200, 742 MiB at
    m = 1, 876 MiB from m = 1195 on, in one probe), and the figure at the boundary is the one that decides
    an answer. ``low_bytes`` and ``high_bytes`` span every real trial read.
    """
    rows = session.execute(
        select(
            TrialRow.outside_allocator_bytes,
            TrialRow.micro_batch,
            TrialRow.fits,
            ProfileRow.id,
            ProfileRow.torch_version,
        )
        .join(ProfileRow, TrialRow.profile_id == ProfileRow.id)
        .where(
            ProfileRow.device_name == device_name,
            ProfileRow.device_kind == "cuda",
            ProfileRow.source == "measured",
            TrialRow.fake.is_(False),
            TrialRow.outside_allocator_bytes.is_not(None),
        )
        .order_by(ProfileRow.id.desc(), TrialRow.position)
        .limit(CONTEXT_TRIALS)
    ).all()
    wanted = major_minor(torch_version) if torch_version else None
    figures: list[int] = []
    # profile id -> (rank, outside bytes) of its decisive trial so far: fitting beats not, then larger m
    decisive: dict[int, tuple[tuple[bool, int], int]] = {}
    for outside, micro_batch, fits, pid, version in rows:
        if outside is None or (wanted is not None and (version is None or major_minor(version) != wanted)):
            continue
        figures.append(int(outside))
        rank = (bool(fits), int(micro_batch) if fits else -int(micro_batch))
        if pid not in decisive or rank >= decisive[pid][0]:
            decisive[pid] = (rank, int(outside))
    if not figures:
        return None
    figures.sort()
    per_profile = sorted(outside for _, outside in decisive.values())
    return DeviceContext(
        device_name=device_name,
        torch_version=wanted,
        outside_allocator_bytes=per_profile[(len(per_profile) - 1) // 2],  # the lower median: a figure read
        low_bytes=figures[0],
        high_bytes=figures[-1],
        trials=len(figures),
        profiles=len(per_profile),
    )


def count_profiles(session: Session) -> int:
    """How many profiles are stored (for /metrics)."""
    return int(session.scalar(select(func.count()).select_from(ProfileRow)) or 0)


def deciding_trial() -> ColumnElement[bool]:
    """``Profile.deciding_trials`` as a condition on a trial correlated to its profile: an
    estimate's answer rests on its fake trials, a measurement's on its real ones (fake pre-search
    points only guided the search)."""
    estimate = ProfileRow.source == "estimate"
    return or_(and_(estimate, TrialRow.fake.is_(True)), and_(~estimate, TrialRow.fake.is_(False)))
