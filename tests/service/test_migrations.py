"""The schema comes only from the migrations, and they agree with the models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from service.db import downgrade_to_base, make_engine, upgrade_to_head
from service.models import Base

TABLES = {
    "jobs",
    "attempts",
    "attempt_members",
    "nodes",
    "job_events",
    "snapshots",
    "metrics",
    "log_lines",
}


def test_upgrade_downgrade_upgrade_and_no_drift(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        upgrade_to_head(db_url)
        assert set(inspect(engine).get_table_names()) >= TABLES
        downgrade_to_base(db_url)
        assert not TABLES & set(inspect(engine).get_table_names())
        upgrade_to_head(db_url)
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == []
    finally:
        engine.dispose()
