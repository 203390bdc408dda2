"""users, tokens, job ownership, node credentials, idempotency keys

Every API call now carries a credential. Users hold API tokens (stored only as
sha256 hashes); each job belongs to the user who submitted it; each node
holds its own token, issued when it registers. A submit with an
Idempotency-Key is remembered per user, so a retried submit returns the job
the first one made.

Jobs submitted before this revision have no owner: only admins see them.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", BigId, nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("max_active_jobs", sa.Integer(), nullable=True),
        sa.Column("max_nodes", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", BigId, nullable=False),
        sa.Column("user_id", BigId, nullable=False),
        sa.Column("label", sa.String(length=64), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash"),
    )
    op.create_index("ix_api_tokens_user_id", "api_tokens", ["user_id"])
    op.create_table(
        "idempotency_keys",
        sa.Column("id", BigId, nullable=False),
        sa.Column("user_id", BigId, nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("body_sha256", sa.String(length=64), nullable=False),
        sa.Column("job_id", BigId, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("user_id", "key"),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("owner_id", BigId, nullable=True))
        batch.create_foreign_key("fk_jobs_owner_id_users", "users", ["owner_id"], ["id"])
        batch.create_index("ix_jobs_owner_id", ["owner_id"])
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("token_hash", sa.String(length=64), nullable=True))
        batch.create_unique_constraint("uq_nodes_token_hash", ["token_hash"])


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_constraint("uq_nodes_token_hash", type_="unique")
        batch.drop_column("token_hash")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_owner_id")
        batch.drop_constraint("fk_jobs_owner_id_users", type_="foreignkey")
        batch.drop_column("owner_id")
    op.drop_table("idempotency_keys")
    op.drop_index("ix_api_tokens_user_id", table_name="api_tokens")
    op.drop_table("api_tokens")
    op.drop_table("users")
