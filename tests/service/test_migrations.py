"""The schema comes only from the migrations, and they agree with the models."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import inspect, text

from service.db import alembic_config, downgrade_to_base, make_engine, upgrade_to_head
from service.models import Base
from service.reconciler import Reconciler
from tests.service.helpers import job, register, report, submit

REPO = Path(__file__).resolve().parents[2]
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


def _alembic_by_hand(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``alembic upgrade head`` as an operator runs it in a checkout."""
    clean = {k: v for k, v in os.environ.items() if not k.endswith("DATABASE_URL")}
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(REPO / "alembic.ini"), "upgrade", "head"],
        env={**clean, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_alembic_by_hand_migrates_the_controllers_database(db_url: str, tmp_path: Path) -> None:
    done = _alembic_by_hand({"DATABASE_URL": db_url}, REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    engine = make_engine(db_url)
    try:
        assert set(inspect(engine).get_table_names()) >= TABLES
    finally:
        engine.dispose()
    assert not (REPO / ".relaunch").exists()


def test_alembic_by_hand_defaults_to_the_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "fresh" / "data"  # does not exist yet
    done = _alembic_by_hand({"RELAUNCH_DATA_DIR": str(data_dir)}, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # Only its owner may read the database, which holds the jobs' (encrypted) env.
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o711
    assert stat.S_IMODE((data_dir / "relaunch.db").stat().st_mode) == 0o600
    engine = make_engine(f"sqlite:///{data_dir / 'relaunch.db'}")
    try:
        assert set(inspect(engine).get_table_names()) >= TABLES
    finally:
        engine.dispose()


def test_finished_members_and_nodes_that_left_migrate_both_ways(
    api: TestClient, reconciler: Reconciler, db_url: str
) -> None:
    """Down to 0006 they read as the old states (EXITED, LOST); up again, a member that
    succeeded is FINISHED once more."""
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api, "1:2")
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    assert report(api, a, attempt_id, exit={"outcome": "succeeded", "exit_code": 0}).is_success
    assert api.post(f"/api/v1/nodes/{b}/leave", json={}).json() == {"left": True}
    engine = make_engine(db_url)

    def states() -> tuple[dict[int, str], dict[int, str]]:
        with engine.connect() as conn:
            members = dict(conn.execute(text("SELECT node_id, state FROM attempt_members")).all())
            nodes = dict(conn.execute(text("SELECT id, state FROM nodes")).all())
        return members, nodes

    try:
        assert states() == ({a: "FINISHED", b: "LEFT"}, {a: "ALIVE", b: "LEFT"})
        command.downgrade(alembic_config(db_url), "0006")
        assert states() == ({a: "EXITED", b: "LEFT"}, {a: "ALIVE", b: "LOST"})
        upgrade_to_head(db_url)
        assert states() == ({a: "FINISHED", b: "LEFT"}, {a: "ALIVE", b: "LOST"})
    finally:
        engine.dispose()


def test_enrolment_tokens_migrate_up_and_down(db_url: str) -> None:
    """0010 makes the table of per-node enrolment tokens; down one step drops it, and
    nothing else."""
    engine = make_engine(db_url)
    try:
        upgrade_to_head(db_url)
        assert "enrolment_tokens" in inspect(engine).get_table_names()
        command.downgrade(alembic_config(db_url), "0010-1")
        tables = set(inspect(engine).get_table_names())
        assert "enrolment_tokens" not in tables and tables >= TABLES | {"users"}
        upgrade_to_head(db_url)
        columns = {c["name"] for c in inspect(engine).get_columns("enrolment_tokens")}
        assert columns == {
            "id",
            "token_hash",
            "node_name",
            "single_use",
            "expires_at",
            "used_at",
            "revoked_at",
            "created_at",
            "created_by",
        }
    finally:
        engine.dispose()


def test_gpu_columns_migrate_down_and_up_keeping_the_rows(
    api: TestClient, reconciler: Reconciler, db_url: str
) -> None:
    """0011 adds nodes' GPUs, attempts' device and members' GPUs; down one step drops those
    columns and nothing else (no row goes with them); rows made before it read as CPU."""
    gpus = [{"index": i, "name": "g"} for i in range(2)]
    register(api, "g", slots=2, gpus=gpus, gpu_driver="550", cuda_version="12.4", cpus=8)
    job_id = submit(api, "1", nproc_per_node=2)
    reconciler.run_once()
    assert job(api, job_id)["attempts"][0]["members"][0]["gpus"] == [0, 1]
    engine = make_engine(db_url)

    def columns(table: str) -> set[str]:
        return {c["name"] for c in inspect(engine).get_columns(table)}

    def rows() -> tuple[int, int, int]:
        with engine.connect() as conn:
            counts = [
                conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
                for table in ("nodes", "attempts", "attempt_members")
            ]
        return counts[0], counts[1], counts[2]

    try:
        command.downgrade(alembic_config(db_url), "0011-1")
        assert not columns("nodes") & {"gpus", "gpu_usage", "gpu_driver", "cuda_version", "cpus"}
        assert "device" not in columns("attempts") and "gpus" not in columns("attempt_members")
        assert rows() == (1, 1, 1)
        upgrade_to_head(db_url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT device FROM attempts")).scalar_one() == "cpu"
            member_gpus = conn.execute(text("SELECT gpus FROM attempt_members")).scalar_one()
            node = conn.execute(text("SELECT gpus, gpu_usage, cpus FROM nodes")).one()
        assert member_gpus in ([], "[]") and tuple(node) in (([], [], None), ("[]", "[]", None))
    finally:
        engine.dispose()


def test_member_rounds_migrate_down_and_up_counting_the_next_failure(
    api: TestClient, reconciler: Reconciler, db_url: str
) -> None:
    """0013 adds where each member's last reported round falls on the timeline; rows made
    before it take their attempt's newest event, so a running attempt's next failure is
    counted, as it was before the rule."""
    register(api, "a")
    job_id = submit(api, "1")
    reconciler.run_once()
    engine = make_engine(db_url)
    try:
        command.downgrade(alembic_config(db_url), "0013-1")
        columns = {c["name"] for c in inspect(engine).get_columns("attempt_members")}
        assert "round_reported_after" not in columns
        upgrade_to_head(db_url)
        with engine.connect() as conn:
            newest = conn.execute(
                text("SELECT max(id) FROM job_events WHERE job_id = :j"), {"j": job_id}
            ).scalar_one()
            kept = conn.execute(text("SELECT round_reported_after FROM attempt_members"))
            assert kept.scalar_one() == newest is not None
    finally:
        engine.dispose()
