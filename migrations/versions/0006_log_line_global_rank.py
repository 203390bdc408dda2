"""log lines carry the worker's global rank

A worker's output line is stored with its global rank as well as its local
rank, so that a line reads the same as the rank in the timeline's events. Lines
stored before this revision, and lines from nodes that do not report it, have
none.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("log_lines") as batch:
        batch.add_column(sa.Column("global_rank", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("log_lines") as batch:
        batch.drop_column("global_rank")
