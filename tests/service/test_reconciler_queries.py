"""A reconciler pass costs the database the same number of statements however deep the
queue, and makes again only the views of the rows that changed."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select
from sqlalchemy.exc import MultipleResultsFound

from service.db import transaction
from service.models import Attempt
from service.reconciler import JobView, NodeView, Reconciler, ViewCache, read_fleet
from service.states import AttemptState, JobState, NodeState
from tests.helpers import FakeClock
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


def test_a_pass_makes_again_only_the_views_of_rows_that_changed(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    """The views a read makes are kept for the next: a row as it was gives the same view,
    a changed one (a heartbeat, a node lost, a job that waits) a new view that says so,
    and the views of rows no longer read are dropped."""
    a, b = register(api, "a"), register(api, "b")
    first, second = submit(api, "1:1"), submit(api, "1:1")
    reconciler.run_once()
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    views, specs = ViewCache(), {}

    def read() -> tuple[dict[int, NodeView], dict[int, JobView]]:
        with transaction(factory) as session:
            nodes, jobs = read_fleet(session, specs, 5.0, None, views)
        return {n.id: n for n in nodes}, {j.id: j for j in jobs}

    nodes, jobs = read()
    assert {j.id: j.members for j in jobs.values()} == {first: (a,), second: (b,)}
    again_nodes, again_jobs = read()
    assert all(again_nodes[i] is nodes[i] for i in (a, b))
    assert all(again_jobs[i] is jobs[i] for i in (first, second))

    clock.advance(11)  # past the node timeout: b, silent, is lost
    heartbeat(api, a)
    reconciler.run_once()
    later_nodes, later_jobs = read()
    assert later_nodes[a] is not nodes[a]
    assert later_nodes[a].last_heartbeat_at == clock.now
    assert later_nodes[b].state is NodeState.LOST
    assert later_jobs[first] is jobs[first]
    assert (later_jobs[second].state, later_jobs[second].members) == (JobState.WAITING, ())
    assert len(views.nodes) == 2
    kept = [view for _, view in views.jobs.values()]
    assert kept[0] is later_jobs[first] and kept[1] is later_jobs[second] and len(kept) == 2

    assert api.post(f"/api/v1/jobs/{second}/cancel").status_code == 200
    assert second not in read()[1]
    kept = [view for _, view in views.jobs.values()]
    assert len(kept) == 1 and kept[0] is later_jobs[first]


def test_a_view_is_made_again_when_what_is_beside_its_row_changes(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    """A scale-up changes the running attempt's members, not the job's row; the floor under
    a node's last heartbeat and the base heartbeat interval are not in the node's row."""
    a = register(api, "a")
    grows = submit(api, "1:2")
    reconciler.run_once()  # on a alone
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    views, specs = ViewCache(), {}

    def read(
        heard_since: datetime | None = None, base_s: float = 5.0
    ) -> tuple[dict[int, NodeView], dict[int, JobView]]:
        with transaction(factory) as session:
            nodes, jobs = read_fleet(session, specs, base_s, heard_since, views)
        return {n.id: n for n in nodes}, {j.id: j for j in jobs}

    before = read()[1][grows]
    assert before.members == (a,)
    b = register(api, "b")
    reconciler.run_once()  # b joins the running attempt
    nodes, jobs = read()
    assert jobs[grows] is not before
    assert (jobs[grows].attempt_id, jobs[grows].members) == (before.attempt_id, (a, b))

    later = clock.now + timedelta(seconds=5)
    floored = read(heard_since=later)[0]
    assert all(floored[i] is not nodes[i] for i in (a, b))
    assert {floored[i].last_heartbeat_at for i in (a, b)} == {later}
    told_longer = read(heard_since=later, base_s=1.0)[0]
    assert all(told_longer[i] is not floored[i] for i in (a, b))
    assert read(heard_since=later, base_s=1.0)[0][a] is told_longer[a]


def test_a_job_with_two_running_attempts_is_an_error(api: Cluster, reconciler: Reconciler) -> None:
    register(api, "a")
    job_id = submit(api, "1:1")
    reconciler.run_once()
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        (first,) = session.scalars(select(Attempt).where(Attempt.job_id == job_id))
        session.add(
            Attempt(
                job_id=job_id,
                number=2,
                rdzv_id=f"{first.rdzv_id}-twice",
                state=AttemptState.RUNNING,
                started_count=0,
                created_at=first.created_at,
                result="",
                device="cpu",
            )
        )
    with (
        transaction(factory) as session,
        pytest.raises(MultipleResultsFound, match=f"job {job_id}"),
    ):
        read_fleet(session, {}, 5.0, None, ViewCache())
