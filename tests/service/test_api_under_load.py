"""The node agents' routes under a burst: more concurrent calls than the server has
threads, against a pool sized from those threads, on a real server over HTTP.

A route that held its transaction until FastAPI had built the answer kept a pooled
connection (on SQLite the write lock) while waiting for a worker thread, and the
threads waited for that connection or lock: the controller answered 500s.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import event, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from service import heartbeats, reports
from service.api import nodes as nodes_api
from service.api.app import create_app
from service.api.lane import Lane
from service.db import make_engine, make_session_factory, transaction
from service.models import Node
from service.settings import ControllerSettings
from tests.helpers import FakeClock, wait_for
from tests.service.helpers import ENROLMENT_TOKEN, bearer, register

NODES = 100
BEATS = 3
API_THREADS = 4


@pytest.fixture
def server_url(settings: ControllerSettings, clock: FakeClock) -> Iterator[str]:
    """The controller served by uvicorn (its lifespan included) with few threads."""
    few_threads = settings.model_copy(update={"api_threads": API_THREADS})
    with served(few_threads, clock) as url:
        yield url


@contextmanager
def served(settings: ControllerSettings, clock: FakeClock) -> Iterator[str]:
    """The URL of the controller served by uvicorn, its lifespan included."""
    with serving(create_app(settings, clock=clock, run_background=False)) as url:
        yield url


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """The URL of ``app`` served by uvicorn, its lifespan included."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for("the controller to listen", lambda: server.started, 60)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def _register(url: str, number: int) -> tuple[int, str]:
    body = {"name": f"node-{number:03d}", "address": "127.0.0.1", "slots": 1, "pid": 1}
    response = httpx.post(
        f"{url}/api/v1/nodes/register", json=body, headers=bearer(ENROLMENT_TOKEN), timeout=60
    )
    response.raise_for_status()
    return response.json()["node_id"], response.json()["node_token"]


def _beat(url: str, node_id: int, token: str, start: threading.Barrier) -> list[int | str]:
    """``BEATS`` heartbeats, the first sent with every other node's: each one's status,
    or the name of the transport error that ended it."""
    answers: list[int | str] = []
    with httpx.Client(base_url=url, headers=bearer(token), timeout=120) as http:
        start.wait()
        for _ in range(BEATS):
            try:
                response = http.post(f"/api/v1/nodes/{node_id}/heartbeat", json={"running": []})
            except httpx.TransportError as exc:
                answers.append(type(exc).__name__)
            else:
                answers.append(response.status_code)
    return answers


def test_a_burst_of_heartbeats_is_answered_and_recorded(
    server_url: str, db_url: str, clock: FakeClock
) -> None:
    registered = [_register(server_url, n) for n in range(NODES)]
    clock.advance(5)  # every heartbeat of the burst records this time
    start = threading.Barrier(NODES)
    with ThreadPoolExecutor(NODES) as pool:
        sent = [pool.submit(_beat, server_url, node, token, start) for node, token in registered]
        answers = [a for beats in sent for a in beats.result(timeout=600)]
    assert [a for a in answers if a != 200] == []
    assert len(answers) == NODES * BEATS

    engine = make_engine(db_url)
    try:
        with transaction(make_session_factory(engine)) as session:
            rows = session.execute(select(Node.id, Node.last_heartbeat_at))
            seen = {node_id: at for node_id, at in rows}
    finally:
        engine.dispose()
    assert {node_id: seen[node_id] for node_id, _ in registered} == {
        node_id: clock.now for node_id, _ in registered
    }


