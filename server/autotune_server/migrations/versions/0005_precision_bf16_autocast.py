"""The precision ``bf16-autocast`` (issue 33, item 5): ``profiles.precision`` holds up to 16 characters, where 8
held fp32, bf16 and fp16. Existing rows keep their values; under fsdp their fingerprints carry the old layout, so
no stored fsdp profile is read as the new meaning of bf16 (autotune/tasks/fingerprint.py, task_fingerprint).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Widen the precision column to hold bf16-autocast."""
    with op.batch_alter_table("profiles") as batch:
        batch.alter_column(
            "precision", existing_type=sa.String(length=8), type_=sa.String(length=16), existing_nullable=False
        )


def downgrade() -> None:
    """Narrow it back (delete the bf16-autocast rows first: they do not fit)."""
    with op.batch_alter_table("profiles") as batch:
        batch.alter_column(
            "precision", existing_type=sa.String(length=16), type_=sa.String(length=8), existing_nullable=False
        )
