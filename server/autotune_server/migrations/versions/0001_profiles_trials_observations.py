"""Profiles, their trials as rows of their own, and observations.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the three tables and the indexes the lookups use."""
    op.create_table(
        "profiles",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("schema_version", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(length=128), nullable=False),
        sa.Column("task", sa.String(length=256), nullable=False),
        sa.Column("device_kind", sa.String(length=16), nullable=False),
        sa.Column("device_name", sa.String(length=256), nullable=False),
        sa.Column("device", sa.JSON(), nullable=False),
        sa.Column("devices", sa.JSON(), nullable=False),
        sa.Column("precision", sa.String(length=8), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("budget_bytes", sa.BigInteger(), nullable=False),
        sa.Column("headroom", sa.Float(), nullable=False),
        sa.Column("max_micro_batch", sa.Integer(), nullable=False),
        sa.Column("micro_batch_cap", sa.Integer(), nullable=False),
        sa.Column("multiple_of", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=True),
        sa.Column("fit_fixed_bytes", sa.Float(), nullable=True),
        sa.Column("fit_bytes_per_sample", sa.Float(), nullable=True),
        sa.Column("trial_count", sa.Integer(), nullable=False),
        sa.Column("oom_count", sa.Integer(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("warnings", sa.JSON(), nullable=False),
        sa.Column("torch_version", sa.String(length=256), nullable=True),
        sa.Column("autotune_version", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("uploaded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("uploader", sa.String(length=256), nullable=True),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_profiles")),
        # Idempotent uploads rest on this constraint, not on a check in the app.
        sa.UniqueConstraint("content_hash", name=op.f("uq_profiles_content_hash")),
    )
    op.create_index("ix_profiles_created_at", "profiles", ["created_at"])
    op.create_index("ix_profiles_device_name", "profiles", ["device_name"])
    op.create_index(
        "ix_profiles_fingerprint_device_created", "profiles", ["fingerprint", "device_name", "created_at"]
    )
    op.create_index("ix_profiles_precision", "profiles", ["precision"])
    op.create_index("ix_profiles_task", "profiles", ["task"])

    op.create_table(
        "observations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("profile_id", sa.Integer(), nullable=False),
        sa.Column("micro_batch", sa.Integer(), nullable=False),
        sa.Column("peak_bytes", sa.BigInteger(), nullable=True),
        sa.Column("oom", sa.Boolean(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("note", sa.String(length=1024), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("uploader", sa.String(length=256), nullable=True),
        sa.ForeignKeyConstraint(
            ["profile_id"],
            ["profiles.id"],
            name=op.f("fk_observations_profile_id_profiles"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_observations")),
    )
    op.create_index("ix_observations_profile_id", "observations", ["profile_id"])

    op.create_table(
        "trials",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("profile_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("micro_batch", sa.Integer(), nullable=False),
        sa.Column("peak_bytes", sa.BigInteger(), nullable=False),
        sa.Column("fits", sa.Boolean(), nullable=False),
        sa.Column("oom", sa.Boolean(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("forward_backward_bytes", sa.BigInteger(), nullable=True),
        sa.Column("allocated_bytes", sa.BigInteger(), nullable=True),
        sa.Column("outside_allocator_bytes", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["profile_id"], ["profiles.id"], name=op.f("fk_trials_profile_id_profiles"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trials")),
        # Also the index that loads a profile's trials (profile_id is its prefix).
        sa.UniqueConstraint("profile_id", "position", name="uq_trials_profile_id_position"),
    )


def downgrade() -> None:
    """Drop everything (children first)."""
    op.drop_table("trials")
    op.drop_index("ix_observations_profile_id", table_name="observations")
    op.drop_table("observations")
    for name in (
        "ix_profiles_task",
        "ix_profiles_precision",
        "ix_profiles_fingerprint_device_created",
        "ix_profiles_device_name",
        "ix_profiles_created_at",
    ):
        op.drop_index(name, table_name="profiles")
    op.drop_table("profiles")
