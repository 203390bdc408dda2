"""The schema comes only from the migrations, and they agree with the models."""

from __future__ import annotations

import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

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


def test_controllers_that_start_together_migrate_once(db_url: str) -> None:
    """Three controllers booting at once each run ``upgrade head``: none may fail."""
    code = "import sys; from service.db import upgrade_to_head; upgrade_to_head(sys.argv[1])"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, db_url], stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    failures = [p.stderr.read().decode()[-2000:] for p in procs if p.wait(timeout=120) != 0]  # type: ignore[union-attr]
    assert failures == []
    engine = make_engine(db_url)
    try:
        assert set(inspect(engine).get_table_names()) >= TABLES
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM controller_leases")).scalar() == 1
    finally:
        engine.dispose()
