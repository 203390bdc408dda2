"""Fixtures shared by every test: databases (SQLite and PostgreSQL) and a movable clock;
and the markers that ``make test-fast`` leaves out.

Every test under ``tests/e2e`` and ``tests/deploy`` is marked ``e2e`` (real processes, or
the deployment), and every test that needs PostgreSQL is marked ``postgres``: the
PostgreSQL half of ``db_url`` and whatever uses ``pg_database``.

A test marked ``gpu`` needs a CUDA GPU. Where torch sees none it is skipped, and the
skip says why (the one kind of skip the suite accepts without its own reason in the
test): run ``pytest -m gpu`` on a GPU host to run them.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from service.db import upgrade_to_head
from tests.helpers import (
    REPO_ROOT,
    FakeClock,
    forget_classified_callables,
    let_jobs_pass,
    starts_clusters,
    subprocess_environ,
    work_unit,
)

PG_ADMIN_URL = os.environ.get("RELAUNCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
_OWN_TEMPROOT = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """As root, a temporary root of this run's own: pytest makes its shared
    ``/tmp/pytest-of-root`` 0700 again at every start, which would lock the jobs' users
    of a run under way out of their directories (see ``let_jobs_pass``)."""
    if os.geteuid() == 0 and "PYTEST_DEBUG_TEMPROOT" not in os.environ:
        os.environ["PYTEST_DEBUG_TEMPROOT"] = tempfile.mkdtemp(prefix="relaunch-tests-")
        config.stash[_OWN_TEMPROOT] = os.environ["PYTEST_DEBUG_TEMPROOT"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove this run's temporary root if every test passed; keep it to look into if not."""
    own = session.config.stash.get(_OWN_TEMPROOT, None)
    if own is not None and exitstatus == 0:
        shutil.rmtree(own, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if starts_clusters(item.nodeid):
            item.add_marker(pytest.mark.e2e)
        if "pg_database" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_tests and not _cuda_available():
        skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {_why_no_cuda()}")
        for item in gpu_tests:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``pytest -n`` (``make test``): tests go to the workers by ``work_unit``."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


def _cuda_available() -> bool:
    """Asked only where a ``gpu`` test was collected: torch is not imported otherwise."""
    import torch

    return torch.cuda.is_available()


def _why_no_cuda() -> str:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"


@pytest.fixture(scope="session", autouse=True)
def _jobs_can_reach_python_and_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """As root the agents run each job as a user of its own (isolation "user"): that user
    must reach the interpreter, the repository and the tests' directories."""
    let_jobs_pass(Path(sys.executable).resolve().parent)
    let_jobs_pass(Path(sys.prefix))
    let_jobs_pass(REPO_ROOT)
    let_jobs_pass(tmp_path_factory.getbasetemp())


@pytest.fixture(autouse=True)
def _apps_freed_after_each_test() -> Iterator[None]:
    """What a test's apps left in FastAPI's caches is dropped with the test, so that the
    apps are freed (``forget_classified_callables``)."""
    yield
    forget_classified_callables()


@pytest.fixture
def tmp_path(tmp_path: Path) -> Path:
    """pytest's, passable by a job's user (pytest makes it 0700)."""
    return let_jobs_pass(tmp_path)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _pg_url(dbname: str) -> str:
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    return f"{base}/{dbname}"


@contextmanager
def _scratch_pg_database(prefix: str, template: str | None = None) -> Iterator[str]:
    """The name of a new PostgreSQL database (a copy of ``template``, else empty), dropped
    on leaving."""
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    copy = f' TEMPLATE "{template}"' if template else ""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{copy}')
    try:
        yield name
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A fresh, empty PostgreSQL database, dropped afterwards."""
    with _scratch_pg_database("relaunch_t_") as name:
        yield _pg_url(name)


@pytest.fixture(scope="session")
def pg_head_template() -> Iterator[str]:
    """A PostgreSQL database that ``upgrade head`` migrated once in this run, which
    ``pg_database_at_head`` copies; nothing connects to it after that (PostgreSQL copies
    only a database no one is connected to). Dropped at the end of the run."""
    with _scratch_pg_database("relaunch_t_head_") as name:
        upgrade_to_head(_pg_url(name))
        yield name


@pytest.fixture
def pg_database_at_head(pg_head_template: str) -> Iterator[str]:
    """A fresh PostgreSQL database already at the migrations' head: a copy of what they
    made of an empty one, without running them again (most of the cost of a controller's
    first start on PostgreSQL). Dropped afterwards."""
    with _scratch_pg_database("relaunch_t_", template=pg_head_template) as name:
        yield _pg_url(name)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each database test runs once on SQLite and once on PostgreSQL.

    Empty, except where the test starts the controller's app on it (it uses ``settings``):
    there the PostgreSQL one is already at head (``pg_database_at_head``), so the app's own
    ``upgrade head`` at start finds nothing to do. On SQLite that finding costs as much as
    migrating an empty file, so the file is left to the app to make."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'relaunch.db'}"
    at_head = "settings" in request.fixturenames
    url: str = request.getfixturevalue("pg_database_at_head" if at_head else "pg_database")
    return url


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """The current environment without launcher or relaunch variables, repo on PYTHONPATH."""
    return subprocess_environ()
