"""One restart budget per job, kept by the controller; waiting below MIN with a deadline."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.reconciler import Reconciler
from tests.helpers import FakeClock
from tests.service.helpers import event, job, kinds, register, report, submit


def _events(api: TestClient, job_id: int, kind: str) -> list[dict[str, Any]]:
    items = api.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
    return [e for e in items if e["kind"] == kind]


def _fail_worker(api: TestClient, node: int, attempt_id: int, **data: Any) -> None:
    failure = {"local_rank": 0, "global_rank": 0, "exitcode": 1, "message": "boom", **data}
    r = report(api, node, attempt_id, events=[event("worker_failed", **failure)])
    assert r.status_code == 200, r.text


def _rendezvous_again(api: TestClient, node: int, attempt_id: int) -> None:
    r = report(
        api,
        node,
        attempt_id,
        events=[event("rendezvous", world_size=1, group_rank=0, group_world_size=1)],
    )
    assert r.status_code == 200, r.text


def _placed_alone(api: TestClient, reconciler: Reconciler, **spec: Any) -> tuple[int, int, int]:
    """(node, job, attempt) of a one-node job placed on a new node."""
    node = register(api, "a")
    job_id = submit(api, "1:1", **spec)
    reconciler.run_once()
    return node, job_id, job(api, job_id)["attempts"][0]["id"]


def test_worker_failures_spend_the_jobs_budget_then_fail_it(
    api: TestClient, reconciler: Reconciler
) -> None:
    a, job_id, attempt_id = _placed_alone(api, reconciler, max_restarts=2)
    for expected in (1, 2):
        _fail_worker(api, a, attempt_id)
        # a second report of the same incident (another rank) is not counted again
        _fail_worker(api, a, attempt_id, global_rank=1, message="peer gone")
        d = job(api, job_id)
        assert (d["state"], d["restart_count"]) == ("RESTARTING", expected)
        _rendezvous_again(api, a, attempt_id)
        assert job(api, job_id)["state"] == "RUNNING"
    _fail_worker(api, a, attempt_id)
    d = job(api, job_id)
    assert d["state"] == "FAILED"
    assert d["restart_count"] == 3
    assert "restart budget spent" in d["message"]
    assert d["attempts"][0]["state"] == "FAILED"
    assert heartbeat_is_empty(api, a)
    causes = [e["data"]["cause"] for e in _events(api, job_id, "restarting")]
    assert causes == ["crash", "crash"]


def heartbeat_is_empty(api: TestClient, node: int) -> bool:
    r = api.post(f"/api/v1/nodes/{node}/heartbeat", json={"running": []})
    return r.status_code == 200 and r.json()["assignments"] == []


def test_a_worker_that_lost_its_peer_is_not_counted(
    api: TestClient, reconciler: Reconciler
) -> None:
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api, "1:2", max_restarts=1)
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    _fail_worker(api, b, attempt_id, message="Connection reset by peer", cause="peer_lost")
    assert (job(api, job_id)["state"], job(api, job_id)["restart_count"]) == ("RUNNING", 0)
    _fail_worker(api, a, attempt_id, exitcode=-9, message="killed")  # the root cause
    assert (job(api, job_id)["state"], job(api, job_id)["restart_count"]) == ("RESTARTING", 1)


def test_a_fatal_failure_fails_at_once_without_spending_the_budget(
    api: TestClient, reconciler: Reconciler
) -> None:
    a, job_id, attempt_id = _placed_alone(api, reconciler, max_restarts=5)
    _fail_worker(
        api,
        a,
        attempt_id,
        message="ModuleNotFoundError: No module named 'nope'",
        cause="startup_error",
        fatal=True,
    )
    d = job(api, job_id)
    assert d["state"] == "FAILED"
    assert d["restart_count"] == 0
    assert "startup error" in d["message"] and "nope" in d["message"]


def test_back_off_grows_with_each_restart(api: TestClient, reconciler: Reconciler) -> None:
    a, job_id, attempt_id = _placed_alone(
        api, reconciler, max_restarts=5, restart_backoff_s=2, restart_backoff_max_s=5
    )
    for _ in range(4):
        _fail_worker(api, a, attempt_id)
        _rendezvous_again(api, a, attempt_id)
    delays = [e["data"]["backoff_s"] for e in _events(api, job_id, "restarting")]
    assert delays == [0, 2, 4, 5]


def test_a_failed_launcher_is_relaunched_as_a_new_attempt_after_the_back_off(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    a = register(api, "a")
    job_id = submit(api, "1:1", max_restarts=3, restart_backoff_s=4)
    reconciler.run_once()
    first = job(api, job_id)["attempts"][0]["id"]
    # restart 1 is immediate; make it restart 2, which backs off 4 s
    _fail_worker(api, a, first)
    _rendezvous_again(api, a, first)
    exit = {"outcome": "failed", "exit_code": 1, "message": "RendezvousTimeoutError"}
    assert report(api, a, first, exit=exit).status_code == 200
    d = job(api, job_id)
    assert (d["state"], d["restart_count"]) == ("WAITING", 2)
    assert d["attempts"][0]["state"] == "FAILED"
    reconciler.run_once()
    assert job(api, job_id)["state"] == "WAITING"  # backing off
    clock.advance(4)
    reconciler.run_once()
    d = job(api, job_id)
    assert d["state"] == "RUNNING"
    assert [x["number"] for x in d["attempts"]] == [1, 2]
    assert d["waiting_since"] is None


def test_below_min_the_job_waits_then_fails_at_its_deadline(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    register(api, "a")
    register(api, "b")
    job_id = submit(api, "2:2", wait_for_nodes_s=30)
    reconciler.run_once()
    # node b keeps beating, node a goes silent
    b = register(api, "b")
    for _ in range(3):
        clock.advance(4)
        api.post(f"/api/v1/nodes/{b}/heartbeat", json={"running": []})
    reconciler.run_once()
    reconciler.run_once()
    d = job(api, job_id)
    assert d["state"] == "WAITING", d
    assert d["restart_count"] == 0
    assert d["membership_changes"] >= 1
    assert "waiting_for_nodes" in kinds(api, job_id)
    for _ in range(7):
        clock.advance(4)
        api.post(f"/api/v1/nodes/{b}/heartbeat", json={"running": []})
        reconciler.run_once()
    assert job(api, job_id)["state"] == "WAITING"  # 28 s
    clock.advance(3)
    api.post(f"/api/v1/nodes/{b}/heartbeat", json={"running": []})
    reconciler.run_once()
    d = job(api, job_id)
    assert d["state"] == "FAILED"
    assert "fewer than 2 nodes for 30 s" in d["message"]


def test_a_node_leaving_and_joining_counts_as_membership_changes_not_restarts(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    a = register(api, "a")
    b = register(api, "b")
    job_id = submit(api, "1:2")
    reconciler.run_once()
    for _ in range(3):
        clock.advance(4)
        api.post(f"/api/v1/nodes/{a}/heartbeat", json={"running": []})
    reconciler.run_once()
    d = job(api, job_id)
    assert (d["state"], d["restart_count"], d["membership_changes"]) == ("RUNNING", 0, 1)
    attempt_id = d["attempts"][0]["id"]
    rendezvous = event("rendezvous", world_size=1, group_rank=0, group_world_size=1)
    assert report(api, a, attempt_id, events=[rendezvous]).status_code == 200
    assert register(api, "b") == b  # b comes back and joins the attempt again in place
    reconciler.run_once()
    d = job(api, job_id)
    assert (d["state"], d["restart_count"], d["membership_changes"]) == ("RUNNING", 0, 2)
    left, joined = _events(api, job_id, "node_left"), _events(api, job_id, "node_joined")
    assert [e["data"]["cause"] for e in left + joined] == ["node_left", "node_joined"]


def test_worker_and_launcher_failures_spend_one_budget_and_fail_the_job_alike(
    api: TestClient, reconciler: Reconciler
) -> None:
    a, job_id, attempt_id = _placed_alone(api, reconciler, max_restarts=1)
    _fail_worker(api, a, attempt_id)
    _rendezvous_again(api, a, attempt_id)
    assert (job(api, job_id)["state"], job(api, job_id)["restart_count"]) == ("RUNNING", 1)
    exit = {"outcome": "failed", "exit_code": 1, "message": "RendezvousTimeoutError"}
    assert report(api, a, attempt_id, exit=exit).status_code == 200
    d = job(api, job_id)
    assert d["state"] == "FAILED"
    assert d["restart_count"] == 2  # the failure that spent the budget counts, as a worker's
    assert d["message"] == "RendezvousTimeoutError"
    assert d["attempts"][0]["state"] == "FAILED"
    causes = [e["data"]["cause"] for e in _events(api, job_id, "restarting")]
    assert causes == ["crash"]


def _round(group_rank: int, nodes: int) -> Any:
    return event("rendezvous", world_size=nodes, group_rank=group_rank, group_world_size=nodes)


def _hung(global_rank: int, local_rank: int = 0) -> Any:
    return event(
        "worker_failed",
        local_rank=local_rank,
        global_rank=global_rank,
        exitcode=-9,
        message="killed",
        cause="hang",
    )


def _sent(api: TestClient, node: int, attempt_id: int, *events: Any) -> None:
    assert report(api, node, attempt_id, events=list(events)).status_code == 200


def _counted(api: TestClient, job_id: int) -> tuple[str, int]:
    d = job(api, job_id)
    return d["state"], d["restart_count"]


@pytest.mark.parametrize("late_rank", [1, 0], ids=["late-node-rank-1", "late-node-rank-0"])
def test_the_late_reports_of_a_round_a_restart_already_ended_are_not_counted_again(
    api: TestClient, reconciler: Reconciler, late_rank: int
) -> None:
    """A frozen rank and its peers waiting for it are found hung on every node at once; the
    late nodes' reports (two local ranks each) come after the first node's restart has
    formed a new round and the job runs again. One incident, one restart, whichever node
    is group rank 0 (seen in CI: restart_count 2 for one freeze)."""
    a, b, c = register(api, "a", slots=2), register(api, "b", slots=2), register(api, "c", 2)
    job_id = submit(api, "3:3", max_restarts=5, nproc_per_node=2)
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    ranks = {a: 1 - late_rank, b: late_rank, c: 2}
    for node in (a, b, c):
        _sent(api, node, attempt_id, _round(ranks[node], 3))
    _sent(api, a, attempt_id, _hung(0))
    assert _counted(api, job_id) == ("RESTARTING", 1)
    _sent(api, a, attempt_id, _round(ranks[a], 3))  # the new round
    assert _counted(api, job_id) == ("RUNNING", 1)
    for node in (b, c):  # each: its two hung ranks, then its own new round
        first = 2 * ranks[node]
        _sent(api, node, attempt_id, _hung(first, 0), _hung(first + 1, 1))
        _sent(api, node, attempt_id, _round(ranks[node], 3))
    assert _counted(api, job_id) == ("RUNNING", 1)
    assert len(_events(api, job_id, "worker_failed")) == 5  # all on the timeline
    _sent(api, b, attempt_id, _hung(2))  # of the new round: a new incident
    assert _counted(api, job_id) == ("RESTARTING", 2)


def test_a_crash_of_a_round_formed_after_the_restart_is_counted_whenever_it_arrives(
    api: TestClient, reconciler: Reconciler
) -> None:
    """b crashed in the round formed after restart 1, and a's report of the round that
    crash caused arrived first: b had reported a round since the restart, so its crash is
    a new incident."""
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api, "2:2", max_restarts=5)
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    for node, rank in ((a, 0), (b, 1)):
        _sent(api, node, attempt_id, _round(rank, 2))
    _fail_worker(api, a, attempt_id)  # restart 1
    for node, rank in ((a, 0), (b, 1)):  # the round after it
        _sent(api, node, attempt_id, _round(rank, 2))
    assert _counted(api, job_id) == ("RUNNING", 1)
    _sent(api, a, attempt_id, _round(0, 2))  # the round b's crash caused
    _fail_worker(api, b, attempt_id, global_rank=1)  # b's crash, reported late
    assert _counted(api, job_id) == ("RESTARTING", 2)
