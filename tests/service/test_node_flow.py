"""Nodes, placement and reports, end to end through the API with a movable clock."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.heartbeats import FINISHING_GRACE_S
from service.reconciler import Reconciler
from service.settings import ControllerSettings
from tests.helpers import FakeClock
from tests.service.helpers import Cluster, event, heartbeat, job, kinds, register, report, submit


def test_job_waits_for_min_nodes_then_runs_on_them(api: TestClient, reconciler: Reconciler) -> None:
    a = register(api, "a")
    job_id = submit(api, "2:2")
    reconciler.run_once()
    assert job(api, job_id)["state"] == "PENDING"
    b = register(api, "b")
    reconciler.run_once()
    detail = job(api, job_id)
    assert detail["state"] == "RUNNING"
    [attempt] = detail["attempts"]
    assert {m["node_name"] for m in attempt["members"]} == {"a", "b"}
    for node_id in (a, b):
        [assignment] = heartbeat(api, node_id)
        assert assignment["attempt_id"] == attempt["id"]
        assert assignment["attempt_number"] == attempt["number"] == 1
        assert assignment["rendezvous"]["rdzv_id"] == attempt["rdzv_id"]
        assert "endpoint" not in assignment["rendezvous"]  # the node's controller serves it
        assert assignment["worker_token"].startswith("rlw_")  # the node does not run it yet
        assert assignment["entrypoint"]["module"] == "worker.tasks.regression"
        assert "--epochs" in assignment["entrypoint"]["args"]
        assert assignment["snapshot_dir"].endswith(f"job-{job_id}")
        assert assignment["snapshot_every_steps"] == 5
        assert assignment["working_dir"] is None  # the node picks the default


def test_the_assignment_carries_the_jobs_working_dir(
    api: TestClient, reconciler: Reconciler
) -> None:
    a = register(api, "a")
    submit(api, "1", working_dir="/data/runs/exp1")
    reconciler.run_once()
    [assignment] = heartbeat(api, a)
    assert assignment["working_dir"] == "/data/runs/exp1"


@pytest.mark.parametrize(
    ("spec", "sent"),
    [
        ({}, (600.0, True, 300.0)),  # the defaults: an adaptive hang timeout up to 600 s
        ({"hang_timeout_s": 45, "collective_timeout_s": 60}, (45.0, False, 60.0)),
        ({"hang_timeout_s": None}, (None, False, 300.0)),
    ],
    ids=["defaults", "explicit", "no-hang-detection"],
)
def test_the_assignment_carries_the_hang_rule_and_the_collective_timeout(
    api: TestClient, reconciler: Reconciler, spec: dict[str, Any], sent: tuple[Any, ...]
) -> None:
    a = register(api, "a")
    job_id = submit(api, "1", **spec)
    reconciler.run_once()
    [assignment] = heartbeat(api, a)
    keys = ("hang_timeout_s", "hang_timeout_adaptive", "collective_timeout_s")
    assert tuple(assignment[k] for k in keys) == sent
    shown = job(api, job_id)["spec"]
    assert shown["hang_timeout_s"] == spec.get("hang_timeout_s", "auto")
    assert shown["collective_timeout_s"] == spec.get("collective_timeout_s", 300)


def test_a_job_that_cannot_be_placed_says_why_once_until_it_is_placed(
    api: TestClient, reconciler: Reconciler
) -> None:
    register(api, "a")
    register(api, "b")
    job_id = submit(api, "3")
    for _ in range(3):
        reconciler.run_once()
    detail = job(api, job_id)
    assert detail["state"] == "PENDING"
    assert detail["message"] == "waiting for nodes: needs 3, too few nodes are alive"
    assert detail["nodes_now"] == {"alive": 2, "idle": 2}  # counted as it is read
    events = api.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
    assert [(e["kind"], e["message"]) for e in events][1:] == [
        ("waiting", "waiting for nodes: needs 3, too few nodes are alive")
    ]
    c = register(api, "c")
    reconciler.run_once()
    detail = job(api, job_id)
    assert (detail["state"], detail["message"], detail["nodes_now"]) == ("RUNNING", "", None)
    assert kinds(api, job_id) == ["submitted", "waiting", "placed"]
    [assignment] = heartbeat(api, c)
    assert assignment["job_id"] == job_id


def test_a_waiting_jobs_node_counts_are_read_as_they_are_now_not_kept(
    api: TestClient, reconciler: Reconciler
) -> None:
    register(api, "a")
    job_id = submit(api, "3")
    reconciler.run_once()
    first = api.get(f"/api/v1/jobs/{job_id}")
    assert first.json()["nodes_now"] == {"alive": 1, "idle": 1}
    register(api, "b")  # nothing of the job changed, but what its detail shows did
    again = api.get(f"/api/v1/jobs/{job_id}", headers={"if-none-match": first.headers["etag"]})
    assert again.status_code == 200
    assert again.json()["nodes_now"] == {"alive": 2, "idle": 2}


def test_a_waiting_job_says_what_it_still_lacks(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    a, _ = register(api, "a"), register(api, "b")
    job_id = submit(api, "2:2")
    reconciler.run_once()
    clock.advance(8)
    heartbeat(api, a)
    clock.advance(5)  # b silent for 13 s: lost, and the job is below MIN
    for _ in range(3):
        reconciler.run_once()
    detail = job(api, job_id)
    assert detail["state"] == "WAITING"
    assert detail["message"] == "waiting for nodes: needs 2, too few nodes are alive"
    assert detail["nodes_now"] == {"alive": 1, "idle": 1}
    assert kinds(api, job_id)[-2:] == ["waiting_for_nodes", "waiting"]


def test_reports_drive_the_job_to_success_through_a_restart(
    api: TestClient, reconciler: Reconciler
) -> None:
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api)
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    r = report(
        api,
        a,
        attempt_id,
        logs=[
            {
                "time": datetime.now(UTC).isoformat(),
                "local_rank": 0,
                "global_rank": 1,
                "line": "hello",
            }
        ],
        events=[
            event("rendezvous", world_size=2, group_rank=0, group_world_size=2),
            event("started", world_size=2, restart_count=0, resumed_from_step=None, total_steps=40),
            event("progress", step=10, epoch=0, loss=0.5, samples_per_s=100.0, world_size=2),
            event("snapshot", step=10, epoch=0, path="/s/snapshot-10.pt", bytes=123),
        ],
    )
    assert r.status_code == 200, r.text
    d = job(api, job_id)
    assert (d["state"], d["world_size"], d["last_step"], d["total_steps"]) == ("RUNNING", 2, 10, 40)
    assert (
        report(
            api,
            b,
            attempt_id,
            events=[
                event("worker_failed", local_rank=0, global_rank=1, exitcode=-9, message="killed"),
            ],
        ).status_code
        == 200
    )
    assert job(api, job_id)["state"] == "RESTARTING"
    assert (
        report(
            api,
            a,
            attempt_id,
            events=[
                event(
                    "worker_failed", local_rank=0, global_rank=0, exitcode=1, message="peer gone"
                ),
                event(
                    "started", world_size=2, restart_count=1, resumed_from_step=10, total_steps=40
                ),
            ],
        ).status_code
        == 200
    )
    d = job(api, job_id)
    assert (d["state"], d["restart_count"]) == ("RUNNING", 1)  # one incident, one restart
    assert (
        report(
            api,
            a,
            attempt_id,
            events=[event("finished", step=40, loss=0.1)],
            exit={"outcome": "succeeded", "exit_code": 0},
        ).status_code
        == 200
    )
    d = job(api, job_id)
    assert d["state"] == "SUCCEEDED"
    assert d["attempts"][0]["state"] == "SUCCEEDED"
    # b still waits in torch's exit barrier; it is released, and says so when it has stopped
    assert heartbeat(api, b) == []
    r = report(api, b, attempt_id, exit={"outcome": "stopped", "clean": True})
    assert r.status_code == 200
    stopped = api.get(f"/api/v1/jobs/{job_id}/events").json()["items"][-1]
    assert "released after the job succeeded" in stopped["message"]
    timeline = kinds(api, job_id)
    for expected in (
        "placed",
        "rendezvous",
        "training_started",
        "snapshot_saved",
        "worker_failed",
        "restarting",
        "resumed",
        "training_finished",
        "succeeded",
    ):
        assert expected in timeline
    assert [m["step"] for m in api.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"]] == [10]
    assert api.get(f"/api/v1/jobs/{job_id}/snapshots").json()["items"][0]["step"] == 10
    [line] = api.get(f"/api/v1/jobs/{job_id}/logs").json()["items"]
    assert (line["line"], line["local_rank"], line["node_id"]) == ("hello", 0, a)
    # Labelled as users see them elsewhere: node name, the job's attempt number, global rank.
    assert (line["node_name"], line["attempt_number"], line["global_rank"]) == ("a", 1, 1)
    logs = f"/api/v1/jobs/{job_id}/logs"
    assert len(api.get(logs, params={"node_id": a, "local_rank": 0}).json()["items"]) == 1
    assert api.get(logs, params={"local_rank": 1}).json()["items"] == []
    assert api.get(logs, params={"node_id": b}).json()["items"] == []
    assert api.get(logs, params={"after_id": line["id"]}).json()["items"] == []


def running_heartbeat(api: TestClient, node_id: int, *attempt_ids: int) -> list[dict[str, Any]]:
    """The assignments a node that runs ``attempt_ids`` is told."""
    body = {"running": [{"attempt_id": aid} for aid in attempt_ids]}
    r = api.post(f"/api/v1/nodes/{node_id}/heartbeat", json=body)
    assert r.status_code == 200, r.text
    assignments: list[dict[str, Any]] = r.json()["assignments"]
    return assignments


@pytest.mark.parametrize("late_s", [1.0, FINISHING_GRACE_S + 1])
def test_a_node_still_ending_after_the_job_succeeded_is_left_to_finish_for_a_while(
    api: TestClient, reconciler: Reconciler, clock: FakeClock, late_s: float
) -> None:
    """The job succeeds with a's success while b's launcher is still on its way out (past
    torch's exit barrier, in its teardown). b keeps its assignment while it runs it, for
    ``FINISHING_GRACE_S``, so that its agent does not stop it and its own success reads
    FINISHED; later it is told to stop. A node that does not run it is never told to
    start it again."""
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api)
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    assert [x["attempt_id"] for x in running_heartbeat(api, b, attempt_id)] == [attempt_id]
    assert report(api, a, attempt_id, exit={"outcome": "succeeded", "exit_code": 0}).is_success
    assert job(api, job_id)["state"] == "SUCCEEDED"
    clock.advance(late_s)
    told = running_heartbeat(api, b, attempt_id)
    assert heartbeat(api, b) == []  # not running it: not to be started again
    if late_s > FINISHING_GRACE_S:
        assert told == []  # its agent stops it
        return
    [kept] = told
    assert (kept["attempt_id"], kept["worker_token"]) == (attempt_id, None)
    assert report(api, b, attempt_id, exit={"outcome": "succeeded", "exit_code": 0}).is_success
    [attempt] = job(api, job_id)["attempts"]
    assert [(m["state"], m["exit_code"]) for m in attempt["members"]] == [("FINISHED", 0)] * 2
    assert running_heartbeat(api, b, attempt_id) == []


def test_a_member_leaving_an_attempt_that_succeeded_re_forms_nothing(
    api: TestClient, reconciler: Reconciler
) -> None:
    """Three nodes; a's success ends the attempt, c is stopped (LEFT) while b is still in
    its teardown: b's kept assignment must not read a member change, or its agent would
    end b's remaining processes to re-form a world that has finished."""
    a, b, c = register(api, "a"), register(api, "b"), register(api, "c")
    job_id = submit(api, "3:3")
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    [before] = running_heartbeat(api, b, attempt_id)
    assert report(api, a, attempt_id, exit={"outcome": "succeeded", "exit_code": 0}).is_success
    assert report(api, c, attempt_id, exit={"outcome": "stopped", "clean": True}).is_success
    members = {m["node_name"]: m["state"] for m in job(api, job_id)["attempts"][0]["members"]}
    assert members == {"a": "FINISHED", "b": "ACTIVE", "c": "LEFT"}
    [kept] = running_heartbeat(api, b, attempt_id)
    assert kept["attempt_id"] == attempt_id
    assert kept["membership_generation"] <= before["membership_generation"]


def test_a_fatal_launcher_exit_fails_the_job(api: TestClient, reconciler: Reconciler) -> None:
    a, _ = register(api, "a"), register(api, "b")
    job_id = submit(api)
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    report(
        api,
        a,
        attempt_id,
        exit={"outcome": "failed", "exit_code": 1, "message": "fatal: startup", "fatal": True},
    )
    d = job(api, job_id)
    assert d["state"] == "FAILED"
    assert "fatal: startup" in d["message"]
    assert d["restart_count"] == 0


def test_reports_from_non_members_and_ended_attempts_are_fenced(
    api: TestClient, reconciler: Reconciler
) -> None:
    a, b, c = register(api, "a"), register(api, "b"), register(api, "c")
    job_id = submit(api, "2:2")
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    assert report(api, c, attempt_id, events=[]).status_code == 409
    assert report(api, a, 999_999).status_code == 409
    api.post(f"/api/v1/jobs/{job_id}/cancel")
    assert heartbeat(api, a) == []  # level-triggered: the node must stop it
    stale = report(
        api,
        a,
        attempt_id,
        events=[event("progress", step=99, epoch=0, loss=1.0, samples_per_s=1.0, world_size=2)],
    )
    assert stale.status_code == 409
    assert job(api, job_id)["last_step"] is None
    done = report(api, b, attempt_id, exit={"outcome": "stopped", "clean": True})
    assert done.status_code == 200
    assert "node_stopped" in kinds(api, job_id)


def test_a_node_that_stops_its_part_of_a_live_attempt_is_a_membership_change(
    api: TestClient, reconciler: Reconciler
) -> None:
    """An agent that shuts down stops its part first: that is the node leaving."""
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api, "1:2")
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    r = report(api, a, attempt_id, exit={"outcome": "stopped", "clean": True, "exit_code": -15})
    assert r.status_code == 200
    detail = job(api, job_id)
    assert (detail["state"], detail["membership_changes"], detail["restart_count"]) == (
        "RUNNING",
        1,
        0,
    )
    members = {m["node_id"]: m for m in detail["attempts"][0]["members"]}
    assert (members[a]["state"], members[a]["exit_code"]) == ("LEFT", -15)
    assert members[b]["state"] == "ACTIVE"
    assert kinds(api, job_id)[-2:] == ["node_left", "node_stopped"]


