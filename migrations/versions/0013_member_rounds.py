"""Member rounds: where each node's last reported rendezvous round falls on the timeline

A charged worker failure that a node reports after the attempt's last restart, while
that node has reported no rendezvous round since, is of the round the restart ended:
the same incident, not counted again. Each membership keeps the newest timeline event
id of its attempt at the moment its node last reported a completed round. Rows made
before this revision take their attempt's newest event id, as if their nodes had just
reported a round: a running attempt's next failure counts, as it did before.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "attempt_members", sa.Column("round_reported_after", sa.BigInteger(), nullable=True)
    )
    op.execute(
        "UPDATE attempt_members SET round_reported_after = (SELECT max(job_events.id) "
        "FROM job_events WHERE job_events.attempt_id = attempt_members.attempt_id)"
    )


def downgrade() -> None:
    op.drop_column("attempt_members", "round_reported_after")
