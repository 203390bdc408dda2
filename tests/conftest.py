"""Fixtures shared by every test: databases (SQLite and PostgreSQL) and a movable clock."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.helpers import FakeClock

PG_ADMIN_URL = os.environ.get("RELAUNCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


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


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each database test runs once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'relaunch.db'}"
    url: str = request.getfixturevalue("pg_database")
    return url
