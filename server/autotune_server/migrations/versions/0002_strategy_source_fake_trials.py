"""Profiles gain strategy (ddp|fsdp), source (measured|estimate) and non_monotone; trials gain fake
and step_bytes (the optimizer step's peak, flat in m: the floor of a prediction's peak).

Every row stored before this revision was a DDP measurement with real trials, which is what the
server defaults give existing rows. /suggest's index gains strategy and source: it looks up the
newest profile of a fingerprint on a device model per strategy and source.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_INDEX = "ix_profiles_fingerprint_device_created"
_NEW_INDEX = "ix_profiles_fingerprint_device_strategy_source_created"


def upgrade() -> None:
    """Add the columns (existing rows: ddp, measured, monotone, real trials) and widen the index."""
    with op.batch_alter_table("profiles") as batch:
        batch.add_column(sa.Column("strategy", sa.String(length=8), server_default="ddp", nullable=False))
        batch.add_column(sa.Column("source", sa.String(length=16), server_default="measured", nullable=False))
        batch.add_column(sa.Column("non_monotone", sa.Boolean(), server_default=sa.false(), nullable=False))
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("fake", sa.Boolean(), server_default=sa.false(), nullable=False))
        batch.add_column(sa.Column("step_bytes", sa.BigInteger(), nullable=True))
    op.drop_index(_OLD_INDEX, table_name="profiles")
    op.create_index(
        _NEW_INDEX, "profiles", ["fingerprint", "device_name", "strategy", "source", "created_at"]
    )


def downgrade() -> None:
    """Drop the columns and restore revision 0001's index (fsdp profiles and estimates lose their label)."""
    op.drop_index(_NEW_INDEX, table_name="profiles")
    op.create_index(_OLD_INDEX, "profiles", ["fingerprint", "device_name", "created_at"])
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("step_bytes")
        batch.drop_column("fake")
    with op.batch_alter_table("profiles") as batch:
        batch.drop_column("non_monotone")
        batch.drop_column("source")
        batch.drop_column("strategy")
