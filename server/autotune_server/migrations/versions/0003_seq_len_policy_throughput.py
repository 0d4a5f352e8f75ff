"""The third wave's columns: sequence length, its memory surface, the checkpointing policy and the
measured throughput.

- ``seq_len``: the length L a sequence-aware task was measured at (null for other tasks). Such a
  task's fingerprint leaves L out, so several profiles of one fingerprint differ only in L.
- ``surface``: the pieces of the peak-memory surface over (m, L) that can be the maximum within the
  lengths the probe covered (JSON), from which ``/suggest`` predicts other lengths.
- ``activation_checkpointing``: none, every-2 or full; existing rows ran without checkpointing.
- ``throughput``: the timed run at the profile's micro-batch (JSON), for ``objective=throughput``.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the columns (existing rows: no length, no surface, no checkpointing, not timed)."""
    with op.batch_alter_table("profiles") as batch:
        batch.add_column(sa.Column("seq_len", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("surface", sa.JSON(), nullable=True))
        batch.add_column(
            sa.Column("activation_checkpointing", sa.String(length=16), server_default="none", nullable=False)
        )
        batch.add_column(sa.Column("throughput", sa.JSON(), nullable=True))
    op.create_index("ix_profiles_seq_len", "profiles", ["seq_len"])


def downgrade() -> None:
    """Drop the columns (profiles keep their lengths, surfaces and timings in their documents)."""
    op.drop_index("ix_profiles_seq_len", table_name="profiles")
    with op.batch_alter_table("profiles") as batch:
        batch.drop_column("throughput")
        batch.drop_column("activation_checkpointing")
        batch.drop_column("surface")
        batch.drop_column("seq_len")
