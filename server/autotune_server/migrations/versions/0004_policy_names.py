"""Memory policies beyond none, every-2 and full: ``profiles.activation_checkpointing`` holds any policy's
canonical name (``autotune.core.policy_names``): every-K for any K >= 2, op, and op:OP/OP/... with the op
list, up to 256 characters, where 16 held the three names. Existing rows keep their names, which stay
canonical.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Widen the policy column to a policy name's longest canonical spelling."""
    with op.batch_alter_table("profiles") as batch:
        batch.alter_column(
            "activation_checkpointing",
            existing_type=sa.String(length=16),
            type_=sa.String(length=256),
            existing_nullable=False,
            existing_server_default="none",
        )


def downgrade() -> None:
    """Narrow it back (a stored op list longer than 16 characters does not fit: delete such rows first)."""
    with op.batch_alter_table("profiles") as batch:
        batch.alter_column(
            "activation_checkpointing",
            existing_type=sa.String(length=256),
            type_=sa.String(length=16),
            existing_nullable=False,
            existing_server_default="none",
        )
