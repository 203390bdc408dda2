"""How a member and a node end, and the order the timeline tells it in, through the node
protocol with a movable clock."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from fastapi.testclient import TestClient

from service.reconciler import Reconciler
from tests.helpers import FakeClock
from tests.service.helpers import heartbeat, job, kinds, register, report, submit


def _members(api: TestClient, job_id: int) -> dict[str, str]:
    return {m["node_name"]: m["state"] for m in job(api, job_id)["attempts"][0]["members"]}


def _nodes(api: TestClient) -> dict[str, str]:
    return {n["name"]: n["state"] for n in api.get("/api/v1/nodes").json()["items"]}


def _events(api: TestClient, job_id: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = api.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
    return items


def _succeeded(api: TestClient, node_id: int, attempt_id: int) -> None:
    r = report(api, node_id, attempt_id, exit={"outcome": "succeeded", "exit_code": 0})
    assert r.status_code == 200, r.text


def test_every_node_whose_launcher_succeeded_is_finished(
    api: TestClient, reconciler: Reconciler
) -> None:
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api, "2:2")
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    _succeeded(api, a, attempt_id)
    assert job(api, job_id)["state"] == "SUCCEEDED"
    # b's launcher is finishing too: it has not left anything
    assert _members(api, job_id) == {"a": "FINISHED", "b": "ACTIVE"}
    assert heartbeat(api, b) == []  # nothing more to run
    _succeeded(api, b, attempt_id)  # its success arrives after the attempt ended
    assert _members(api, job_id) == {"a": "FINISHED", "b": "FINISHED"}
    messages = [e["message"] for e in _events(api, job_id) if e["node_id"] == b]
    assert messages == ["node b finished"]
    assert not any("released" in e["message"] for e in _events(api, job_id))
    assert kinds(api, job_id)[-1] == "node_finished"


def test_a_finishing_member_whose_node_goes_silent_left(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    a, _ = register(api, "a"), register(api, "b")
    job_id = submit(api, "2:2")
    reconciler.run_once()
    _succeeded(api, a, job(api, job_id)["attempts"][0]["id"])
    clock.advance(8)
    heartbeat(api, a)
    clock.advance(5)  # b silent for 13 s: it will never report its exit
    reconciler.run_once()
    assert _nodes(api) == {"a": "ALIVE", "b": "LOST"}
    assert _members(api, job_id) == {"a": "FINISHED", "b": "LEFT"}
    assert job(api, job_id)["state"] == "SUCCEEDED"


def test_a_member_whose_launcher_failed_exited(api: TestClient, reconciler: Reconciler) -> None:
    a, _ = register(api, "a"), register(api, "b")
    job_id = submit(api, "2:2", max_restarts=0)
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    r = report(api, a, attempt_id, exit={"outcome": "failed", "exit_code": 1, "fatal": True})
    assert r.status_code == 200, r.text
    assert job(api, job_id)["state"] == "FAILED"
    assert _members(api, job_id) == {"a": "EXITED", "b": "LEFT"}


def test_a_node_that_leaves_is_left_not_lost_and_is_placed_again_once_it_registers(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    a = register(api, "a")
    reply = api.post(f"/api/v1/nodes/{a}/leave", json={"reason": "SIGTERM"})
    assert reply.json() == {"left": True}
    assert _nodes(api) == {"a": "LEFT"}
    clock.advance(60)  # silence after saying goodbye does not make it lost
    job_id = submit(api, "1")
    reconciler.run_once()
    assert _nodes(api) == {"a": "LEFT"}
    assert job(api, job_id)["state"] == "PENDING"  # a node that left is not placed on
    assert register(api, "a") == a
    assert _nodes(api) == {"a": "ALIVE"}
    reconciler.run_once()
    assert job(api, job_id)["state"] == "RUNNING"


def test_a_rendezvous_the_controller_learns_after_a_node_left_comes_after_it(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    """The launcher's clock saw the re-formed rendezvous 2 s before the controller
    declared the silent node lost: the timeline still reads cause, then effect."""
    a, _ = register(api, "a"), register(api, "b")
    job_id = submit(api, "1:2")
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    clock.advance(8)
    heartbeat(api, a)
    clock.advance(5)  # b silent for 13 s > 10 s timeout: lost now
    reconciler.run_once()
    lost_at: datetime = clock()
    seen = (lost_at - timedelta(seconds=2)).isoformat()
    rendezvous = {"world_size": 1, "group_rank": 0, "group_world_size": 1}
    started = {"world_size": 1, "restart_count": 1, "resumed_from_step": 5, "total_steps": 40}
    r = report(
        api,
        a,
        attempt_id,
        events=[
            {"time": seen, "kind": "rendezvous", "data": rendezvous},
            {"time": seen, "kind": "started", "data": started},
        ],
    )
    assert r.status_code == 200, r.text
    timeline = [(e["kind"], datetime.fromisoformat(e["time"])) for e in _events(api, job_id)]
    order = [kind for kind, _ in timeline]
    assert order.index("node_left") < order.index("rendezvous") < order.index("resumed")
    times = [time for _, time in timeline]
    assert times == sorted(times)
    assert dict(timeline)["rendezvous"] == lost_at


def test_events_before_any_membership_change_keep_the_nodes_time(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    a, _ = register(api, "a"), register(api, "b")
    job_id = submit(api, "2:2")
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    seen = clock() - timedelta(seconds=2)
    rendezvous = {"world_size": 2, "group_rank": 0, "group_world_size": 2}
    r = report(
        api,
        a,
        attempt_id,
        events=[{"time": seen.isoformat(), "kind": "rendezvous", "data": rendezvous}],
    )
    assert r.status_code == 200, r.text
    [event] = [e for e in _events(api, job_id) if e["kind"] == "rendezvous"]
    assert datetime.fromisoformat(event["time"]) == seen


def test_a_rendezvous_that_shrank_before_the_controller_noticed_says_why_first(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    """The survivors re-form (keep-alive expiry) before the silent node's heartbeat
    times out: the timeline says a node is missing before the smaller rendezvous."""
    a, _ = register(api, "a"), register(api, "b")
    job_id = submit(api, "1:2")
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    full = {"world_size": 2, "group_rank": 0, "group_world_size": 2}
    shrunk = {"world_size": 1, "group_rank": 0, "group_world_size": 1}
    for data in (full, shrunk):
        clock.advance(3)
        event = {"time": clock().isoformat(), "kind": "rendezvous", "data": data}
        assert report(api, a, attempt_id, events=[event]).status_code == 200
    order = [e["kind"] for e in _events(api, job_id)]
    assert order.count("node_missing") == 1  # the first, full round is not a shrink
    assert order.index("node_missing") == len(order) - 2 and order[-1] == "rendezvous"
    assert _members(api, job_id) == {"a": "ACTIVE", "b": "ACTIVE"}  # the heartbeat decides
