"""What every reconciler pass reads, by partial indexes: the queue, its new jobs, and the
active memberships

A pass reads the queue's head oldest first, a page at a time, and the PENDING jobs that do
not yet say why they wait; with only the index by state, each read fetched the whole
queue and sorted or filtered it (about 4 ms at 9,000 queued jobs on PostgreSQL, every
pass, for what is usually no row at all). It also reads every ACTIVE membership, which
was a scan of every membership there ever was. Each index holds only the rows its read
wants. On a large table this revision's ``CREATE INDEX`` statements hold writes to
``jobs`` and ``attempt_members`` until they are built (seconds per million rows).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The same conditions as ``service.models``'s; a migration does not import the models,
# which move on after it.
QUEUE = "state = 'PENDING'"
UNEXPLAINED = "state = 'PENDING' AND message = ''"
ACTIVE = "state = 'ACTIVE'"


def _partial(name: str, table: str, where: str, *columns: str) -> None:
    op.create_index(
        name, table, list(columns), postgresql_where=sa.text(where), sqlite_where=sa.text(where)
    )


def upgrade() -> None:
    _partial("ix_jobs_queue", "jobs", QUEUE, "state", "created_at", "id")
    _partial("ix_jobs_unexplained", "jobs", UNEXPLAINED, "state", "message", "created_at", "id")
    _partial("ix_attempt_members_active", "attempt_members", ACTIVE, "id")


def downgrade() -> None:
    op.drop_index("ix_attempt_members_active", table_name="attempt_members")
    op.drop_index("ix_jobs_unexplained", table_name="jobs")
    op.drop_index("ix_jobs_queue", table_name="jobs")
