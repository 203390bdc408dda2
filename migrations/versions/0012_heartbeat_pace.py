"""Heartbeat pace: the interval each node was last told to wait between heartbeats

A controller tells every node, in each heartbeat's reply, how long to wait before
the next one: longer as the fleet grows, so that the nodes together send at most
``heartbeats_per_s_max`` a second. The reconciler gives a node told a longer interval
that much more silence before it is lost, so the value is kept on the node's row,
where every controller sharing the database reads it. Rows made before this
revision read NULL: the base interval, as they were told.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("heartbeat_interval_s", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "heartbeat_interval_s")