def test_a_heartbeat_is_answered_while_every_api_thread_is_taken(
    settings: ControllerSettings, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heartbeats have threads of their own: two reports that never end hold both of the
    API's threads, and the node's heartbeat is still answered (on the shared threads it
    would wait until its client gave up)."""
    entered, release = threading.Semaphore(0), threading.Event()

    def never_ends(*_: object, **__: object) -> bool:
        entered.release()
        release.wait(120)
        return True

    monkeypatch.setattr(reports, "handle_report", never_ends)
    lanes = settings.model_copy(update={"api_threads": 2, "heartbeat_threads": 1})
    with served(lanes, clock) as url, ThreadPoolExecutor(2) as pool:
        node_id, token = _register(url, 0)
        route = f"{url}/api/v1/nodes/{node_id}"
        try:
            held = [
                pool.submit(
                    httpx.post, f"{route}/reports", json={"attempt_id": 1}, headers=bearer(token)
                )
                for _ in range(2)
            ]
            for _ in held:
                assert entered.acquire(timeout=60)  # both API threads are in a report
            beat = httpx.post(
                f"{route}/heartbeat", json={"running": []}, headers=bearer(token), timeout=30
            )
            assert beat.status_code == 200, beat.text
            assert beat.json()["assignments"] == []
        finally:
            release.set()
        assert [h.result(timeout=60).status_code for h in held] == [200, 200]


class HeldHeartbeats:
    """The heartbeat route's work, counted; the first call holds its thread until
    ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.entered, self.release = threading.Event(), threading.Event()
        real = nodes_api._heartbeat

        def held(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == 1:
                self.entered.set()
                self.release.wait(120)
            return real(*args, **kwargs)

        monkeypatch.setattr(nodes_api, "_heartbeat", held)


def _lane(app: FastAPI) -> Lane:
    lane: Lane = app.state.heartbeat_lane
    return lane


def _shed(app: FastAPI, reason: str) -> float:
    value = app.state.metrics.registry.get_sample_value(
        "relaunch_requests_shed_total", {"lane": "heartbeat", "reason": reason}
    )
    return value or 0.0


@pytest.mark.parametrize("wait_max_s", [0.5, 0.0])
def test_a_heartbeat_that_waited_too_long_for_its_thread_is_shed(
    settings: ControllerSettings,
    db_url: str,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    wait_max_s: float,
) -> None:
    """One heartbeat thread, held by a heartbeat; a second one waits for it longer than
    ``heartbeat_wait_max_s`` and is answered 503 with Retry-After, never worked on, yet
    its node is recorded as heard from then (written before another node's heartbeat);
    the next is answered. With 0, every heartbeat is worked on however long it waited."""
    work = HeldHeartbeats(monkeypatch)
    one_lane = settings.model_copy(
        update={"heartbeat_threads": 1, "heartbeat_wait_max_s": wait_max_s}
    )
    app = create_app(one_lane, clock=clock, run_background=False)
    with serving(app) as url, ThreadPoolExecutor(2) as pool:
        (node_id, token), other = _register(url, 0), _register(url, 1)

        def beat(node: int = node_id, as_token: str = token) -> httpx.Response:
            return httpx.post(
                f"{url}/api/v1/nodes/{node}/heartbeat",
                json={"running": []},
                headers=bearer(as_token),
                timeout=60,
            )

        try:
            first = pool.submit(beat)
            assert work.entered.wait(60)
            clock.advance(5)  # the second heartbeat's time
            second = pool.submit(beat)
            wait_for("the second to wait for the thread", lambda: _lane(app).waiting() == 1, 60)
            time.sleep(1.0)  # and it waits longer than 0.5 s
        finally:
            work.release.set()
        assert first.result(timeout=60).status_code == 200
        answer = second.result(timeout=60)
        if wait_max_s:
            assert answer.status_code == 503, answer.text
            # The interval nodes are told (1 s) is less than a client retries in its call.
            assert answer.headers["retry-after"] == str(nodes_api.SHED_RETRY_AFTER_MIN_S)
            assert "overloaded" in answer.json()["detail"]
            assert (work.calls, _shed(app, "waited")) == (1, 1)
        else:
            assert answer.status_code == 200, answer.text
            assert (work.calls, _shed(app, "waited")) == (2, 0)
        assert beat(*other).status_code == 200  # writes what was noted first
        assert _last_heartbeats(db_url)[node_id] == clock.now
        assert beat().status_code == 200
        assert work.calls == (3 if wait_max_s else 4)


def _last_heartbeats(db_url: str) -> dict[int, Any]:
    engine = make_engine(db_url)
    try:
        with transaction(make_session_factory(engine)) as session:
            return dict(session.execute(select(Node.id, Node.last_heartbeat_at)).all())
    finally:
        engine.dispose()


def test_a_heartbeat_whose_node_gave_up_is_not_worked_on(
    settings: ControllerSettings, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second heartbeat's client gives up while it waits for the one thread (as an
    agent does after 5 s); when its turn comes it is dropped, not worked on."""
    work = HeldHeartbeats(monkeypatch)
    one_lane = settings.model_copy(update={"heartbeat_threads": 1, "heartbeat_wait_max_s": 60})
    app = create_app(one_lane, clock=clock, run_background=False)
    with serving(app) as url, ThreadPoolExecutor(2) as pool:
        node_id, token = _register(url, 0)
        route, headers = f"{url}/api/v1/nodes/{node_id}/heartbeat", bearer(token)
        try:
            first = pool.submit(httpx.post, route, json={"running": []}, headers=headers)
            assert work.entered.wait(60)
            second = pool.submit(
                httpx.post, route, json={"running": []}, headers=headers, timeout=3
            )
            wait_for("the second to wait for the thread", lambda: _lane(app).waiting() == 1, 60)
            with pytest.raises(httpx.ReadTimeout):
                second.result(timeout=60)  # its client gives up, and closes the connection
        finally:
            work.release.set()
        assert first.result(timeout=60).status_code == 200
        wait_for("the abandoned heartbeat to be shed", lambda: _shed(app, "gone") == 1, 30)
        assert work.calls == 1
        assert httpx.post(route, json={"running": []}, headers=headers).status_code == 200
        assert (work.calls, _shed(app, "waited")) == (2, 0)


def test_a_locked_sqlite_database_is_a_503_to_retry(
    api: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's write lock still taken after the busy timeout: the agent is told to retry,
    as it does on 503, instead of getting a 500."""
    node_id = register(api, "busy")

    def locked(*_: object, **__: object) -> None:
        raise OperationalError(
            "BEGIN IMMEDIATE", {}, sqlite3.OperationalError("database is locked")
        )

    monkeypatch.setattr(heartbeats, "record", locked)  # SQLite's way
    monkeypatch.setattr(heartbeats.OneStatement, "__call__", locked)  # PostgreSQL's
    response = api.post(f"/api/v1/nodes/{node_id}/heartbeat", json={"running": []})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_an_in_memory_sqlite_database_takes_no_pool_size(url: str) -> None:
    """It lives in one connection, which SQLAlchemy refuses pool sizes for; the engine is
    still made, and works."""
    engine = make_engine(url, connections=44)
    with engine.connect() as connection:
        assert connection.exec_driver_sql("select 1").scalar() == 1
    engine.dispose()


def test_the_pool_keeps_open_the_connections_its_load_needed(db_url: str) -> None:
    """Twenty held at once, then returned: all twenty stay open, and twenty more at once
    open none (a pool that kept ten opened a new PostgreSQL connection for most requests
    once more than ten ran together); a twenty-first waits, as the limit says."""
    engine = make_engine(db_url, connections=20)
    opened = []
    event.listen(engine, "connect", lambda *_: opened.append(1))
    try:
        for _ in range(2):
            held = [engine.raw_connection() for _ in range(20)]
            for connection in held:
                connection.close()  # back to the pool
            assert engine.pool.checkedin() == 20  # type: ignore[attr-defined]
        assert len(opened) == 20
        held = [engine.raw_connection() for _ in range(20)]
        engine.pool._timeout = 0.1  # type: ignore[attr-defined]
        with pytest.raises(PoolTimeout):
            engine.raw_connection()
        for connection in held:
            connection.close()
    finally:
        engine.dispose()
