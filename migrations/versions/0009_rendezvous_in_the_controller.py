"""rendezvous served by the controller

Each attempt's rendezvous (torch's state blob with its compare-and-set version,
and the store's keys) lives in the database, readable and writable only by the
attempt's member nodes; the shared TCP store and the attempts' store address are
gone. Each job's snapshot-writer count moves here too, and each membership keeps
the hash of the secret its workers show to take and check a writer token.

Downgrading restores the address column with an empty value: an older controller
points its attempts at its own store again when it starts new ones.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "rendezvous_states",
        sa.Column("attempt_id", _ID, nullable=False),
        sa.Column("state", sa.LargeBinary(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["attempt_id"], ["attempts.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("attempt_id"),
    )
    op.create_table(
        "rendezvous_keys",
        sa.Column("id", _ID, nullable=False),
        sa.Column("attempt_id", _ID, nullable=False),
        sa.Column("key", sa.String(length=512), nullable=False),
        sa.Column("value", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["attempt_id"], ["attempts.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("attempt_id", "key"),
    )
    op.create_table(
        "snapshot_writers",
        sa.Column("job_id", _ID, nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id"),
    )
    with op.batch_alter_table("attempt_members") as batch:
        batch.add_column(sa.Column("worker_token_hash", sa.String(length=64), nullable=True))
        batch.create_unique_constraint(
            "uq_attempt_members_worker_token_hash", ["worker_token_hash"]
        )
    # Not a batch: on SQLite that copies the table, and dropping the old copy would
    # cascade to every row that references an attempt.
    op.execute("ALTER TABLE attempts DROP COLUMN rdzv_endpoint")


def downgrade() -> None:
    op.add_column(
        "attempts",
        sa.Column("rdzv_endpoint", sa.String(length=255), nullable=False, server_default=""),
    )
    with op.batch_alter_table("attempt_members") as batch:
        batch.drop_constraint("uq_attempt_members_worker_token_hash", type_="unique")
        batch.drop_column("worker_token_hash")
    op.drop_table("snapshot_writers")
    op.drop_table("rendezvous_keys")
    op.drop_table("rendezvous_states")
