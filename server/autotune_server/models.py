"""SQLAlchemy 2 typed models: profiles, their trials (rows of their own) and observations.

Alembic's migrations are the schema of record; these models must match them exactly (a test runs
autogenerate's comparison on SQLite and PostgreSQL). Constraint names come from the naming
convention so that both databases get the same, predictable names.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from autotune.core.policy_names import MAX_POLICY_NAME_LENGTH

__all__ = ["Base", "ObservationRow", "ProfileRow", "TrialRow", "utcnow"]

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """Timezone-aware now in UTC (what every timestamp column stores)."""
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    """Declarative base with the shared naming convention."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ProfileRow(Base):
    """One stored Profile. The columns that lookups filter on are columns; the rest is kept as sent."""

    __tablename__ = "profiles"
    __table_args__ = (
        # /suggest: the newest profiles of a fingerprint on a device model per strategy and source
        # (and, by its prefix, of a fingerprint on any device) -- one index serves every lookup.
        Index(
            "ix_profiles_fingerprint_device_strategy_source_created",
            "fingerprint",
            "device_name",
            "strategy",
            "source",
            "created_at",
        ),
        Index("ix_profiles_task", "task"),
        Index("ix_profiles_device_name", "device_name"),
        Index("ix_profiles_precision", "precision"),
        Index("ix_profiles_created_at", "created_at"),
        Index("ix_profiles_seq_len", "seq_len"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # sha256 of the canonical JSON of the profile: the database, not the app, keeps uploads idempotent.
    content_hash: Mapped[str] = mapped_column(String(64), unique=True)
    schema_version: Mapped[int] = mapped_column(Integer)
    fingerprint: Mapped[str] = mapped_column(String(128))
    task: Mapped[str] = mapped_column(String(256))
    device_kind: Mapped[str] = mapped_column(String(16))
    device_name: Mapped[str] = mapped_column(String(256))
    device: Mapped[dict[str, Any]] = mapped_column(JSON)
    devices: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    precision: Mapped[str] = mapped_column(String(16))  # "bf16-autocast" is 13
    tags: Mapped[dict[str, Any]] = mapped_column(JSON)
    budget_bytes: Mapped[int] = mapped_column(BigInteger)
    headroom: Mapped[float] = mapped_column(Float)
    max_micro_batch: Mapped[int] = mapped_column(Integer)
    micro_batch_cap: Mapped[int] = mapped_column(Integer)
    multiple_of: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    # "ddp" or "fsdp" (for fsdp the figures are rank 0's of world_size ranks); "measured" or
    # "estimate" (fake-tensor trials only). Rows stored before these columns are ddp measurements.
    strategy: Mapped[str] = mapped_column(String(8), server_default="ddp")
    source: Mapped[str] = mapped_column(String(16), server_default="measured")
    non_monotone: Mapped[bool] = mapped_column(Boolean, server_default=false())
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # Third wave: the length of a sequence-aware task (null otherwise) and the pieces of its memory
    # surface over (m, L); the checkpointing policy (none | every-K | full | op | op:OP/..., canonical: 0004
    # widened it to MAX_POLICY_NAME_LENGTH for op lists); the timed run.
    seq_len: Mapped[int | None] = mapped_column(Integer, nullable=True)
    surface: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    activation_checkpointing: Mapped[str] = mapped_column(String(MAX_POLICY_NAME_LENGTH), server_default="none")
    throughput: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    fit_fixed_bytes: Mapped[float | None] = mapped_column(Float, nullable=True)
    fit_bytes_per_sample: Mapped[float | None] = mapped_column(Float, nullable=True)
    trial_count: Mapped[int] = mapped_column(Integer)
    oom_count: Mapped[int] = mapped_column(Integer)
    seconds: Mapped[float] = mapped_column(Float)
    warnings: Mapped[list[str]] = mapped_column(JSON)
    torch_version: Mapped[str | None] = mapped_column(String(256), nullable=True)
    autotune_version: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    uploaded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    uploader: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # The profile exactly as validated on upload: GET returns it whole even after the schema gains
    # fields that have no column here (the columns above are for lookups and the dashboard).
    document: Mapped[dict[str, Any]] = mapped_column(JSON)

    trials: Mapped[list[TrialRow]] = relationship(
        back_populates="profile",
        order_by="TrialRow.position",
        cascade="all, delete-orphan",
        passive_deletes=True,
    )
    observations: Mapped[list[ObservationRow]] = relationship(
        back_populates="profile",
        order_by="ObservationRow.id",
        cascade="all, delete-orphan",
        passive_deletes=True,
    )


class TrialRow(Base):
    """One trial of a profile, in the order the probe ran them."""

    __tablename__ = "trials"
    __table_args__ = (UniqueConstraint("profile_id", "position", name="uq_trials_profile_id_position"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    profile_id: Mapped[int] = mapped_column(ForeignKey("profiles.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)
    micro_batch: Mapped[int] = mapped_column(Integer)
    peak_bytes: Mapped[int] = mapped_column(BigInteger)
    fits: Mapped[bool] = mapped_column(Boolean)
    oom: Mapped[bool] = mapped_column(Boolean)
    seconds: Mapped[float] = mapped_column(Float)
    forward_backward_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    step_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    allocated_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    outside_allocator_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # A fake-tensor trial (a pre-search point, or an estimate's figure), not a measurement.
    fake: Mapped[bool] = mapped_column(Boolean, server_default=false())

    profile: Mapped[ProfileRow] = relationship(back_populates="trials")


class ObservationRow(Base):
    """A training job's report of the peak it really saw at some micro-batch, or of an OOM."""

    __tablename__ = "observations"
    __table_args__ = (Index("ix_observations_profile_id", "profile_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    profile_id: Mapped[int] = mapped_column(ForeignKey("profiles.id", ondelete="CASCADE"))
    micro_batch: Mapped[int] = mapped_column(Integer)
    peak_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    oom: Mapped[bool] = mapped_column(Boolean)
    world_size: Mapped[int] = mapped_column(Integer)
    note: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    uploader: Mapped[str | None] = mapped_column(String(256), nullable=True)

    profile: Mapped[ProfileRow] = relationship(back_populates="observations")
