"""Job events by attempt: an index for what a report reads of its attempt's timeline

Every report that carries events asks when its attempt's members last changed, and a
progress report of a new worker process asks for its node's last rendezvous round; both
filter the timeline by attempt. With only the (job_id, id) index each was a scan of the
whole table, every job's events: about 25 ms at 150,000 events on PostgreSQL, on every
such report, while it held its job's row lock. On a large table this revision's
``CREATE INDEX`` holds writes to ``job_events`` until it is built (seconds per million
rows).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_job_events_attempt_id_id", "job_events", ["attempt_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_job_events_attempt_id_id", table_name="job_events")
