"""Every query the service runs: a session in, ORM rows (or plain values) out.

Routes stay thin and never build queries themselves; conversion to wire models lives in
``convert.py``. Writes commit here, so a route never has a half-finished transaction.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, case, delete, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from autotune.core.schemas import DeviceContext, Fit, Observation, Profile, Throughput
from autotune_server.errors import InvalidCursor, ProfileNotFound
from autotune_server.models import ObservationRow, ProfileRow, TrialRow, utcnow
from autotune_server.wire import content_hash

__all__ = [
    "Candidate",
    "Lookup",
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
    "lookup",
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
        query = query.where(ProfileRow.fingerprint == filters.fingerprint)
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


def _major_minor(version: str) -> str:
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
    wanted = _major_minor(torch_version) if torch_version else None
    figures: list[int] = []
    # profile id -> (rank, outside bytes) of its decisive trial so far: fitting beats not, then larger m
    decisive: dict[int, tuple[tuple[bool, int], int]] = {}
    for outside, micro_batch, fits, pid, version in rows:
        if outside is None or (wanted is not None and (version is None or _major_minor(version) != wanted)):
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


@dataclass(frozen=True)
class Candidate:
    """The columns of a profile that a suggestion needs."""

    id: int
    fingerprint: str
    device_name: str
    budget_bytes: int
    headroom: float
    max_micro_batch: int
    micro_batch_cap: int
    multiple_of: int
    fit: Fit | None
    # The world size the probe ran with: for ddp, D (D > 1: DDP's gradient buckets were counted);
    # for fsdp, the N ranks that shared the model (the figures are one rank's of N).
    world_size: int = 1
    strategy: str = "ddp"
    # "measured" (real trials on the device) or "estimate" (fake-tensor trials only).
    source: str = "measured"
    # (micro_batch, peak_bytes, fits, oom) of every deciding trial (Profile.deciding_trials: the real
    # ones of a measurement, the fake ones of an estimate); empty for profiles of other devices.
    trials: tuple[tuple[int, int, bool, bool], ...] = ()
    oom_at: int | None = None
    # The floor of every predicted peak: the optimizer step's phase (weights, gradients, optimizer
    # state and the step's temporaries, flat in m) as the deciding trials recorded it; for profiles
    # from before it was recorded, the whole peak of the smallest measured deciding micro-batch, an
    # upper bound of it. ``fit`` is of the forward/backward peaks only and does not see that phase.
    smallest_peak: int | None = None
    # The memory policy the profile was measured under, and its timed runs (objective=throughput).
    activation_checkpointing: str = "none"
    throughput: tuple[Throughput, ...] = ()
    # A sequence-aware setup's length (None otherwise), and the surface its probe measured over lengths
    # (the wire form of autotune.core.schemas.Surface), from which other lengths are predicted.
    seq_len: int | None = None
    surface: dict[str, Any] | None = None
    # (micro_batch, peak_bytes) of the jobs' observations that reported a peak and no OOM, newest
    # first (at most _OBSERVED_LIMIT per lookup): the drift's evidence (autotune_server.drift).
    observed: tuple[tuple[int, int], ...] = ()
    # The memory outside the caching allocator each deciding trial records, in the order of ``trials``
    # (None where a trial has none): for an estimate of a CUDA card, the figure it assumed.
    outside_allocator_bytes: tuple[int | None, ...] = ()
    # For an estimate of a CUDA card that assumed that figure: what measured profiles of the card hold
    # outside the allocator (``device_context``), which /suggest re-derives the estimate with
    # (autotune_server.measured_context); None otherwise, or where nothing is measured.
    measured_context: DeviceContext | None = None

    @property
    def uses_ddp(self) -> bool:
        """Whether the probe wrapped the model in DDP (strategy ddp at world size > 1)."""
        return self.strategy == "ddp" and self.world_size > 1

    @property
    def estimate(self) -> bool:
        """Whether the figures are fake-tensor estimates rather than measurements on the device."""
        return self.source == "estimate"


@dataclass(frozen=True)
class Lookup:
    """What the database says about a (fingerprint, device).

    ``here``: the newest profile on this device model of each kind, newest first. A kind is a
    source (measured, estimate) with a strategy and, for ddp, world size 1 or > 1 (with or without
    DDP's buckets), for fsdp each world size (one rank's memory depends on N), under one memory
    policy (activation checkpointing: autotune_server.policy picks among them). ``elsewhere``: the
    newest profiles of the fingerprint on other device models (their fits, without trials).
    ``suggest.compute`` decides which one answers a job. ``skipped``: the ids of profiles left out
    of it (``without``), for the answer's warnings.
    """

    here: tuple[Candidate, ...]
    elsewhere: tuple[Candidate, ...]
    skipped: tuple[int, ...] = ()

    def ids(self) -> set[int]:
        """The ids of every candidate, here and elsewhere."""
        return {c.id for c in (*self.here, *self.elsewhere)}

    def without(self, *, excluded: set[int]) -> Lookup:
        """This lookup less the candidates in ``excluded``, which ``skipped`` then names too."""
        return Lookup(
            here=tuple(c for c in self.here if c.id not in excluded),
            elsewhere=tuple(c for c in self.elsewhere if c.id not in excluded),
            skipped=tuple(sorted(set(self.skipped) | excluded)),
        )


_COLUMNS = (
    ProfileRow.id,
    ProfileRow.fingerprint,
    ProfileRow.device_name,
    ProfileRow.budget_bytes,
    ProfileRow.headroom,
    ProfileRow.max_micro_batch,
    ProfileRow.micro_batch_cap,
    ProfileRow.multiple_of,
    ProfileRow.fit_fixed_bytes,
    ProfileRow.fit_bytes_per_sample,
    ProfileRow.world_size,
    ProfileRow.strategy,
    ProfileRow.source,
    ProfileRow.activation_checkpointing,
    ProfileRow.throughput,
    ProfileRow.seq_len,
    ProfileRow.surface,
    ProfileRow.created_at,
    ProfileRow.device_kind,
    ProfileRow.torch_version,
)
# At most this many kinds of profile of one (fingerprint, device) are read per lookup.
_HERE_LIMIT = 64


def _candidate(row: Any, **extra: Any) -> Candidate:
    fixed, per_sample = row.fit_fixed_bytes, row.fit_bytes_per_sample
    fit = (
        Fit(fixed_bytes=float(fixed), bytes_per_sample=float(per_sample))
        if fixed is not None and per_sample is not None
        else None
    )
    return Candidate(
        id=int(row.id),
        fingerprint=str(row.fingerprint),
        device_name=str(row.device_name),
        budget_bytes=int(row.budget_bytes),
        headroom=float(row.headroom),
        max_micro_batch=int(row.max_micro_batch),
        micro_batch_cap=int(row.micro_batch_cap),
        multiple_of=int(row.multiple_of),
        fit=fit,
        world_size=int(row.world_size),
        strategy=str(row.strategy),
        source=str(row.source),
        activation_checkpointing=str(row.activation_checkpointing or "none"),
        throughput=_throughput(row.throughput),
        seq_len=None if row.seq_len is None else int(row.seq_len),
        surface=row.surface if isinstance(row.surface, dict) else None,
        **extra,
    )


def _throughput(value: Any) -> tuple[Throughput, ...]:
    # Validated on upload; a row written by hand that does not parse is simply not timed.
    try:
        return tuple(Throughput.model_validate(t) for t in value or ())
    except (ValueError, TypeError):
        return ()


def _smallest_peak(trials: tuple[tuple[int, int, bool, bool], ...]) -> int | None:
    measured = [(m, -peak) for m, peak, _fits, oom in trials if not oom]
    return -min(measured)[1] if measured else None


# The newest observations read per lookup, over all its profiles: enough for the drift's quantile,
# bounded for a profile that a fleet reports against for months.
_OBSERVED_LIMIT = 2000


def _observed(conn: Connection, profile_ids: list[int]) -> dict[int, list[tuple[int, int]]]:
    """(micro_batch, peak_bytes) of the peaks jobs reported against these profiles, newest first."""
    found: dict[int, list[tuple[int, int]]] = {}
    for pid, m, peak in conn.execute(
        select(ObservationRow.profile_id, ObservationRow.micro_batch, ObservationRow.peak_bytes)
        .where(
            ObservationRow.profile_id.in_(profile_ids),
            ObservationRow.oom.is_(False),
            ObservationRow.peak_bytes.is_not(None),
        )
        .order_by(ObservationRow.id.desc())
        .limit(_OBSERVED_LIMIT)
    ):
        if peak is not None:  # filtered above; the column is nullable
            found.setdefault(int(pid), []).append((int(m), int(peak)))
    return found


def _assumes_context(row: Any, outside: list[int | None]) -> bool:
    """Whether a profile is an estimate of a CUDA card whose trials assumed a figure outside the allocator."""
    return row.source == "estimate" and row.device_kind == "cuda" and any(o is not None for o in outside)


def _measured_contexts(
    conn: Connection, device_name: str, rows: Collection[Any], outside: dict[int, list[int | None]]
) -> dict[int, DeviceContext]:
    """profile id -> what measured profiles of device_name hold outside the allocator, for each estimate
    among rows that assumed a figure there: measured with its torch's major.minor where there are such
    (modules differ between versions), else with any torch; one query per version."""
    by_version: dict[str | None, DeviceContext | None] = {}

    def measured(version: str | None) -> DeviceContext | None:
        if version not in by_version:
            by_version[version] = device_context(conn, device_name, version)
        return by_version[version]

    found: dict[int, DeviceContext] = {}
    for row in rows:
        if not _assumes_context(row, outside[int(row.id)]):
            continue
        version = _major_minor(row.torch_version) if row.torch_version else None
        context = (measured(version) if version else None) or measured(None)
        if context is not None:
            found[int(row.id)] = context
    return found


def deciding_trial() -> ColumnElement[bool]:
    """``Profile.deciding_trials`` as a condition on a trial correlated to its profile: an
    estimate's answer rests on its fake trials, a measurement's on its real ones (fake pre-search
    points only guided the search)."""
    estimate = ProfileRow.source == "estimate"
    return or_(and_(estimate, TrialRow.fake.is_(True)), and_(~estimate, TrialRow.fake.is_(False)))


def lookup(
    conn: Connection,
    fingerprint: str,
    device_name: str,
    *,
    exclude_ids: Collection[int] = (),
    elsewhere_limit: int = 50,
) -> Lookup:
    """Read the newest profiles of a fingerprint on a device, one of each kind (see :class:`Lookup`),
    with their deciding trials, and its newest profiles on other devices; profiles whose ids are in
    ``exclude_ids`` are passed over (the next newest of their kind takes their place)."""
    excluded = [ProfileRow.id.not_in(list(exclude_ids))] if exclude_ids else []
    oom_at = (
        select(func.min(ObservationRow.micro_batch))
        .where(and_(ObservationRow.profile_id == ProfileRow.id, ObservationRow.oom.is_(True)))
        .scalar_subquery()
    )
    # ddp: world size 1 (-1) or DDP (-2); fsdp: each world size (>= 1) is a kind of its own.
    kind = case(
        (ProfileRow.strategy == "fsdp", ProfileRow.world_size),
        (ProfileRow.world_size > 1, -2),
        else_=-1,
    )
    ranked = (
        select(
            *_COLUMNS,
            oom_at.label("oom_at"),
            func.row_number()
            .over(
                # One of each kind per length too: every measured length of a sequence-aware setup answers.
                partition_by=(
                    ProfileRow.source,
                    ProfileRow.strategy,
                    kind,
                    ProfileRow.activation_checkpointing,
                    ProfileRow.seq_len,
                ),
                order_by=(ProfileRow.created_at.desc(), ProfileRow.id.desc()),
            )
            .label("newest"),
        )
        .where(ProfileRow.fingerprint == fingerprint, ProfileRow.device_name == device_name, *excluded)
        .subquery()
    )
    newest = conn.execute(
        select(ranked)
        .where(ranked.c.newest == 1)
        .order_by(ranked.c.created_at.desc(), ranked.c.id.desc())
        .limit(_HERE_LIMIT)
    ).all()
    here: list[Candidate] = []
    if newest:
        estimates = {int(row.id) for row in newest if row.source == "estimate"}
        trials: dict[int, list[tuple[int, int, bool, bool]]] = {int(row.id): [] for row in newest}
        steps: dict[int, list[int]] = {int(row.id): [] for row in newest}
        outside: dict[int, list[int | None]] = {int(row.id): [] for row in newest}
        for pid, m, peak, fits, oom, fake, step, out in conn.execute(
            select(
                TrialRow.profile_id,
                TrialRow.micro_batch,
                TrialRow.peak_bytes,
                TrialRow.fits,
                TrialRow.oom,
                TrialRow.fake,
                TrialRow.step_bytes,
                TrialRow.outside_allocator_bytes,
            )
            .where(TrialRow.profile_id.in_(list(trials)))
            .order_by(TrialRow.profile_id, TrialRow.position)
        ):
            if bool(fake) == (int(pid) in estimates):
                trials[int(pid)].append((int(m), int(peak), bool(fits), bool(oom)))
                outside[int(pid)].append(None if out is None else int(out))
                if step is not None and not oom:
                    steps[int(pid)].append(int(step))
        observed = _observed(conn, list(trials))
        contexts = _measured_contexts(conn, device_name, newest, outside)
        for row in newest:
            deciding = tuple(trials[int(row.id)])
            here.append(
                _candidate(
                    row,
                    trials=deciding,
                    observed=tuple(observed.get(int(row.id), ())),
                    oom_at=None if row.oom_at is None else int(row.oom_at),
                    smallest_peak=max(steps[int(row.id)]) if steps[int(row.id)] else _smallest_peak(deciding),
                    outside_allocator_bytes=tuple(outside[int(row.id)]),
                    measured_context=contexts.get(int(row.id)),
                )
            )
    # The whole peak of each profile's smallest measured deciding micro-batch (larger on a tie).
    smallest_peak = (
        select(TrialRow.peak_bytes)
        .where(TrialRow.profile_id == ProfileRow.id, TrialRow.oom.is_(False), deciding_trial())
        .order_by(TrialRow.micro_batch, TrialRow.peak_bytes.desc())
        .limit(1)
        .correlate(ProfileRow)
        .scalar_subquery()
    )
    # The optimizer step's peak where the trials recorded it (flat in m; exact at any m).
    step_floor = (
        select(func.max(TrialRow.step_bytes))
        .where(
            TrialRow.profile_id == ProfileRow.id,
            TrialRow.oom.is_(False),
            TrialRow.step_bytes.is_not(None),
            deciding_trial(),
        )
        .correlate(ProfileRow)
        .scalar_subquery()
    )
    others = conn.execute(
        select(*_COLUMNS, func.coalesce(step_floor, smallest_peak).label("smallest_peak"))
        .where(ProfileRow.fingerprint == fingerprint, ProfileRow.device_name != device_name, *excluded)
        .order_by(ProfileRow.created_at.desc(), ProfileRow.id.desc())
        .limit(elsewhere_limit)
    ).all()
    return Lookup(
        here=tuple(here),
        elsewhere=tuple(
            _candidate(r, smallest_peak=None if r.smallest_peak is None else int(r.smallest_peak)) for r in others
        ),
    )
