"""A report with an event that does not validate is refused whole (422), and writes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from service.reconciler import Reconciler
from tests.service.helpers import Cluster

TIME = "2026-11-22T00:00:00Z"
SPEC = {"name": "j", "task": {"name": "regression", "params": {"epochs": 2}}}


@pytest.fixture
def placed(api: Cluster, reconciler: Reconciler) -> tuple[int, int, int]:
    """(node, job, attempt) of a one-node job running on its node."""
    r = api.post(
        "/api/v1/nodes/register", json={"name": "a", "address": "127.0.0.1", "slots": 1, "pid": 1}
    )
    node_id: int = r.json()["node_id"]
    job_id: int = api.post("/api/v1/jobs", json=SPEC).json()["id"]
    reconciler.run_once()
    [assignment] = api.post(f"/api/v1/nodes/{node_id}/heartbeat", json={"running": []}).json()[
        "assignments"
    ]
    return node_id, job_id, assignment["attempt_id"]


@pytest.mark.parametrize(
    ("kind", "data", "where"),
    [
        ("progress", {"step": 2**31}, "step"),
        ("progress", {"loss": "low"}, "loss"),
        ("snapshot", {"bytes": 2**63}, "bytes"),
        ("snapshot", {"path": "x" * 4097}, "path"),
        ("worker_failed", {"exitcode": "nine"}, "exitcode"),
        ("launcher_exit", {"outcome": "exploded"}, "outcome"),
        ("teleported", {}, "teleported"),
    ],
)
def test_a_report_with_an_invalid_event_is_refused_whole(
    api: Cluster, placed: tuple[int, int, int], kind: str, data: dict[str, Any], where: str
) -> None:
    node_id, job_id, attempt_id = placed
    report = {
        "attempt_id": attempt_id,
        "logs": [{"time": TIME, "line": "hello", "local_rank": 0}],
        "events": [
            {"time": TIME, "kind": "progress", "data": {"step": 1, "loss": 0.5}},
            {"time": TIME, "kind": kind, "data": data},
        ],
    }
    r = api.post(f"/api/v1/nodes/{node_id}/reports", json=report)
    assert r.status_code == 422, r.text
    assert where in r.text
    assert api.get(f"/api/v1/jobs/{job_id}/logs").json()["items"] == []
    assert api.get(f"/api/v1/jobs/{job_id}").json()["last_step"] is None


def test_the_zygote_a_node_runs_shows_on_the_timeline_and_its_memory_in_the_nodes(
    api: Cluster, placed: tuple[int, int, int]
) -> None:
    node_id, job_id, attempt_id = placed

    def report(*events: dict[str, Any]) -> None:
        body = {"attempt_id": attempt_id, "events": list(events)}
        r = api.post(f"/api/v1/nodes/{node_id}/reports", json=body)
        assert r.status_code == 200, r.text

    def memory() -> int | None:
        [node] = api.get("/api/v1/nodes").json()["items"]
        value: int | None = node["zygote_rss_bytes"]
        return value

    assert memory() is None
    ready = {"state": "ready", "pid": 77, "import_s": 2.5, "rss_bytes": 300 * 2**20}
    report({"time": TIME, "kind": "zygote", "data": ready})
    assert memory() == 300 * 2**20
    cold = {"local_rank": 0, "reason": "the zygote is gone"}
    lost = {"state": "lost", "pid": 77, "message": "the zygote (pid 77) is gone"}
    report(
        {"time": TIME, "kind": "zygote", "data": lost},
        {"time": TIME, "kind": "cold_start", "data": cold},
    )
    assert memory() is None
    listed = api.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
    events = {e["kind"]: e["message"] for e in listed}
    assert "warm zygote lost: the zygote (pid 77) is gone" in events["zygote"]
    assert "local rank 0 started cold: the zygote is gone" in events["cold_start"]
