"""finished members and nodes that left

A member whose launcher succeeded is FINISHED (EXITED stays for a launcher that
failed), and a node whose agent said it stops is LEFT rather than LOST. Both
state columns are VARCHARs without a CHECK constraint, so the new values need
no change of schema. Members stored as EXITED with exit code 0 are the ones
that succeeded and become FINISHED; nodes cannot be told apart afterwards and
stay as they are. Downgrading maps the new values back to the old ones.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        "UPDATE attempt_members SET state = 'FINISHED' WHERE state = 'EXITED' AND exit_code = 0"
    )


def downgrade() -> None:
    op.execute("UPDATE attempt_members SET state = 'EXITED' WHERE state = 'FINISHED'")
    op.execute("UPDATE nodes SET state = 'LOST' WHERE state = 'LEFT'")
