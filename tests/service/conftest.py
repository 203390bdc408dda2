from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service import auth
from service.api.app import create_app
from service.db import transaction
from service.models import Role
from service.reconciler import Reconciler
from service.settings import ControllerSettings
from tests.conftest import FakeClock

ENROLMENT_TOKEN = "enrol-" + "x" * 32
_NODE_ROUTE = re.compile(r"^/api/v1/nodes/(\d+)/(heartbeat|reports|leave)$")


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> ControllerSettings:
    return ControllerSettings(
        data_dir=tmp_path / "data",
        database_url=db_url,
        store_port=29999,
        node_timeout_s=10,
        enrolment_token=ENROLMENT_TOKEN,
    )


class Cluster(TestClient):
    """The API as every party calls it: job and user routes as a user (the first admin
    unless told otherwise), registration with the enrolment token, and each node's
    routes with the token that node got when it registered.

    A request that sets its own ``authorization`` header keeps it; the auth tests
    use that to call as someone else.
    """

    user_token: str = ""
    node_tokens: dict[int, str]

    def request(self, method: str, url: httpx.URL | str, **kwargs: Any) -> httpx.Response:  # type: ignore[override]
        headers = dict(kwargs.pop("headers", None) or {})
        path = httpx.URL(str(url)).path
        if not any(k.lower() == "authorization" for k in headers):
            headers["authorization"] = f"Bearer {self._token_for(path)}"
        response = super().request(method, url, headers=headers, **kwargs)
        if path == "/api/v1/nodes/register" and response.status_code == 200:
            body = response.json()
            self.node_tokens[body["node_id"]] = body["node_token"]
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


@pytest.fixture
def api(settings: ControllerSettings, clock: FakeClock) -> Iterator[Cluster]:
    """The real app with its real database, without the background loops."""
    app = create_app(settings, clock=clock, run_background=False)
    with Cluster(app) as client:
        client.node_tokens = {}
        client.user_token = client.add_user("root", Role.ADMIN)
        yield client


@pytest.fixture
def reconciler(api: TestClient, settings: ControllerSettings, clock: FakeClock) -> Reconciler:
    return Reconciler(api.app.state.session_factory, settings, clock)  # type: ignore[attr-defined]
