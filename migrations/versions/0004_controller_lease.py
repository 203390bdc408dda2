"""controller lease

One row that says which controller may act (place, re-form and fail jobs)
and until when. Two controllers on one database: the holder renews it, the
other waits in standby and takes over once it expires.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NEVER = datetime(1970, 1, 1, tzinfo=UTC)


def upgrade() -> None:
    leases = op.create_table(
        "controller_leases",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    # The row exists before any controller starts, so taking the lease is
    # always an UPDATE that row locks serialize, never a racing INSERT.
    op.bulk_insert(
        leases,
        [{"name": "reconciler", "holder": "", "term": 0, "expires_at": NEVER, "renewed_at": NEVER}],
    )


def downgrade() -> None:
    op.drop_table("controller_leases")
