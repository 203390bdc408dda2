"""A reconciler pass costs the database the same number of statements however deep the queue."""

from __future__ import annotations

from collections import Counter

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from service.reconciler import Reconciler
from tests.service.helpers import Cluster, heartbeat, job, register, statements, submit


def passes(
    api: TestClient, reconciler: Reconciler, engine: Engine, nodes: list[int], queued: int
) -> tuple[list[str], list[str]]:
    """With every node free and ``queued`` jobs of one node each pending, the statements of
    two passes: the first places a job on each node and tells the others why they wait,
    the second finds nothing to do, and reads no spec."""
    with statements(engine) as placing:
        actions = reconciler.run_once()
    assert Counter(type(a).__name__ for a in actions) == {
        "PlaceJob": len(nodes),
        "ExplainWait": queued - len(nodes),
    }
    for node_id in nodes:
        heartbeat(api, node_id)
    with statements(engine) as steady:
        assert reconciler.run_once() == []
    # The open jobs' specs were read once, and kept.
    assert [s for s in steady if "jobs.spec" in s] == []
    return placing, steady


@pytest.mark.parametrize(
    ("gpus", "why"),
    [
        (0, "waiting for nodes: needs 1, too few are free; other jobs hold the rest"),
        (
            1,
            "waiting for GPUs: needs 1 node with 1 free GPU; "
            "no node has 1 free GPU: other jobs hold them",
        ),
    ],
    ids=["cpu", "cuda"],
)
def test_a_pass_sends_as_many_statements_for_30_jobs_as_for_3(
    api: Cluster, reconciler: Reconciler, gpus: int, why: str
) -> None:
    """On CPU nodes, and on nodes of one GPU each (where the jobs are placed on "cuda")."""
    engine = api.app.state.session_factory.kw["bind"]  # type: ignore[attr-defined]
    api.user_token = api.add_user("queue", max_active_jobs=100, max_nodes=100)
    inventory = [{"index": i, "name": "gpu"} for i in range(gpus)]
    nodes = [register(api, "a", gpus=inventory), register(api, "b", gpus=inventory)]
    reconciler.run_once()  # takes the lease: every later pass renews it the same way
    few = [submit(api, "1:1") for _ in range(3)]
    few_placing, few_steady = passes(api, reconciler, engine, nodes, len(few))

    for job_id in few:
        assert api.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 200
    many = [submit(api, "1:1") for _ in range(30)]
    many_placing, many_steady = passes(api, reconciler, engine, nodes, len(many))

    assert len(many_placing) == len(few_placing), (few_placing, many_placing)
    assert len(many_steady) == len(few_steady), (few_steady, many_steady)
    for job_id in many[len(nodes) :]:
        assert (job(api, job_id)["state"], job(api, job_id)["message"]) == ("PENDING", why)
        events = api.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
        assert [(e["kind"], e["message"], e["data"]) for e in events] == [
            ("submitted", "job 'j' submitted by queue", {}),
            ("waiting", why, {}),
        ]
