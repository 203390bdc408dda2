from contract.protocol import Assignment, Entrypoint, RendezvousConfig
from worker.agent import plan_reconcile, start_blocker


def _assignment(attempt_id: int) -> Assignment:
    return Assignment(
        attempt_id=attempt_id,
        job_id=1,
        min_nodes=1,
        max_nodes=2,
        nproc_per_node=1,
        max_restarts=0,
        rendezvous=RendezvousConfig(rdzv_id=f"r{attempt_id}"),
        entrypoint=Entrypoint(module="train"),
        snapshot_dir="/tmp/s",
    )


def test_starts_what_is_assigned_and_not_held() -> None:
    plan = plan_reconcile([_assignment(1), _assignment(2)], held={2}, finished=set())
    assert [a.attempt_id for a in plan.start] == [1]
    assert plan.stop == ()


def test_stops_what_is_held_and_no_longer_assigned() -> None:
    plan = plan_reconcile([_assignment(2)], held={1, 2, 3}, finished=set())
    assert plan.start == ()
    assert plan.stop == (1, 3)


def test_empty_reply_stops_everything() -> None:
    plan = plan_reconcile([], held={5, 4}, finished={(1, None)})
    assert plan.start == ()
    assert plan.stop == (4, 5)


def test_finished_attempts_are_never_started_again() -> None:
    plan = plan_reconcile([_assignment(1), _assignment(2)], held=set(), finished={(1, None)})
    assert [a.attempt_id for a in plan.start] == [2]


def test_duplicate_assignments_start_once() -> None:
    plan = plan_reconcile((a for a in [_assignment(7), _assignment(7)]), held=set(), finished=set())
    assert [a.attempt_id for a in plan.start] == [7]
    assert plan.stop == ()


def test_nothing_to_do_when_in_sync() -> None:
    plan = plan_reconcile([_assignment(1)], held={1}, finished=set())
    assert plan.start == () and plan.stop == ()


def _membership(attempt_id: int, member_id: int) -> Assignment:
    return _assignment(attempt_id).model_copy(update={"member_id": member_id})


def test_a_node_back_in_an_attempt_it_left_runs_it_again_with_its_new_membership() -> None:
    finished = {(1, 10)}  # its first run of attempt 1 (membership 10) ended
    plan = plan_reconcile([_membership(1, 11)], held=set(), finished=finished)
    assert [(a.attempt_id, a.member_id) for a in plan.start] == [(1, 11)]
    assert plan_reconcile([_membership(1, 10)], held=set(), finished=finished).start == ()


def test_an_old_run_still_held_is_stopped_before_the_new_membership_starts() -> None:
    """A node that thawed still runs its old part: that one goes first."""
    plan = plan_reconcile([_membership(1, 11)], held={1}, finished=set(), held_members={1: 10})
    assert (plan.start, plan.stop) == ((), (1,))
    plan = plan_reconcile([_membership(1, 11)], held={1}, finished=set(), held_members={1: 11})
    assert (plan.start, plan.stop) == ((), ())


def _on(attempt_id: int, device: str, gpus: list[int]) -> Assignment:
    return _assignment(attempt_id).model_copy(update={"device": device, "gpus": gpus})


def test_a_cuda_attempt_waits_for_a_busy_one_on_any_of_its_gpus() -> None:
    old = _on(1, "cuda", [0, 1])
    assert start_blocker(_on(2, "cuda", [1, 2]), [old], node_has_gpus=True) == old
    assert start_blocker(_on(2, "cuda", [2, 3]), [old], node_has_gpus=True) is None


def test_on_a_gpu_node_a_cpu_attempt_takes_the_node_whole() -> None:
    cuda, cpu = _on(1, "cuda", [0]), _on(2, "cpu", [])
    assert start_blocker(_on(3, "cpu", []), [cuda], node_has_gpus=True) == cuda
    assert start_blocker(_on(3, "cuda", [3]), [cpu], node_has_gpus=True) == cpu
    assert start_blocker(_on(3, "cpu", []), [], node_has_gpus=True) is None


def test_on_a_node_without_gpus_nothing_waits() -> None:
    assert start_blocker(_on(3, "cpu", []), [_on(1, "cpu", [])], node_has_gpus=False) is None
