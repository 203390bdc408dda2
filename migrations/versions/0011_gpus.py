"""GPUs: a node's inventory and use, an attempt's device, a member's GPUs

A node keeps the GPUs its agent reported at registration (a JSON list of
``GpuInfo``), their use at its last heartbeat (``GpuUsage``), its GPU driver
and CUDA versions and its cores. An attempt keeps the device it was placed
for, and each membership the indices of the node's GPUs it holds. Rows made
before this revision read as they behaved: nodes without GPUs, attempts on
"cpu", memberships holding no GPU.

Plain ADD/DROP COLUMN, not batch mode: on SQLite a batch copies and drops the
table, and dropping ``attempts`` would cascade into every table that refers to
it. SQLite drops a column itself since 3.35.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

EMPTY_LIST = sa.text("'[]'")


def upgrade() -> None:
    op.add_column("nodes", sa.Column("gpus", sa.JSON(), nullable=False, server_default=EMPTY_LIST))
    op.add_column(
        "nodes", sa.Column("gpu_usage", sa.JSON(), nullable=False, server_default=EMPTY_LIST)
    )
    op.add_column("nodes", sa.Column("gpu_driver", sa.String(length=64), nullable=True))
    op.add_column("nodes", sa.Column("cuda_version", sa.String(length=32), nullable=True))
    op.add_column("nodes", sa.Column("cpus", sa.Integer(), nullable=True))
    op.add_column(
        "attempts", sa.Column("device", sa.String(length=8), nullable=False, server_default="cpu")
    )
    op.add_column(
        "attempt_members",
        sa.Column("gpus", sa.JSON(), nullable=False, server_default=EMPTY_LIST),
    )


def downgrade() -> None:
    for table, column in [
        ("attempt_members", "gpus"),
        ("attempts", "device"),
        ("nodes", "cpus"),
        ("nodes", "cuda_version"),
        ("nodes", "gpu_driver"),
        ("nodes", "gpu_usage"),
        ("nodes", "gpus"),
    ]:
        op.drop_column(table, column)
