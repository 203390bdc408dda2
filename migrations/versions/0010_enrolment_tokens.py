"""per-node enrolment tokens

An admin makes enrolment tokens for nodes: each admits registrations until it
is revoked or expires; a single-use one admits exactly one; one bound to a node
name admits only that name. Only the sha256 of a token's text is stored. The
controller's shared enrolment token (RELAUNCH_ENROLMENT_TOKEN) keeps working
beside them.

Revision ID: 0010
Revises: 0008
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "enrolment_tokens",
        sa.Column("id", BigId, nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("node_name", sa.String(length=128), nullable=True),
        sa.Column("single_use", sa.Boolean(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", BigId, nullable=True),
        sa.ForeignKeyConstraint(
            ["created_by"],
            ["users.id"],
            name="fk_enrolment_tokens_created_by_users",
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash"),
    )


def downgrade() -> None:
    op.drop_table("enrolment_tokens")
