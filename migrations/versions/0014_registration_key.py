"""Registration keys: a retried registration whose answer was lost gets its node back

An agent sends a random key with every try of one registration. The node keeps the
hash of the key of the registration that issued its current token, so a retry that
carries the same key takes the node back (with a new token) instead of being refused
as a stranger to an ALIVE node's name. Rows made before this revision have none.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("registration_key_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "registration_key_hash")
