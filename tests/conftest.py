"""Fixtures shared by every test: databases (SQLite and PostgreSQL) and a movable clock;
and the markers that ``make test-fast`` leaves out.

Every test under ``tests/e2e`` and ``tests/deploy`` is marked ``e2e`` (real processes, or
the deployment), and every test that needs PostgreSQL is marked ``postgres``: the
PostgreSQL half of ``db_url`` and whatever uses ``pg_database``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.helpers import FakeClock

REPO_ROOT = Path(__file__).resolve().parents[1]

PG_ADMIN_URL = os.environ.get("RELAUNCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
E2E_DIRS = (Path(__file__).parent / "e2e", Path(__file__).parent / "deploy")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.path.is_relative_to(d) for d in E2E_DIRS):
            item.add_marker(pytest.mark.e2e)
        if "pg_database" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _pg_url(dbname: str) -> str:
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    return f"{base}/{dbname}"


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A fresh, empty PostgreSQL database, dropped afterwards."""
    name = f"relaunch_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _pg_url(name)
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each database test runs once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'relaunch.db'}"
    url: str = request.getfixturevalue("pg_database")
    return url


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """The current environment without launcher or relaunch variables, repo on PYTHONPATH."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("RELAUNCH_", "TORCHELASTIC_"))
        and key not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
        and key not in {"MASTER_ADDR", "MASTER_PORT"}
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env["OMP_NUM_THREADS"] = "1"
    return env