def test_a_silent_node_is_lost_and_the_job_goes_on_without_it(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api, "1:2")
    reconciler.run_once()
    [first] = heartbeat(api, b)
    clock.advance(8)
    heartbeat(api, a)
    clock.advance(5)  # b silent for 13 s > 10 s timeout
    reconciler.run_once()
    nodes = {n["name"]: n for n in api.get("/api/v1/nodes").json()["items"]}
    assert nodes["b"]["state"] == "LOST"
    assert nodes["a"]["job_id"] == job_id
    d = job(api, job_id)
    assert d["state"] == "RUNNING"
    members = {m["node_name"]: m["state"] for m in d["attempts"][0]["members"]}
    assert members == {"a": "ACTIVE", "b": "LEFT"}
    assert "node_left" in kinds(api, job_id)
    # b comes back: its old membership is over; the job is below MAX, so b joins the
    # running attempt again in place, with a new membership its agent runs afresh
    assert heartbeat(api, b) == []
    reconciler.run_once()
    [again] = heartbeat(api, b)
    assert again["attempt_id"] == d["attempts"][0]["id"]
    assert again["member_id"] != first["member_id"]
    assert again["membership_generation"] == 1
    assert "node_joined" in kinds(api, job_id)
    nodes = {n["name"]: n for n in api.get("/api/v1/nodes").json()["items"]}
    assert (nodes["b"]["state"], nodes["b"]["job_id"]) == ("ALIVE", job_id)


