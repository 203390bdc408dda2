"""restart budget and waiting for nodes

Counts membership changes apart from worker failures, and records since when a
job has waited for nodes and when it may be placed again (restart back-off).
The job state column is a VARCHAR without a CHECK constraint, so the new state
WAITING needs no change there.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("membership_changes", sa.Integer(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("waiting_since", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("not_before", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.execute("UPDATE jobs SET state = 'PENDING' WHERE state = 'WAITING'")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("not_before")
        batch.drop_column("waiting_since")
        batch.drop_column("membership_changes")
