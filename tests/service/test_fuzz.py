"""Schemathesis against the OpenAPI document, as an authenticated caller: whatever the
generated input, no answer is a 5xx and every answer is one the document describes
(status code, content type, headers and body schema); a route refuses a request
without its credential; and input the schema forbids is refused.

One check is left out: that every schema-valid request is accepted. A spec has
rules across fields that a JSON schema does not say (exactly one of task and
script, MIN <= MAX nodes, a task's own parameters); breaking them is a 422 that
says what to fix, which is the answer we want.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from service.api import rendezvous
from service.api.app import create_app
from service.reconciler import Reconciler
from service.settings import ControllerSettings
from tests.service.helpers import ENROLMENT_TOKEN, Cluster, heartbeat, register, submit

# 25 per route in the suite; RELAUNCH_FUZZ_EXAMPLES=500 for a deeper run.
EXAMPLES = int(os.environ.get("RELAUNCH_FUZZ_EXAMPLES", "25"))
_NODE_ROUTE = re.compile(r"^/api/v1/nodes/\{node_id\}/")
_RDZV_ROUTE = re.compile(r"^/api/v1/rendezvous/")
_WORKER_ROUTE = re.compile(r"^/api/v1/workers/")


class Callers:
    """The right credential for each route: an admin with room to submit, the enrolment
    token, a registered node's own token (for its attempt's rendezvous too), or the
    worker token of that attempt."""

    def __init__(self, api: Cluster, reconciler: Reconciler) -> None:
        self.admin = api.add_user("fuzzer", max_active_jobs=100_000, max_nodes=1_000_000)
        self.node_id = register(api, "fuzz-node")
        self.node = api.node_tokens[self.node_id]
        submit(api, "1")
        reconciler.run_once()
        [assignment] = heartbeat(api, self.node_id)
        self.rdzv_id = assignment["rendezvous"]["rdzv_id"]
        self.job_id = assignment["job_id"]
        self.worker = assignment["worker_token"]

    def headers(self, path: str) -> dict[str, str]:
        if path == "/api/v1/nodes/register":
            token = ENROLMENT_TOKEN
        elif _NODE_ROUTE.match(path) or _RDZV_ROUTE.match(path):
            token = self.node
        elif _WORKER_ROUTE.match(path):
            token = self.worker
        else:
            token = self.admin
        return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def callers(api: Cluster, reconciler: Reconciler, monkeypatch: pytest.MonkeyPatch) -> Callers:
    monkeypatch.setattr(rendezvous, "MAX_WAIT_S", 0.01)  # a read of absent keys waits this long
    return Callers(api, reconciler)


def _operations() -> list[tuple[str, str]]:
    """Every (method, path) of the API: the document does not depend on the database."""
    app = create_app(ControllerSettings(database_url="sqlite://"), run_background=False)
    paths = app.openapi()["paths"]
    return sorted((method.upper(), path) for path, ops in paths.items() for method in ops)


@pytest.mark.parametrize(("method", "path"), _operations(), ids=lambda v: str(v))
def test_the_api_keeps_its_documented_contract(
    api: Cluster, callers: Callers, method: str, path: str
) -> None:
    operation = schemathesis.openapi.from_asgi("/openapi.json", api.app)[path][method]

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    def call(case: Any) -> None:
        if _NODE_ROUTE.match(path):
            # Generated node ids name other nodes (403); fuzz this node's own routes too.
            case.path_parameters = {**(case.path_parameters or {}), "node_id": callers.node_id}
        if _RDZV_ROUTE.match(path):  # and the rendezvous of the node's own attempt
            case.path_parameters = {**(case.path_parameters or {}), "rdzv_id": callers.rdzv_id}
        if _WORKER_ROUTE.match(path):  # and the fence of the worker token's own job
            case.path_parameters = {**(case.path_parameters or {}), "job_id": callers.job_id}
        # On the case, not the call: the check that a route refuses a request without
        # its credential (schemathesis's ignored_auth) removes it from the case.
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        case.headers = {**headers, **callers.headers(path)}
        case.call_and_validate(excluded_checks=[positive_data_acceptance])

    call()
