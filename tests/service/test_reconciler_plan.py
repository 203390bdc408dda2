"""The reconciler's decisions, as a pure function of the world and the time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from service.reconciler import (
    AddMembers,
    JobView,
    MarkNodeLost,
    NodeView,
    PlaceJob,
    RequeueJob,
    plan,
)
from service.states import JobState, NodeState

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TIMEOUT = timedelta(seconds=10)


def node(
    id: int, seen: float = 0.0, state: NodeState = NodeState.ALIVE, slots: int = 1
) -> NodeView:
    return NodeView(id=id, state=state, last_heartbeat_at=T0 + timedelta(seconds=seen), slots=slots)


def job(
    id: int,
    nnodes: tuple[int, int] = (1, 2),
    state: JobState = JobState.PENDING,
    members: tuple[int, ...] = (),
    nproc: int = 1,
    created: float = 0.0,
) -> JobView:
    return JobView(
        id=id,
        state=state,
        created_at=T0 + timedelta(seconds=created),
        min_nodes=nnodes[0],
        max_nodes=nnodes[1],
        nproc_per_node=nproc,
        attempt_id=100 + id if state.is_active() else None,
        members=members,
    )


def test_pending_job_waits_until_min_nodes_are_free() -> None:
    assert plan(T0, [node(1)], [job(1, (2, 2))], TIMEOUT) == []
    assert plan(T0, [node(1), node(2)], [job(1, (2, 2))], TIMEOUT) == [PlaceJob(1, (1, 2))]


def test_placement_takes_at_most_max_nodes_and_oldest_job_first() -> None:
    nodes = [node(i) for i in (1, 2, 3)]
    jobs = [job(2, (1, 2), created=5.0), job(1, (1, 2), created=1.0)]
    assert plan(T0, nodes, jobs, TIMEOUT) == [PlaceJob(1, (1, 2)), PlaceJob(2, (3,))]


def test_busy_nodes_are_not_placed_twice() -> None:
    nodes = [node(1), node(2)]
    jobs = [job(1, (1, 1), JobState.RUNNING, members=(1,)), job(2, (2, 2))]
    assert plan(T0, nodes, jobs, TIMEOUT) == []


def test_nodes_without_enough_slots_do_not_count() -> None:
    nodes = [node(1, slots=1), node(2, slots=4)]
    assert plan(T0, nodes, [job(1, (1, 2), nproc=2)], TIMEOUT) == [PlaceJob(1, (2,))]


def test_silent_node_is_lost_only_after_the_timeout() -> None:
    nodes = [node(1, seen=0.0)]
    assert plan(T0 + timedelta(seconds=10), nodes, [], TIMEOUT) == []
    later = T0 + timedelta(seconds=10.5)
    assert plan(later, nodes, [], TIMEOUT) == [MarkNodeLost(1, later - TIMEOUT)]


def test_losing_one_of_two_members_keeps_the_job_running() -> None:
    now = T0 + timedelta(seconds=30)
    nodes = [node(1, seen=0.0), node(2, seen=29.0)]
    jobs = [job(1, (1, 2), JobState.RUNNING, members=(1, 2))]
    assert plan(now, nodes, jobs, TIMEOUT) == [MarkNodeLost(1, now - TIMEOUT)]


def test_losing_every_member_requeues_the_job() -> None:
    now = T0 + timedelta(seconds=30)
    nodes = [node(1, seen=0.0), node(2, state=NodeState.LOST)]
    jobs = [job(1, (1, 2), JobState.RESTARTING, members=(1, 2))]
    assert plan(now, nodes, jobs, TIMEOUT) == [MarkNodeLost(1, now - TIMEOUT), RequeueJob(1, 101)]


def test_running_job_below_max_takes_a_new_node() -> None:
    nodes = [node(1), node(2), node(3)]
    jobs = [job(1, (1, 3), JobState.RUNNING, members=(1,))]
    assert plan(T0, nodes, jobs, TIMEOUT) == [AddMembers(1, 101, (2, 3))]


def test_pending_jobs_get_free_nodes_before_running_jobs_grow() -> None:
    nodes = [node(1), node(2)]
    jobs = [job(1, (1, 2), JobState.RUNNING, members=(1,)), job(2, (1, 1), created=9.0)]
    assert plan(T0, nodes, jobs, TIMEOUT) == [PlaceJob(2, (2,))]


def test_lost_nodes_are_never_placed() -> None:
    nodes = [node(1, state=NodeState.LOST), node(2)]
    assert plan(T0, nodes, [job(1, (2, 2))], TIMEOUT) == []


def test_plan_is_pure() -> None:
    nodes = [node(1), node(2)]
    jobs = [job(1, (1, 2))]
    assert plan(T0, nodes, jobs, TIMEOUT) == plan(T0, nodes, jobs, TIMEOUT)