def test_losing_every_node_makes_the_job_wait_and_a_new_attempt_follows(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    register(api, "a")
    job_id = submit(api, "1:1")
    reconciler.run_once()
    clock.advance(11)
    reconciler.run_once()
    reconciler.run_once()
    d = job(api, job_id)
    assert d["state"] == "WAITING"
    assert d["waiting_since"] is not None
    assert d["attempts"][0]["state"] == "STOPPED"
    assert (d["restart_count"], d["membership_changes"]) == (0, 1)
    register(api, "z")
    reconciler.run_once()
    d = job(api, job_id)
    assert d["state"] == "RUNNING"
    assert [a["number"] for a in d["attempts"]] == [1, 2]
    assert d["attempts"][1]["rdzv_id"] != d["attempts"][0]["rdzv_id"]


def test_a_node_registering_while_a_job_runs_below_max_joins_it(
    api: TestClient, reconciler: Reconciler
) -> None:
    register(api, "a")
    job_id = submit(api, "1:2")
    reconciler.run_once()
    b = register(api, "b")
    reconciler.run_once()
    [assignment] = heartbeat(api, b)
    assert assignment["job_id"] == job_id
    assert len(job(api, job_id)["attempts"]) == 1


def test_an_agent_that_restarts_gives_up_its_old_memberships(
    api: TestClient, reconciler: Reconciler
) -> None:
    a = register(api, "a")
    job_id = submit(api, "1:1")
    reconciler.run_once()
    assert register(api, "a") == a
    d = job(api, job_id)
    assert d["attempts"][0]["members"][0]["state"] == "LEFT"
    reconciler.run_once()
    reconciler.run_once()
    d = job(api, job_id)
    assert d["state"] == "RUNNING"
    assert len(d["attempts"]) == 2


def test_a_heartbeat_without_a_known_node_token_is_a_401(api: TestClient) -> None:
    # An agent reads 401 to its node token as "the controller forgot me": it registers again.
    r = api.post("/api/v1/nodes/77/heartbeat", json={"running": []})
    assert r.status_code == 401


def test_bad_node_registration_is_a_422(api: TestClient) -> None:
    r = api.post(
        "/api/v1/nodes/register", json={"name": "bad name!", "address": "x", "slots": 0, "pid": 1}
    )
    assert r.status_code == 422


def test_a_restarted_controller_sees_the_same_world(
    api: Cluster, reconciler: Reconciler, settings: Any, clock: FakeClock
) -> None:
    from service.api.app import create_app

    register(api, "a")
    job_id = submit(api, "1:1")
    reconciler.run_once()
    app = create_app(settings, clock=clock, run_background=False)
    with TestClient(app, headers={"authorization": f"Bearer {api.user_token}"}) as again:
        assert job(again, job_id)["state"] == "RUNNING"
        assert again.get("/api/v1/nodes").json()["items"][0]["job_id"] == job_id


def test_a_restarted_controller_counts_node_silence_from_its_own_start(
    api: TestClient, reconciler: Reconciler, clock: FakeClock, settings: ControllerSettings
) -> None:
    """Heartbeats sent while no controller was up never arrived: that is no node's fault.

    The restarted controller is a new process with a new id: it takes the lease
    over once the dead one's has expired, and counts silence from then.
    """
    a, _ = register(api, "a"), register(api, "b")
    job_id = submit(api, "2:2")
    reconciler.run_once()
    clock.advance(60)  # the controller was down for a minute
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    restarted = Reconciler(factory, settings.model_copy(update={"controller_id": "new"}), clock)
    clock.advance(5)
    restarted.run_once()
    assert restarted.is_leader
    assert {n["state"] for n in api.get("/api/v1/nodes").json()["items"]} == {"ALIVE"}
    assert job(api, job_id)["state"] == "RUNNING"
    heartbeat(api, a)
    clock.advance(6)
    restarted.run_once()
    assert {n["state"] for n in api.get("/api/v1/nodes").json()["items"]} == {"ALIVE"}
    heartbeat(api, a)
    clock.advance(5)  # b silent for 11 s since the takeover > 10 s timeout
    restarted.run_once()
    nodes = {n["name"]: n["state"] for n in api.get("/api/v1/nodes").json()["items"]}
    assert nodes == {"a": "ALIVE", "b": "LOST"}


def test_snapshot_checksums_failures_and_skips_are_recorded(
    api: TestClient, reconciler: Reconciler
) -> None:
    a, _ = register(api, "a"), register(api, "b")
    job_id = submit(api, snapshot={"every_steps": 5, "keep": 3, "background": False})
    reconciler.run_once()
    [assignment] = heartbeat(api, a)
    assert (assignment["snapshot_keep"], assignment["snapshot_async"]) == (3, False)
    attempt_id = assignment["attempt_id"]
    digest = "ab" * 32
    r = report(
        api,
        a,
        attempt_id,
        events=[
            event("snapshot_skipped", step=15, reason="checksum mismatch: sha256 0123..."),
            event(
                "snapshot",
                step=10,
                epoch=0,
                world_size=2,
                path="/s/x.pt",
                bytes=123,
                sha256=digest,
                seconds=0.1,
                background=True,
            ),
            event("snapshot_failed", step=20, error="OSError: [Errno 28] No space left on device"),
            event("snapshot", step=25, epoch=1, path="/s/y.pt", bytes=5, sha256="not-a-digest"),
        ],
    )
    assert r.status_code == 200, r.text
    rows = api.get(f"/api/v1/jobs/{job_id}/snapshots").json()["items"]
    assert [(s["step"], s["sha256"], s["world_size"]) for s in rows] == [
        (10, digest, 2),
        (25, None, None),
    ]
    events = {e["kind"]: e for e in api.get(f"/api/v1/jobs/{job_id}/events").json()["items"]}
    assert "checksum mismatch" in events["snapshot_skipped"]["message"]
    assert events["snapshot_skipped"]["data"]["step"] == 15
    assert "No space left" in events["snapshot_failed"]["message"]
    assert events["snapshot_failed"]["data"]["step"] == 20


@pytest.mark.parametrize("keep", [0, 1001, "two"])
def test_a_bad_snapshot_keep_is_refused(api: TestClient, keep: Any) -> None:
    r = api.post(
        "/api/v1/jobs",
        json={"name": "j", "task": {"name": "regression"}, "snapshot": {"keep": keep}},
    )
    assert r.status_code == 422, r.text
    assert "keep" in r.text


def test_a_stopping_agent_leaves_at_once_and_a_new_node_takes_its_place(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    """``docker compose stop``: no waiting out the heartbeat timeout."""
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api, "1:2")
    reconciler.run_once()
    assert len(job(api, job_id)["attempts"][0]["members"]) == 2
    reply = api.post(f"/api/v1/nodes/{a}/leave", json={"reason": "SIGTERM"})
    assert reply.status_code == 200 and reply.json() == {"left": True}
    nodes = {n["name"]: n["state"] for n in api.get("/api/v1/nodes").json()["items"]}
    assert nodes == {"a": "LEFT", "b": "ALIVE"}
    assert "node_left" in kinds(api, job_id)
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    rendezvous = event("rendezvous", world_size=1, group_rank=0, group_world_size=1)
    assert report(api, b, attempt_id, events=[rendezvous]).status_code == 200
    register(api, "c")
    reconciler.run_once()  # no clock advance: the place is free now
    detail = job(api, job_id)
    assert detail["state"] == "RUNNING" and detail["membership_changes"] == 2
    active = [m for m in detail["attempts"][0]["members"] if m["state"] == "ACTIVE"]
    assert sorted(m["node_id"] for m in active) == sorted([b, a + 2])
    again = api.post(f"/api/v1/nodes/{a}/leave", json={})
    assert again.json() == {"left": False}  # idempotent
    assert api.post("/api/v1/nodes/999/leave", json={}).status_code == 401  # no such token
    as_b = {"authorization": f"Bearer {api.node_tokens[b]}"}
    assert api.post("/api/v1/nodes/999/leave", json={}, headers=as_b).status_code == 403
    too_long = api.post(f"/api/v1/nodes/{b}/leave", json={"reason": "x" * 201})
    assert too_long.status_code == 422


def test_the_survivors_are_told_at_once_when_a_member_is_dropped(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    """The heartbeat reply's membership generation moves when the controller drops a
    member (silence, leave, a restarted agent), whatever the workers say, so the
    survivors re-form without waiting for a collective to fail."""
    a, b, c = register(api, "a"), register(api, "b"), register(api, "c")
    job_id = submit(api, "1:3")
    reconciler.run_once()
    [first] = heartbeat(api, a)
    assert (first["membership_generation"], first["active_members"]) == (0, 3)
    assert first["memberships"] == 3
    clock.advance(8)
    heartbeat(api, a), heartbeat(api, b)
    clock.advance(5)  # c silent for 13 s > 10 s
    reconciler.run_once()
    [told] = heartbeat(api, a)
    assert (told["membership_generation"], told["active_members"]) == (1, 2)
    assert told["member_id"] == first["member_id"]
    assert api.post(f"/api/v1/nodes/{b}/leave", json={}).json() == {"left": True}
    [told] = heartbeat(api, a)
    assert (told["membership_generation"], told["active_members"]) == (2, 1)
    d = job(api, job_id)
    assert (d["state"], d["restart_count"], d["membership_changes"]) == ("RUNNING", 0, 2)
    assert c not in {m["node_id"] for m in d["attempts"][0]["members"] if m["state"] == "ACTIVE"}


def test_a_node_joining_before_the_first_rendezvous_is_no_membership_change(
    api: TestClient, reconciler: Reconciler
) -> None:
    """A node that arrives just after the placement is part of the first world."""
    a = register(api, "a")
    job_id = submit(api, "1:3")
    reconciler.run_once()
    register(api, "b")
    reconciler.run_once()
    assert job(api, job_id)["membership_changes"] == 0
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    rendezvous = event("rendezvous", world_size=2, group_rank=0, group_world_size=2)
    assert report(api, a, attempt_id, events=[rendezvous]).status_code == 200
    register(api, "c")
    reconciler.run_once()
    d = job(api, job_id)
    assert (d["membership_changes"], len(d["attempts"][0]["members"])) == (1, 3)


def test_a_controller_that_stalled_does_not_lose_the_nodes_it_could_not_hear(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    """A controller starved of CPU (a loaded host) records no heartbeat and runs no pass:
    when it runs again, its nodes' silence counts from then, not from their last
    recorded heartbeat; dropping a healthy node would end its attempt's workers."""
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api, "2:2")
    reconciler.note_pass(clock())
    reconciler.run_once()
    clock.advance(13)  # neither a pass nor a heartbeat for 13 s > the 10 s timeout
    reconciler.note_pass(clock())
    reconciler.run_once()
    assert {n["state"] for n in api.get("/api/v1/nodes").json()["items"]} == {"ALIVE"}
    assert job(api, job_id)["membership_changes"] == 0
    heartbeat(api, a), heartbeat(api, b)
    for _ in range(2):
        clock.advance(4)
        heartbeat(api, a)
        reconciler.note_pass(clock())
        reconciler.run_once()
    clock.advance(4)  # b silent for 12 s while the controller ran every 4 s
    reconciler.note_pass(clock())
    reconciler.run_once()
    nodes = {n["name"]: n["state"] for n in api.get("/api/v1/nodes").json()["items"]}
    assert nodes == {"a": "ALIVE", "b": "LOST"}


def test_the_old_run_of_a_node_back_in_its_attempt_cannot_touch_its_new_membership(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    """A node that froze, was dropped and joined again in place still has its old run
    to stop: what that run reports (a crash of its thawed workers, its exit) belongs to
    the old membership and is refused or recorded as stale."""
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api, "1:2")
    reconciler.run_once()
    [old] = heartbeat(api, b)
    clock.advance(8)
    heartbeat(api, a)
    clock.advance(5)
    reconciler.run_once()  # b lost
    heartbeat(api, b)
    reconciler.run_once()  # b back, and joins again
    [new] = heartbeat(api, b)
    assert new["member_id"] != old["member_id"]
    attempt_id = new["attempt_id"]
    crash = event("worker_failed", global_rank=1, exitcode=1, cause="crash")
    stale = report(api, b, attempt_id, member_id=old["member_id"], events=[crash])
    assert stale.status_code == 409
    stopped = {"outcome": "stopped", "clean": True, "exit_code": -15}
    assert report(api, b, attempt_id, member_id=old["member_id"], exit=stopped).status_code == 200
    d = job(api, job_id)
    assert (d["state"], d["restart_count"]) == ("RUNNING", 0)
    states = [m["state"] for m in d["attempts"][0]["members"] if m["node_name"] == "b"]
    assert states == ["LEFT", "ACTIVE"]
    assert report(api, b, attempt_id, member_id=new["member_id"], events=[]).status_code == 200


def test_a_node_that_comes_after_the_rendezvous_closed_costs_nothing(
    api: TestClient, reconciler: Reconciler
) -> None:
    """A node joins just as the job finishes: its launcher finds the rendezvous closed
    (another launcher ended first). That is neither a restart nor a node leaving: the
    others are not told to re-form, and the attempt ends as the others report."""
    a = register(api, "a")
    job_id = submit(api, "1:2")
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]
    rendezvous = event("rendezvous", world_size=1, group_rank=0, group_world_size=1)
    assert report(api, a, attempt_id, events=[rendezvous]).status_code == 200
    b = register(api, "b")
    reconciler.run_once()
    [joined] = heartbeat(api, b)
    assert joined["attempt_id"] == attempt_id
    [before] = heartbeat(api, a)
    closed = {"outcome": "closed", "exit_code": 75, "message": "rendezvous had closed"}
    assert report(api, b, attempt_id, exit=closed).status_code == 200
    d = job(api, job_id)
    assert (d["state"], d["restart_count"], len(d["attempts"])) == ("RUNNING", 0, 1)
    assert "node_late" in kinds(api, job_id)
    [after] = heartbeat(api, a)
    assert after["membership_generation"] == before["membership_generation"]
    assert after["memberships"] == 2  # b's membership counts: it did join
    done = {"outcome": "succeeded", "exit_code": 0}
    assert report(api, a, attempt_id, exit=done).status_code == 200
    d = job(api, job_id)
    assert (d["state"], d["restart_count"]) == ("SUCCEEDED", 0)
    assert {m["node_id"]: m["state"] for m in d["attempts"][0]["members"]} == {
        a: "FINISHED",
        b: "EXITED",
    }
