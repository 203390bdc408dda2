"""The reconciler's decisions, as a pure function of the world and the time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from service.reconciler import (
    AddMembers,
    ExplainWait,
    Fleet,
    GiveUpWaiting,
    JobView,
    MarkNodeLost,
    NodeView,
    PlaceJob,
    WaitForNodes,
    plan,
    rest_after,
    room_left,
    stalled,
)
from service.spec import JobSpec, TaskSpec
from service.states import JobState, NodeState

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TIMEOUT = timedelta(seconds=10)
ONE_OF_TWO = "waiting for nodes: needs 2, too few nodes are alive"
FREE3 = "waiting for nodes: needs 3, too few are free; other jobs hold the rest"


def node(
    id: int, seen: float = 0.0, state: NodeState = NodeState.ALIVE, slots: int = 1
) -> NodeView:
    return NodeView(id=id, state=state, last_heartbeat_at=T0 + timedelta(seconds=seen), slots=slots)


def spec(nnodes: tuple[int, int], nproc: int = 1) -> JobSpec:
    return JobSpec(
        name="j",
        task=TaskSpec(name="regression"),
        nnodes=f"{nnodes[0]}:{nnodes[1]}",
        nproc_per_node=nproc,
        wait_for_nodes_s=60,
    )


def job(
    id: int,
    nnodes: tuple[int, int] = (1, 2),
    state: JobState = JobState.PENDING,
    members: tuple[int, ...] = (),
    nproc: int = 1,
    created: float = 0.0,
    waiting_since: float | None = None,
    not_before: float | None = None,
    message: str = "",
) -> JobView:
    return JobView(
        id=id,
        state=state,
        created_at=T0 + timedelta(seconds=created),
        spec=spec(nnodes, nproc),
        attempt_id=100 + id if state.is_active() else None,
        members=members,
        waiting_since=None if waiting_since is None else T0 + timedelta(seconds=waiting_since),
        not_before=None if not_before is None else T0 + timedelta(seconds=not_before),
        message=message,
    )


def test_pending_job_waits_until_min_nodes_are_free() -> None:
    assert plan(T0, [node(1)], [job(1, (2, 2))], TIMEOUT) == [
        ExplainWait(1, JobState.PENDING, ONE_OF_TWO)
    ]
    assert plan(T0, [node(1), node(2)], [job(1, (2, 2))], TIMEOUT) == [PlaceJob(1, (1, 2))]


def test_placement_takes_at_most_max_nodes_and_oldest_job_first() -> None:
    nodes = [node(i) for i in (1, 2, 3)]
    jobs = [job(2, (1, 2), created=5.0), job(1, (1, 2), created=1.0)]
    assert plan(T0, nodes, jobs, TIMEOUT) == [PlaceJob(1, (1, 2)), PlaceJob(2, (3,))]


def test_busy_nodes_are_not_placed_twice() -> None:
    nodes = [node(1), node(2)]
    jobs = [job(1, (1, 1), JobState.RUNNING, members=(1,)), job(2, (2, 2))]
    assert plan(T0, nodes, jobs, TIMEOUT) == [
        ExplainWait(
            2,
            JobState.PENDING,
            "waiting for nodes: needs 2, too few are free; other jobs hold the rest",
        )
    ]


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


def test_losing_every_member_makes_the_job_wait() -> None:
    now = T0 + timedelta(seconds=30)
    nodes = [node(1, seen=0.0), node(2, state=NodeState.LOST)]
    jobs = [job(1, (1, 2), JobState.RESTARTING, members=(1, 2))]
    assert plan(now, nodes, jobs, TIMEOUT) == [
        MarkNodeLost(1, now - TIMEOUT),
        WaitForNodes(1, 101),
    ]


def test_falling_below_min_makes_the_job_wait_even_with_a_node_left() -> None:
    now = T0 + timedelta(seconds=30)
    nodes = [node(1, seen=29.0), node(2, state=NodeState.LOST)]
    jobs = [job(1, (2, 3), JobState.RUNNING, members=(1, 2))]
    assert plan(now, nodes, jobs, TIMEOUT) == [WaitForNodes(1, 101)]


def test_a_waiting_job_is_placed_again_when_min_nodes_are_free() -> None:
    nodes = [node(1, seen=30.0), node(2, seen=30.0)]
    jobs = [job(1, (2, 2), JobState.WAITING, waiting_since=10.0)]
    assert plan(T0 + timedelta(seconds=30), nodes, jobs, TIMEOUT) == [PlaceJob(1, (1, 2))]


def test_a_waiting_job_fails_once_its_deadline_has_passed() -> None:
    nodes = [node(1, seen=70.0)]
    jobs = [job(1, (2, 2), JobState.WAITING, waiting_since=10.0, message=ONE_OF_TWO)]
    assert plan(T0 + timedelta(seconds=70), nodes, jobs, TIMEOUT) == []
    later = T0 + timedelta(seconds=70.5)
    assert plan(later, nodes, jobs, TIMEOUT) == [GiveUpWaiting(1, T0 + timedelta(seconds=10))]


def test_a_waiting_job_is_not_placed_before_its_back_off_ends() -> None:
    nodes = [node(1, seen=20.0)]
    jobs = [job(1, (1, 1), JobState.WAITING, waiting_since=10.0, not_before=25.0)]
    assert plan(T0 + timedelta(seconds=20), nodes, jobs, TIMEOUT) == []
    assert plan(T0 + timedelta(seconds=25), nodes, jobs, TIMEOUT) == [PlaceJob(1, (1,))]


def test_running_job_below_max_takes_a_new_node() -> None:
    nodes = [node(1), node(2), node(3)]
    jobs = [job(1, (1, 3), JobState.RUNNING, members=(1,))]
    assert plan(T0, nodes, jobs, TIMEOUT) == [AddMembers(1, 101, (2, 3))]


def test_a_node_that_was_lost_and_is_back_joins_the_running_attempt_in_place() -> None:
    """Lost at 11 s (its attempt goes on without it), back at 20 s: added again."""
    running = job(1, (1, 2), JobState.RUNNING, members=(1, 2))
    assert plan(T0 + timedelta(seconds=11), [node(1, seen=11.0), node(2)], [running], TIMEOUT) == [
        MarkNodeLost(2, T0 + timedelta(seconds=1))
    ]
    shrunk = job(1, (1, 2), JobState.RUNNING, members=(1,))
    back = [node(1, seen=20.0), node(2, seen=20.0)]
    assert plan(T0 + timedelta(seconds=20), back, [shrunk], TIMEOUT) == [AddMembers(1, 101, (2,))]


def test_a_late_pass_means_the_controller_stalled_not_its_nodes() -> None:
    """Half the node timeout without a pass: the heartbeat handlers were starved too."""
    assert not stalled(None, T0, TIMEOUT)
    assert not stalled(T0, T0 + timedelta(seconds=5), TIMEOUT)
    assert stalled(T0, T0 + timedelta(seconds=5.1), TIMEOUT)


def test_the_loop_rests_so_that_passes_take_at_most_their_share_of_the_cpu() -> None:
    """A quarter at most: a pass of 0.3 s on a CPU rests 0.9 s after it, one of 10 ms 30 ms
    (less than the interval, so a wake still starts the next pass then), and time it spent
    waiting (on the database) earns no rest; never so long that more than a third of the
    lease passes between two renewals, or that the next pass would count as ``stalled``."""
    assert rest_after(0.3, 0.3, 0.25, 0.5, 10.0, 10.0) == pytest.approx(0.9)
    assert rest_after(0.01, 0.01, 0.25, 0.5, 10.0, 10.0) == pytest.approx(0.03)
    assert rest_after(2.0, 0.1, 0.25, 0.5, 10.0, 10.0) == pytest.approx(0.3)
    assert rest_after(0.3, 0.3, 1.0, 0.5, 10.0, 10.0) == 0.0
    assert rest_after(1.5, 1.5, 0.25, 0.5, 6.0, 30.0) == pytest.approx(0.5)  # 6 / 3 - 1.5
    assert rest_after(1.0, 1.0, 0.25, 0.5, 30.0, 10.0) == pytest.approx(3.0)  # 5 - 0.5 - 1
    assert rest_after(4.8, 4.8, 0.25, 0.5, 30.0, 10.0) == 0.0
    # A pass that found its lease renewed 9 s before (and did not renew it) rests so that
    # the next pass, which renews it, begins before a third of the 30 s lease has passed.
    assert rest_after(0.1, 0.1, 0.01, 0.5, 30.0, 60.0, lease_age_s=9.0) == pytest.approx(0.9)
    assert rest_after(0.1, 0.1, 0.01, 0.5, 30.0, 60.0, lease_age_s=11.0) == 0.0
    for took in (0.1, 1.0, 2.0, 3.0, 4.0):
        rest = rest_after(took, took, 0.25, 0.5, 30.0, 10.0)
        assert not stalled(T0, T0 + timedelta(seconds=took + rest + 0.5), TIMEOUT)
        assert rest_after(took, took, 0.25, 0.5, 9.0, 60.0) <= max(0.0, 3.0 - took)


def test_pending_jobs_get_free_nodes_before_running_jobs_grow() -> None:
    nodes = [node(1), node(2)]
    jobs = [job(1, (1, 2), JobState.RUNNING, members=(1,)), job(2, (1, 1), created=9.0)]
    assert plan(T0, nodes, jobs, TIMEOUT) == [PlaceJob(2, (2,))]


def test_lost_nodes_are_never_placed() -> None:
    nodes = [node(1, state=NodeState.LOST), node(2)]
    assert plan(T0, nodes, [job(1, (2, 2), message=ONE_OF_TWO)], TIMEOUT) == []


def test_plan_is_pure() -> None:
    nodes = [node(1), node(2)]
    jobs = [job(1, (1, 2))]
    assert plan(T0, nodes, jobs, TIMEOUT) == plan(T0, nodes, jobs, TIMEOUT)


def test_a_fleet_works_out_once_what_the_same_running_attempts_hold() -> None:
    """A pass asks it of the queue's head (``room_left``), then of its plan: the second
    question gets the first's answer, other running attempts their own, and a plan on
    a fleet asked before decides what a plan alone does."""
    nodes = [node(1), node(2), node(3, seen=-20)]  # node 3 has been silent too long
    running = job(1, (1, 1), JobState.RUNNING, members=(1,))
    stranded = job(2, (1, 1), JobState.RUNNING, members=(3,))
    queued = job(3, (1, 1), created=1.0)
    fleet = Fleet(T0, nodes, TIMEOUT)
    first = fleet.running([running, stranded], False)
    assert [j.id for j, _ in first.attempts] == [1]
    assert first.waits == [WaitForNodes(2, 102)]
    assert fleet.running([running, queued, stranded], False) is first
    assert room_left(T0, fleet, [running, stranded]).fitting("cpu", 1) == [(2, ())]
    jobs = [running, stranded, queued]
    shared = plan(T0, nodes, jobs, TIMEOUT, False, fleet)
    assert shared == plan(T0, nodes, jobs, TIMEOUT)
    assert shared[1:] == [WaitForNodes(2, 102), PlaceJob(3, (2,))]
    other = fleet.running([running], False)
    assert other is not first
    assert (other.attempts, other.waits) == ([(running, [1])], [])
    assert fleet.running([running], True) is not other


def explained(now: datetime, nodes: list[NodeView], jobs: list[JobView]) -> dict[int, str]:
    return {
        a.job_id: a.reason for a in plan(now, nodes, jobs, TIMEOUT) if isinstance(a, ExplainWait)
    }


def test_a_job_that_cannot_be_placed_is_told_why_once() -> None:
    nodes = [node(1), node(2)]
    pending = job(1, (3, 3))
    assert plan(T0, nodes, [pending], TIMEOUT) == [
        ExplainWait(1, JobState.PENDING, "waiting for nodes: needs 3, too few nodes are alive")
    ]
    told = job(1, (3, 3), message="waiting for nodes: needs 3, too few nodes are alive")
    assert plan(T0 + timedelta(seconds=5), nodes, [told], TIMEOUT) == []
    assert explained(T0, [*nodes, node(3, state=NodeState.LOST)], [told]) == {}
    assert plan(T0, [*nodes, node(3)], [told], TIMEOUT) == [PlaceJob(1, (1, 2, 3))]


def test_the_reason_tells_busy_nodes_from_missing_ones() -> None:
    nodes = [node(1), node(2), node(3)]
    jobs = [job(1, (2, 2), JobState.RUNNING, members=(1, 2)), job(2, (3, 3), created=1.0)]
    assert explained(T0, nodes, jobs) == {
        2: "waiting for nodes: needs 3, too few are free; other jobs hold the rest"
    }


def test_nodes_an_older_job_takes_in_the_same_pass_count_as_busy() -> None:
    nodes = [node(1), node(2)]
    jobs = [job(1, (2, 2), created=0.0), job(2, (2, 2), created=1.0)]
    actions = plan(T0, nodes, jobs, TIMEOUT)
    assert actions == [
        PlaceJob(1, (1, 2)),
        ExplainWait(
            2,
            JobState.PENDING,
            "waiting for nodes: needs 2, too few are free; other jobs hold the rest",
        ),
    ]


def test_the_reason_names_nodes_with_too_few_slots() -> None:
    nodes = [node(1, slots=4), node(2, slots=1), node(3, slots=2)]
    assert explained(T0, nodes, [job(1, (2, 2), nproc=4)]) == {
        1: "waiting for nodes: needs 2 with 4 slots each, too few alive nodes have that many slots"
    }


def test_the_reason_says_when_no_node_is_alive() -> None:
    nodes = [node(1, state=NodeState.LOST)]
    assert explained(T0, nodes, [job(1, (1, 1))]) == {
        1: "waiting for nodes: needs 1, no node is alive"
    }


def test_a_waiting_job_is_told_why_after_its_back_off_but_not_during_it() -> None:
    nodes = [node(1, seen=20.0)]
    waiting = job(1, (2, 2), JobState.WAITING, waiting_since=10.0, not_before=25.0)
    assert plan(T0 + timedelta(seconds=20), nodes, [waiting], TIMEOUT) == []
    assert plan(T0 + timedelta(seconds=25), nodes, [waiting], TIMEOUT) == [
        ExplainWait(1, JobState.WAITING, ONE_OF_TWO)
    ]


def test_a_waiting_job_whose_deadline_passed_fails_instead_of_being_explained() -> None:
    nodes = [node(1, seen=70.5)]
    waiting = job(1, (2, 2), JobState.WAITING, waiting_since=10.0)
    later = T0 + timedelta(seconds=70.5)
    assert plan(later, nodes, [waiting], TIMEOUT) == [GiveUpWaiting(1, T0 + timedelta(seconds=10))]


def test_the_reason_changes_with_the_case_not_with_the_counts() -> None:
    """Nodes come and go: the reason names no count, so it stays until the case changes
    and a deep queue is not rewritten at every change of the cluster."""
    told = job(1, (3, 3), message="waiting for nodes: needs 3, too few nodes are alive")
    assert explained(T0, [node(1)], [told]) == {}
    assert explained(T0, [node(1), node(2)], [told]) == {}
    busy = job(2, (1, 1), JobState.RUNNING, members=(3,))
    assert explained(T0, [node(1), node(2), node(3)], [told, busy]) == {1: FREE3}
