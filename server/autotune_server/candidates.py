"""The /suggest read model: what the database says about a (fingerprint, device), as plain values.

``lookup`` reads the newest profile of each kind on the device with its deciding trials, and the
fingerprint's profiles on other devices with their fits, in a few small indexed queries and no ORM
objects; ``autotune_server.suggest.compute`` is pure arithmetic on the ``Lookup`` it returns.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, and_, func, select

from autotune.core.loss_names import LOSS_TAG, PLAIN_LOSS
from autotune.core.mesh import Mesh
from autotune.core.schemas import DeviceContext, Fit, SingleStep, Throughput
from autotune.core.setup import JobSetup
from autotune_server.models import ObservationRow, ProfileRow, TrialRow
from autotune_server.repository import deciding_trial, device_context, major_minor

__all__ = ["Candidate", "Lookup", "lookup"]


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
    # The length a setup that is not sequence-aware was measured at, where its task says it (the tag seq_len, as
    # ProbeTask's docs and examples/gpt.py write it); None: not said (or sequence-aware: ``seq_len``).
    fixed_seq_len: int | None = None
    # (micro_batch, peak_bytes) of the jobs' observations that reported a peak and no OOM, newest
    # first (at most _OBSERVED_LIMIT per lookup): the drift's evidence (autotune_server.drift).
    observed: tuple[tuple[int, int], ...] = ()
    # The memory outside the caching allocator each deciding trial records, in the order of ``trials``
    # (None where a trial has none): for an estimate of a CUDA card, the figure it assumed.
    outside_allocator_bytes: tuple[int | None, ...] = ()
    # For an estimate of a CUDA card that assumed that figure: what measured profiles of the card hold
    # outside the allocator (``repository.device_context``), which /suggest re-derives the estimate with
    # (autotune_server.measured_context); None otherwise, or where nothing is measured.
    measured_context: DeviceContext | None = None
    # A = 1 (Profile.single_step, read from the stored document; no column of its own): the single step's m_max
    # and its own trials as (micro_batch, peak_bytes, fits, oom); None and () where the profile has none.
    single_step_max: int | None = None
    single_step_trials: tuple[tuple[int, int, bool, bool], ...] = ()
    # The whole setup the figures were measured under (autotune/core/setup.py): its mesh gives the plan's D and
    # a pipeline's K bounds, its host budget and offload which jobs it answers.
    # None: the plain setup of ``strategy`` at ``world_size`` (filled in after init).
    setup: JobSetup = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.setup is None:
            plain = JobSetup(strategy="fsdp" if self.strategy == "fsdp" else "ddp", world_size=self.world_size)
            object.__setattr__(self, "setup", plain)

    @property
    def uses_ddp(self) -> bool:
        """Whether each rank held DDP's gradient buckets (ddp over more than one replica, or the cp ranks)."""
        return self.setup.holds_ddp_buckets

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
# Profile.single_step lives in the stored document only (a JSON path, on SQLite and PostgreSQL alike): read for
# the profiles of the device asked about, whose own trials a one-step plan rests on.
_SINGLE_STEP = ProfileRow.document["single_step"].label("single_step")
# The setup's fields that live in the stored document only (the mesh, offload and host budget, the compile tag).
_SETUP_COLUMNS = (
    ProfileRow.document["mesh"].label("mesh"),
    ProfileRow.document["offload"].as_string().label("offload"),
    ProfileRow.document["host_budget_bytes"].as_string().label("host_budget"),
    ProfileRow.tags,
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
        setup=_setup(row),
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
        fixed_seq_len=_tagged_length(row.tags),
        **extra,
    )


def _tagged_length(tags: Any) -> int | None:
    """The tag seq_len of a stored profile, where it is a positive integer (tags are free-form)."""
    value = tags.get("seq_len") if isinstance(tags, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _setup(row: Any) -> JobSetup:
    """The profile's setup from its columns and stored document (validated on upload; a row written by hand whose
    setup does not parse reads as the plain setup of its strategy and world size)."""
    offload = row.offload if row.offload in ("activations", "params") else None
    tags = row.tags if isinstance(row.tags, dict) else {}
    compiled = tags.get("compile")
    try:
        return JobSetup(
            strategy=row.strategy,
            world_size=int(row.world_size),
            mesh=Mesh.from_dict(row.mesh if isinstance(row.mesh, dict) else None),
            activation_checkpointing=str(row.activation_checkpointing or "none"),
            compile=None if compiled is None else str(compiled),
            compiled_measured=row.source == "measured",
            offload=offload,
            host_budget_bytes=int(row.host_budget) if row.host_budget is not None and offload is not None else None,
            seq_len=None if row.seq_len is None else int(row.seq_len),
            lm_loss=str(tags.get(LOSS_TAG, PLAIN_LOSS)),
        )
    except (ValueError, TypeError):
        return JobSetup(strategy="fsdp" if row.strategy == "fsdp" else "ddp", world_size=max(1, int(row.world_size)))


def _throughput(value: Any) -> tuple[Throughput, ...]:
    # Validated on upload; a row written by hand that does not parse is simply not timed.
    try:
        return tuple(Throughput.model_validate(t) for t in value or ())
    except (ValueError, TypeError):
        return ()


def _single_step(value: Any) -> dict[str, Any]:
    """Candidate's single-step fields from the stored Profile.single_step (validated on upload; a row written by
    hand that does not parse simply has none)."""
    if not value:
        return {}
    try:
        single = SingleStep.model_validate(value)
    except (ValueError, TypeError):
        return {}
    return {
        "single_step_max": single.max_micro_batch,
        "single_step_trials": tuple((t.micro_batch, t.peak_bytes, t.fits, t.oom) for t in single.trials if not t.fake),
    }


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
        version = major_minor(row.torch_version) if row.torch_version else None
        context = (measured(version) if version else None) or measured(None)
        if context is not None:
            found[int(row.id)] = context
    return found


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
    # One of each world size and host budget: whether a ddp profile held DDP's buckets depends on D, which the
    # mesh (in the document) decides, so suggest.compute ranks the world sizes by their setups (newest first at
    # equal rank); a host-capped profile never stands in for an uncapped one of the same fingerprint.
    host_budget = ProfileRow.document["host_budget_bytes"].as_string()
    ranked = (
        select(
            *_COLUMNS,
            *_SETUP_COLUMNS,
            _SINGLE_STEP,
            oom_at.label("oom_at"),
            func.row_number()
            .over(
                # One of each kind per length too: every measured length of a sequence-aware setup answers.
                partition_by=(
                    ProfileRow.source,
                    ProfileRow.strategy,
                    ProfileRow.world_size,
                    host_budget,
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
                    **_single_step(row.single_step),
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
        select(*_COLUMNS, *_SETUP_COLUMNS, func.coalesce(step_floor, smallest_peak).label("smallest_peak"))
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
