"""Placement on GPUs, as a pure function of the world: a node is held whole by one CPU job,
or shared by CUDA jobs on disjoint GPUs."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Literal

import pytest

from service.placement import Hold, resolve_device
from service.reconciler import (
    Action,
    AddMembers,
    ExplainWait,
    JobView,
    NodeView,
    PlaceJob,
    plan,
)
from service.spec import JobSpec, TaskSpec
from service.states import JobState, NodeState

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TIMEOUT = timedelta(seconds=10)
SpecDevice = Literal["auto", "cpu", "cuda"]


def node(id: int, gpus: int = 0, slots: int = 8, state: NodeState = NodeState.ALIVE) -> NodeView:
    return NodeView(id=id, state=state, last_heartbeat_at=T0, slots=slots, gpus=tuple(range(gpus)))


def pending(
    id: int,
    per_node: int = 1,
    nnodes: str = "1",
    device: SpecDevice = "auto",
    message: str = "",
    owner: int | None = None,
) -> JobView:
    spec = JobSpec(
        name="j",
        task=TaskSpec(name="regression"),
        nnodes=nnodes,
        nproc_per_node=per_node,
        device=device,
    )
    return JobView(
        id=id,
        state=JobState.PENDING,
        created_at=T0 + timedelta(seconds=id),
        spec=spec,
        message=message,
        owner=owner,
    )


def running(
    id: int,
    on: dict[int, tuple[int, ...]],
    per_node: int = 1,
    nnodes: str = "1",
    device: Literal["cpu", "cuda"] = "cuda",
    owner: int | None = None,
) -> JobView:
    """A running job whose attempt on ``device`` has a member on each node of ``on``,
    holding those GPUs."""
    return JobView(
        id=id,
        state=JobState.RUNNING,
        created_at=T0 + timedelta(seconds=id),
        spec=pending(id, per_node, nnodes, device).spec,
        attempt_id=100 + id,
        members=tuple(on),
        device=device,
        member_gpus=tuple(on.values()) if device == "cuda" else (),
        owner=owner,
    )


def placements(actions: Sequence[Action]) -> dict[int, tuple[str, dict[int, tuple[int, ...]]]]:
    """By job: the device and, by node, the GPUs of each PlaceJob."""
    return {
        a.job_id: (a.device, dict(zip(a.node_ids, a.gpus or [()] * len(a.node_ids), strict=True)))
        for a in actions
        if isinstance(a, PlaceJob)
    }


def reasons(actions: Sequence[Action]) -> dict[int, str]:
    return {a.job_id: a.reason for a in actions if isinstance(a, ExplainWait)}


def test_jobs_of_one_one_and_four_gpus_fill_nodes_of_two_and_four_on_disjoint_gpus() -> None:
    """Best fit: the small jobs take the small node, which leaves the big one whole for the
    job that needs all of it (first fit by id would have split the big one)."""
    nodes = [node(1, gpus=4), node(2, gpus=2)]
    jobs = [pending(1, per_node=1), pending(2, per_node=1), pending(3, per_node=4)]
    actions = plan(T0, nodes, jobs, TIMEOUT)
    assert placements(actions) == {
        1: ("cuda", {2: (0,)}),
        2: ("cuda", {2: (1,)}),
        3: ("cuda", {1: (0, 1, 2, 3)}),
    }
    assert reasons(actions) == {}


def test_jobs_of_one_two_and_four_gpus_on_nodes_of_four_and_two() -> None:
    """The issue's case: 7 GPUs asked of 6. The first two are placed on disjoint GPUs and
    the third, which no node can hold whole any more, waits and says why."""
    nodes = [node(1, gpus=4), node(2, gpus=2)]
    jobs = [pending(1, per_node=1), pending(2, per_node=2), pending(3, per_node=4)]
    actions = plan(T0, nodes, jobs, TIMEOUT)
    assert placements(actions) == {1: ("cuda", {2: (0,)}), 2: ("cuda", {1: (0, 1)})}
    assert reasons(actions) == {
        3: "waiting for GPUs: needs 1 node with 4 free GPUs; "
        "no node has 4 free GPUs: other jobs hold them"
    }


def test_jobs_of_two_and_four_gpus_take_the_node_each_fits() -> None:
    nodes = [node(1, gpus=4), node(2, gpus=2)]
    actions = plan(T0, nodes, [pending(1, per_node=2), pending(2, per_node=4)], TIMEOUT)
    assert placements(actions) == {1: ("cuda", {2: (0, 1)}), 2: ("cuda", {1: (0, 1, 2, 3)})}


def test_a_job_that_fits_no_node_waits_and_says_for_what() -> None:
    """Jobs of 1, 2 and 1 GPUs already run on nodes of 4 and 2 GPUs: a job of 4 waits."""
    nodes = [node(1, gpus=4), node(2, gpus=2)]
    jobs = [
        running(1, {1: (0,)}),
        running(2, {1: (1, 2)}, per_node=2),
        running(3, {2: (0,)}),
        pending(4, per_node=4),
    ]
    why = (
        "waiting for GPUs: needs 1 node with 4 free GPUs; "
        "no node has 4 free GPUs: other jobs hold them"
    )
    actions = plan(T0, nodes, jobs, TIMEOUT)
    assert actions == [ExplainWait(4, JobState.PENDING, why)]
    told = pending(4, per_node=4, message=why)
    assert plan(T0, nodes, [*jobs[:3], told], TIMEOUT) == []
    # A job of one GPU still fits: the lowest free index of the tightest node.
    assert placements(plan(T0, nodes, [*jobs[:3], pending(5)], TIMEOUT)) == {5: ("cuda", {1: (3,)})}


def test_gpus_taken_earlier_in_the_same_pass_count_as_taken() -> None:
    nodes = [node(1, gpus=2)]
    actions = plan(T0, nodes, [pending(1, per_node=2), pending(2, per_node=1)], TIMEOUT)
    assert placements(actions) == {1: ("cuda", {1: (0, 1)})}
    assert reasons(actions) == {
        2: "waiting for GPUs: needs 1 node with 1 free GPU; "
        "no node has 1 free GPU: other jobs hold them"
    }


def test_a_job_on_several_nodes_takes_its_gpus_on_each() -> None:
    nodes = [node(1, gpus=4), node(2, gpus=2), node(3, gpus=2)]
    actions = plan(T0, nodes, [pending(1, per_node=2, nnodes="2:3")], TIMEOUT)
    assert placements(actions) == {1: ("cuda", {1: (0, 1), 2: (0, 1), 3: (0, 1)})}
    too_few = plan(T0, nodes, [pending(2, per_node=4, nnodes="2", device="cuda")], TIMEOUT)
    assert reasons(too_few) == {
        2: "waiting for GPUs: needs 2 nodes with 4 free GPUs each; too few alive nodes have 4 GPUs"
    }


def test_a_cuda_job_on_a_cluster_without_gpus_waits_for_gpus() -> None:
    nodes = [node(1), node(2)]
    actions = plan(T0, nodes, [pending(1, device="cuda")], TIMEOUT)
    assert actions == [
        ExplainWait(
            1,
            JobState.PENDING,
            "waiting for GPUs: needs 1 node with 1 free GPU; no alive node has GPUs",
        )
    ]


def test_lost_nodes_lend_no_gpus() -> None:
    nodes = [node(1, gpus=4, state=NodeState.LOST), node(2)]
    assert reasons(plan(T0, nodes, [pending(1, device="cuda")], TIMEOUT)) == {
        1: "waiting for GPUs: needs 1 node with 1 free GPU; no alive node has GPUs"
    }


def test_auto_is_cuda_when_an_alive_node_has_gpus_and_cpu_when_none_has() -> None:
    assert placements(plan(T0, [node(1), node(2, gpus=1)], [pending(1)], TIMEOUT)) == {
        1: ("cuda", {2: (0,)})
    }
    assert placements(plan(T0, [node(1), node(2)], [pending(1)], TIMEOUT)) == {1: ("cpu", {1: ()})}
    assert resolve_device("auto", True) == "cuda" and resolve_device("auto", False) == "cpu"
    assert resolve_device("cpu", True) == "cpu" and resolve_device("cuda", False) == "cuda"
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu", True)


def test_an_auto_job_whose_gpus_are_all_taken_waits_for_gpus_not_for_a_cpu_node() -> None:
    nodes = [node(1), node(2, gpus=1)]
    jobs = [running(1, {2: (0,)}), pending(2)]
    assert reasons(plan(T0, nodes, jobs, TIMEOUT)) == {
        2: "waiting for GPUs: needs 1 node with 1 free GPU; "
        "no node has 1 free GPU: other jobs hold them"
    }


def test_a_cpu_job_does_not_land_on_a_node_a_cuda_job_holds() -> None:
    nodes = [node(1, gpus=4)]
    jobs = [running(1, {1: (0,)}), pending(2, device="cpu")]
    assert reasons(plan(T0, nodes, jobs, TIMEOUT)) == {
        2: "waiting for nodes: needs 1, too few are free; other jobs hold the rest"
    }
    # The node is free again once the CUDA job is gone.
    assert placements(plan(T0, nodes, jobs[1:], TIMEOUT)) == {2: ("cpu", {1: ()})}


def test_a_cuda_job_does_not_land_on_a_node_a_cpu_job_holds() -> None:
    nodes = [node(1, gpus=4), node(2, gpus=2)]
    jobs = [running(1, {1: ()}, device="cpu"), pending(2, per_node=3, device="cuda")]
    assert reasons(plan(T0, nodes, jobs, TIMEOUT)) == {
        2: "waiting for GPUs: needs 1 node with 3 free GPUs; "
        "no node has 3 free GPUs: other jobs hold them"
    }
    assert placements(plan(T0, nodes, [jobs[0], pending(3, per_node=2)], TIMEOUT)) == {
        3: ("cuda", {2: (0, 1)})
    }


def test_a_cpu_job_takes_a_node_without_gpus_before_one_with() -> None:
    nodes = [node(1, gpus=2), node(2), node(3, gpus=1)]
    assert placements(plan(T0, nodes, [pending(1, device="cpu")], TIMEOUT)) == {1: ("cpu", {2: ()})}
    both = plan(T0, nodes, [pending(1, device="cpu", nnodes="2")], TIMEOUT)
    assert placements(both) == {1: ("cpu", {1: (), 2: ()})}


def test_a_node_without_gpus_never_gets_a_cuda_job() -> None:
    nodes = [node(1, slots=64), node(2, gpus=1)]
    actions = plan(T0, nodes, [pending(1, device="cuda", nnodes="1:2")], TIMEOUT)
    assert placements(actions) == {1: ("cuda", {2: (0,)})}


def test_scale_up_keeps_the_attempts_device_and_takes_gpus_on_other_nodes() -> None:
    """A CUDA attempt grows onto another node's free GPUs even where auto would now say
    cpu, and never onto a node it is already a member of."""
    nodes = [node(1, gpus=4), node(2, gpus=2), node(3)]
    job = running(1, {1: (0, 1)}, per_node=2, nnodes="1:3")
    assert plan(T0, nodes, [job], TIMEOUT) == [AddMembers(1, 101, (2,), ((0, 1),))]


def test_a_deep_queue_waiting_for_gpus_is_told_why_once() -> None:
    """Jobs asking the same get the same reason; once told, a pass decides nothing."""
    nodes = [node(1, gpus=2)]
    queue = [pending(i, per_node=4, device="cuda") for i in range(1, 30)]
    why = "waiting for GPUs: needs 1 node with 4 free GPUs; no alive node has 4 GPUs"
    assert set(reasons(plan(T0, nodes, queue, TIMEOUT)).values()) == {why}
    told = [pending(i, per_node=4, device="cuda", message=why) for i in range(1, 30)]
    assert plan(T0, nodes, told, TIMEOUT) == []


def test_cuda_jobs_of_different_users_do_not_share_a_node_by_default() -> None:
    """CUDA_VISIBLE_DEVICES is no isolation: another user's job waits for a node of its own,
    and its reason does not count the GPUs it may not have as free."""
    nodes = [node(1, gpus=4)]
    jobs = [running(1, {1: (0,)}, owner=7), pending(2, owner=8), pending(3, owner=7)]
    actions = plan(T0, nodes, jobs, TIMEOUT)
    assert placements(actions) == {3: ("cuda", {1: (1,)})}
    assert reasons(actions) == {
        2: "waiting for GPUs: needs 1 node with 1 free GPU; "
        "no node has 1 free GPU: other jobs hold them"
    }
    shared = plan(T0, nodes, jobs, TIMEOUT, share_gpu_nodes=True)
    assert placements(shared) == {2: ("cuda", {1: (1,)}), 3: ("cuda", {1: (2,)})}


def test_a_node_placed_for_one_user_in_a_pass_is_not_given_to_another() -> None:
    nodes = [node(1, gpus=4), node(2, gpus=2)]
    jobs = [pending(1, owner=7), pending(2, owner=8), pending(3, owner=9)]
    actions = plan(T0, nodes, jobs, TIMEOUT)
    assert placements(actions) == {1: ("cuda", {2: (0,)}), 2: ("cuda", {1: (0,)})}
    assert set(reasons(actions)) == {3}


def test_a_cuda_job_grows_only_onto_nodes_no_other_user_is_on() -> None:
    nodes = [node(1, gpus=2), node(2, gpus=2), node(3, gpus=2)]
    jobs = [running(1, {1: (0,)}, nnodes="1:3", owner=7), running(2, {2: (0,)}, owner=8)]
    assert plan(T0, nodes, jobs, TIMEOUT) == [AddMembers(1, 101, (3,), ((0,),))]


def test_auto_is_cpu_unless_min_nodes_alive_nodes_have_nproc_per_node_gpus() -> None:
    """auto would otherwise be cuda and wait for ever for GPUs no node has."""
    nodes = [node(1, gpus=4), node(2), node(3)]
    assert placements(plan(T0, nodes, [pending(1, per_node=8)], TIMEOUT)) == {1: ("cpu", {2: ()})}
    two = plan(T0, nodes, [pending(2, per_node=2, nnodes="2")], TIMEOUT)
    assert placements(two) == {2: ("cpu", {2: (), 3: ()})}
    assert placements(plan(T0, nodes, [pending(3, per_node=4)], TIMEOUT)) == {
        3: ("cuda", {1: (0, 1, 2, 3)})
    }
    # Enough GPUs in total though not free now: it waits for them on cuda.
    busy = [running(4, {1: (0, 1)}, per_node=2), pending(5, per_node=4)]
    assert set(reasons(plan(T0, nodes, busy, TIMEOUT))) == {5}
    assert resolve_device("auto", gpus_enough=True) == "cuda"
    assert resolve_device("auto", gpus_enough=False) == "cpu"


def test_a_cpu_attempt_grows_only_onto_nodes_without_gpus() -> None:
    """There is no scale-down: a node with GPUs it took would wait for CUDA jobs until it
    ends. Placing it first may still use one."""
    nodes = [node(1, gpus=4), node(2), node(3, gpus=2)]
    cpu_job = running(2, {2: ()}, nnodes="1:3", device="cpu")
    assert plan(T0, nodes, [cpu_job], TIMEOUT) == []
    with_room = [*nodes, node(4)]
    assert plan(T0, with_room, [cpu_job], TIMEOUT) == [AddMembers(2, 102, (4,), ())]
    first = plan(T0, nodes, [pending(3, device="cpu", nnodes="2")], TIMEOUT)
    assert placements(first) == {3: ("cpu", {1: (), 2: ()})}


def test_ended_attempts_members_still_active_hold_their_gpus_and_nodes() -> None:
    """An attempt that SUCCEEDED keeps its members ACTIVE until their launchers report."""
    finishing = Hold(owner=7, device="cuda", gpus=(0, 1))
    nodes = [NodeView(1, NodeState.ALIVE, T0, 8, (0, 1, 2, 3), (finishing,)), node(2)]
    actions = plan(T0, nodes, [pending(1, per_node=4, device="cuda", owner=7)], TIMEOUT)
    assert set(reasons(actions)) == {1}
    same_user = plan(T0, nodes, [pending(2, per_node=2, owner=7)], TIMEOUT)
    assert placements(same_user) == {2: ("cuda", {1: (2, 3)})}
    other_user = plan(T0, nodes, [pending(3, device="cuda", owner=8)], TIMEOUT)
    assert set(reasons(other_user)) == {3}
    whole = Hold(owner=7, device="cpu")
    cpu_held = [NodeView(1, NodeState.ALIVE, T0, 8, (), (whole,))]
    assert reasons(plan(T0, cpu_held, [pending(4, device="cpu")], TIMEOUT)) == {
        4: "waiting for nodes: needs 1, too few are free; other jobs hold the rest"
    }
