"""A refused report (409) tells the node why its attempt is over: a cancel is not a fence."""

from __future__ import annotations

from typing import Any

from contract.protocol import ReportRefused, StopReason
from service.reconciler import Reconciler
from tests.service.helpers import Cluster


def _register(api: Cluster, name: str) -> int:
    body = {"name": name, "address": "127.0.0.1", "slots": 1, "pid": 1}
    r = api.post("/api/v1/nodes/register", json=body)
    assert r.status_code == 200, r.text
    node_id: int = r.json()["node_id"]
    return node_id


def _running_attempt(api: Cluster, reconciler: Reconciler, nnodes: str) -> tuple[int, int]:
    spec = {"name": "j", "task": {"name": "regression"}, "nnodes": nnodes}
    r = api.post("/api/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job_id: int = r.json()["id"]
    reconciler.run_once()
    job: dict[str, Any] = api.get(f"/api/v1/jobs/{job_id}").json()
    assert job["state"] == "RUNNING", job
    attempt_id: int = job["attempts"][0]["id"]
    return job_id, attempt_id


def _refusal(api: Cluster, node_id: int, attempt_id: int) -> ReportRefused:
    r = api.post(f"/api/v1/nodes/{node_id}/reports", json={"attempt_id": attempt_id, "logs": []})
    assert r.status_code == 409, r.text
    return ReportRefused.model_validate_json(r.content)


def test_a_report_on_a_cancelled_job_is_refused_as_cancelled(
    api: Cluster, reconciler: Reconciler
) -> None:
    a, b = _register(api, "a"), _register(api, "b")
    job_id, attempt_id = _running_attempt(api, reconciler, "2:2")
    assert api.post(f"/api/v1/jobs/{job_id}/cancel").json()["state"] == "CANCELLED"
    for node_id in (a, b):
        refused = _refusal(api, node_id, attempt_id)
        assert refused.reason is StopReason.CANCELLED
        assert f"attempt {attempt_id} is over" in refused.detail


def test_a_report_from_a_node_the_attempt_went_on_without_is_refused_as_fenced(
    api: Cluster, reconciler: Reconciler
) -> None:
    a, b, outsider = _register(api, "a"), _register(api, "b"), _register(api, "c")
    _, attempt_id = _running_attempt(api, reconciler, "1:2")
    assert _refusal(api, outsider, attempt_id).reason is StopReason.FENCED
    left = api.post(f"/api/v1/nodes/{b}/leave", json={})
    assert left.status_code == 200 and left.json()["left"], left.text
    assert _refusal(api, b, attempt_id).reason is StopReason.FENCED
    ok = api.post(f"/api/v1/nodes/{a}/reports", json={"attempt_id": attempt_id, "logs": []})
    assert ok.status_code == 200, ok.text
