"""Helpers for the controller tests: the API as each party calls it, and the calls
that nodes and users make in most tests."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import httpx
from fastapi.testclient import TestClient
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from service import auth
from service.db import transaction
from service.models import Role

ENROLMENT_TOKEN = "enrol-" + "x" * 32
_NODE_ROUTE = re.compile(r"^/api/v1/nodes/(\d+)/(heartbeat|reports|leave)$")


class Cluster(TestClient):
    """The API as every party calls it: job and user routes as a user (the first admin
    unless told otherwise), registration with the enrolment token, and each node's
    routes with the token that node got when it registered. Like a real agent, which
    keeps its node token, ``register`` presents the token the name last got.

    A request that sets its own ``authorization`` header keeps it; the auth tests
    use that to call as someone else.
    """

    user_token: str = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.node_tokens: dict[int, str] = {}
        self.name_tokens: dict[str, str] = {}

    def request(self, method: str, url: httpx.URL | str, **kwargs: Any) -> httpx.Response:  # type: ignore[override]
        headers = dict(kwargs.pop("headers", None) or {})
        path = httpx.URL(str(url)).path
        if not any(k.lower() == "authorization" for k in headers):
            headers["authorization"] = f"Bearer {self._token_for(path)}"
        response = super().request(method, url, headers=headers, **kwargs)
        if path == "/api/v1/nodes/register" and response.status_code == 200:
            body = response.json()
            self.node_tokens[body["node_id"]] = body["node_token"]
            self.name_tokens[kwargs["json"]["name"]] = body["node_token"]
        return response

    def _token_for(self, path: str) -> str:
        if path == "/api/v1/nodes/register":
            return ENROLMENT_TOKEN
        node = _NODE_ROUTE.match(path)
        if node:
            return self.node_tokens.get(int(node.group(1)), "no-such-node-token")
        return self.user_token

    def add_user(self, name: str, role: Role = Role.USER, **limits: int) -> str:
        """A new user, made straight in the database; returns their token."""
        factory = self.app.state.session_factory  # type: ignore[attr-defined]
        with transaction(factory) as session:
            return auth.create_user(session, name, role, self.app.state.clock(), **limits)[2]  # type: ignore[attr-defined]


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def register(api: TestClient, name: str, slots: int = 1, **extra: Any) -> int:
    """Register ``name`` as its agent does: with the node token it got last time, if any;
    ``extra`` adds to the body (``gpus``, ``cpus``, ...)."""
    node_token = getattr(api, "name_tokens", {}).get(name)
    r = api.post(
        "/api/v1/nodes/register",
        json={
            "name": name,
            "address": "127.0.0.1",
            "slots": slots,
            "pid": 1,
            "node_token": node_token,
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    node_id: int = r.json()["node_id"]
    return node_id


def heartbeat(api: TestClient, node_id: int) -> list[dict[str, Any]]:
    r = api.post(f"/api/v1/nodes/{node_id}/heartbeat", json={"running": []})
    assert r.status_code == 200, r.text
    assignments: list[dict[str, Any]] = r.json()["assignments"]
    return assignments


def submit(api: TestClient, nnodes: str = "2:2", **extra: Any) -> int:
    spec = {
        "name": "j",
        "task": {"name": "regression", "params": {"epochs": 2}},
        "nnodes": nnodes,
        "snapshot": {"every_steps": 5},
        **extra,
    }
    r = api.post("/api/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job_id: int = r.json()["id"]
    return job_id


def event(kind: str, **data: Any) -> dict[str, Any]:
    return {"time": datetime.now(UTC).isoformat(), "kind": kind, "data": data}


def report(api: TestClient, node_id: int, attempt_id: int, **body: Any) -> Any:
    return api.post(f"/api/v1/nodes/{node_id}/reports", json={"attempt_id": attempt_id, **body})


def job(api: TestClient, job_id: int) -> dict[str, Any]:
    body: dict[str, Any] = api.get(f"/api/v1/jobs/{job_id}").json()
    return body


def kinds(api: TestClient, job_id: int) -> list[str]:
    return [e["kind"] for e in api.get(f"/api/v1/jobs/{job_id}/events").json()["items"]]


def engines_of(app: Any) -> list[Engine]:
    """The engines ``app`` sends statements on: its main one, and on PostgreSQL the pool of
    its heartbeats' one statement when that is a pool of its own
    (``heartbeat_synchronous_commit`` off, the default)."""
    engine: Engine = app.state.session_factory.kw["bind"]
    one_statement = app.state.heartbeat_one_statement
    if one_statement is not None and one_statement.engine.pool is not engine.pool:
        return [engine, one_statement.engine]
    return [engine]


@contextmanager
def statements(*engines: Engine) -> Iterator[list[str]]:
    """Every statement sent on ``engines`` meanwhile (an executemany counts once), in the
    order sent."""
    sent: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement)

    for engine in engines:
        sa_event.listen(engine, "before_cursor_execute", note)
    try:
        yield sent
    finally:
        for engine in engines:
            sa_event.remove(engine, "before_cursor_execute", note)


@contextmanager
def commits(*engines: Engine) -> Iterator[list[object]]:
    """A note of every transaction committed on ``engines`` meanwhile."""
    committed: list[object] = []

    def note(conn: Any) -> None:
        committed.append(conn)

    for engine in engines:
        sa_event.listen(engine, "commit", note)
    try:
        yield committed
    finally:
        for engine in engines:
            sa_event.remove(engine, "commit", note)


def query_plans(session: Session, read: Callable[[Session], Any]) -> list[str]:
    """The database's plan of each statement ``read`` sends, with the values it sent; on
    PostgreSQL with sequential scans priced out, so that a plan takes an index wherever
    one serves (tables this small are otherwise read whole)."""
    connection = session.connection()
    sent: list[tuple[str, Any]] = []

    def note(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        sent.append((statement, parameters))

    postgresql = connection.dialect.name == "postgresql"
    if postgresql:
        connection.exec_driver_sql("SET LOCAL enable_seqscan = off")
    sa_event.listen(connection, "before_cursor_execute", note)
    try:
        read(session)
    finally:
        sa_event.remove(connection, "before_cursor_execute", note)
    assert sent
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    plans = []
    explain = "EXPLAIN " if postgresql else "EXPLAIN QUERY PLAN "
    for statement, parameters in sent:
        cursor.execute(explain + statement, parameters)
        plans.append("\n".join(str(row) for row in cursor.fetchall()))
    return plans
