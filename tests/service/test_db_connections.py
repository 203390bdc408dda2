"""Pooled PostgreSQL connections that the server closed: which are pinged and replaced
before use, and what a request on one that was not is answered."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from service.api.app import create_app
from service.db import database_busy, make_engine
from service.models import Role
from service.settings import ControllerSettings
from tests.helpers import FakeClock
from tests.service.conftest import PG_SECRETS_KEY
from tests.service.helpers import ENROLMENT_TOKEN, Cluster

pytestmark = pytest.mark.postgres


def _backend(engine: Engine) -> int:
    with engine.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    assert isinstance(pid, int)
    return pid


def _close_from_the_server(url: str) -> int:
    """Terminate every other backend of ``url``'s database, as a server restart would
    end them; how many."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'"
        ).fetchall()
    return len(rows)


@pytest.fixture
def one_connection(request: pytest.FixtureRequest, pg_database: str) -> Iterator[Engine]:
    engine = make_engine(pg_database, connections=1, ping_after_idle_s=request.param)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.mark.parametrize("one_connection", [0.05], indirect=True)
def test_a_connection_closed_while_idle_is_replaced_before_use(
    one_connection: Engine, pg_database: str
) -> None:
    first = _backend(one_connection)
    assert _close_from_the_server(pg_database) == 1
    time.sleep(0.2)  # idle past 0.05 s: pinged at its next loan
    with one_connection.connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar_one() == 1
    assert _backend(one_connection) != first


@pytest.mark.parametrize("one_connection", [0.0], indirect=True)
def test_every_loan_is_pinged_when_told_zero(one_connection: Engine, pg_database: str) -> None:
    first = _backend(one_connection)
    assert _close_from_the_server(pg_database) == 1
    with one_connection.connect() as conn:  # at once: only a ping at every loan sees it
        assert conn.execute(text("SELECT 1")).scalar_one() == 1
    assert _backend(one_connection) != first


@pytest.mark.parametrize("one_connection", [60.0], indirect=True)
def test_a_connection_lent_again_soon_is_not_pinged_and_a_closed_one_fails_once(
    one_connection: Engine, pg_database: str
) -> None:
    first = _backend(one_connection)
    assert _close_from_the_server(pg_database) == 1
    with pytest.raises(DBAPIError) as failed, one_connection.connect() as conn:
        conn.execute(text("SELECT 1"))
    # No ping saw it; the statement did, and is read as busy (retry), not as broken.
    assert failed.value.connection_invalidated
    assert database_busy(failed.value)
    assert _backend(one_connection) != first  # the pool reconnected


def test_the_api_answers_503_on_a_connection_the_server_closed_then_serves(
    pg_database_at_head: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = ControllerSettings(
        data_dir=tmp_path_factory.mktemp("data"),
        database_url=pg_database_at_head,
        secrets_keys=PG_SECRETS_KEY,
        enrolment_token=ENROLMENT_TOKEN,
        credential_cache_s=0,
        database_ping_after_idle_s=60,
    )
    app = create_app(settings, clock=FakeClock(), run_background=False)
    with Cluster(app) as client:
        token = client.add_user("root", Role.ADMIN)
        auth = {"authorization": f"Bearer {token}"}
        assert client.get("/api/v1/jobs", headers=auth).status_code == 200
        assert _close_from_the_server(pg_database_at_head) >= 1
        refused = client.get("/api/v1/jobs", headers=auth)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert client.get("/api/v1/jobs", headers=auth).status_code == 200


def test_a_pool_that_does_not_wait_for_the_disk_keeps_the_url_s_own_options(
    pg_database: str,
) -> None:
    """``synchronous_commit`` off is set by a statement of its own, not by the connection's
    ``options``, which would drop those the URL gives (a ``search_path``, a timeout)."""
    url = f"{pg_database}?options=-c%20statement_timeout%3D4321"
    engine = make_engine(url, 2, synchronous_commit=False)
    try:
        for _ in range(2):  # a new connection, then one lent again
            with engine.connect() as conn:
                assert conn.execute(text("SHOW synchronous_commit")).scalar_one() == "off"
                assert conn.execute(text("SHOW statement_timeout")).scalar_one() == "4321ms"
                conn.execute(text("SELECT 1"))
                conn.commit()
    finally:
        engine.dispose()
