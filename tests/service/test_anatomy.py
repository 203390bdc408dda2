"""A recovery's anatomy: its phases from a job's timeline events, and the route that shows them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from service.anatomy import (
    CONTROLLER,
    OBSERVER,
    TimelineEvent,
    recoveries,
    with_fault,
)
from service.reconciler import Reconciler
from tests.service.helpers import Cluster, heartbeat, register, submit

T0 = datetime(2026, 11, 22, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def iso(seconds: float) -> str:
    return at(seconds).isoformat().replace("+00:00", "Z")


def startup(**moments: float) -> dict[str, Any]:
    return {"startup": {f"{name}_at": iso(s) for name, s in moments.items()}}


def event(kind: str, seconds: float, node: int | None = 1, **data: Any) -> TimelineEvent:
    return TimelineEvent(kind, at(seconds), node, data)


FIRST_START = [
    event("rendezvous", 0.0),
    event("training_started", 3.0, **startup(process_started=0.5, imported=2.0)),
    event("first_step", 4.0, **startup(process_started=0.5, imported=2.0, first_step=3.5)),
]


def phase_seconds(recovery: Any) -> dict[str, float | None]:
    return {p.name: p.seconds for p in recovery.phases}


def test_a_restart_has_every_phase_from_failure_to_first_step() -> None:
    moments = startup(
        process_started=12.0,
        imported=14.0,
        process_group=14.5,
        snapshot_loaded=15.0,
        first_step=15.25,
    )
    events = [
        *FIRST_START,
        event("worker_failed", 10.0, node=2),
        event("rendezvous", 11.0, node=1),
        event("resumed", 15.1, **{"startup": {**moments["startup"], "first_step_at": None}}),
        event("first_step", 15.3, **moments),
    ]
    [recovery] = recoveries(events)
    assert recovery.cause == "worker_failed"
    assert phase_seconds(recovery) == {
        "detection": None,  # no one told the controller when the fault was
        "rendezvous": 1.0,
        "process_start": 1.0,
        "imports": 2.0,
        "process_group": 0.5,
        "snapshot_load": 0.5,
        "first_step": 0.25,
    }
    assert recovery.total_s == 5.25
    same = {p.name: p.same_clock for p in recovery.phases}
    # The failure was seen on node 2, the rendezvous and the new process on node 1.
    assert same["rendezvous"] is False
    assert all(same[name] for name in ("process_start", "imports", "snapshot_load"))


def test_the_fault_moment_adds_the_detection_phase_on_the_observer_clock() -> None:
    events = [
        event("worker_failed", 10.0),
        event("rendezvous", 11.0),
        event("first_step", 14.0, **startup(process_started=12.0, first_step=13.0)),
    ]
    [recovery] = recoveries(events)
    faulted = with_fault(recovery, at(9.5))
    [detection, *_] = faulted.phases
    assert (detection.since, detection.seconds, detection.same_clock) == ("fault", 0.5, False)
    assert faulted.moments["fault"] == (at(9.5), OBSERVER)
    assert faulted.total_s == 3.5


def test_a_moment_not_reported_leaves_its_phase_empty_and_the_next_covers_it() -> None:
    events = [
        event("node_left", 20.0, node=None),
        event("rendezvous", 22.0),
        event("first_step", 30.0, **startup(process_started=23.0, imported=25.0, first_step=28.0)),
    ]
    [recovery] = recoveries(events)
    seconds = phase_seconds(recovery)
    assert seconds["process_group"] is None and seconds["snapshot_load"] is None
    [first_step] = [p for p in recovery.phases if p.name == "first_step"]
    assert (first_step.since, first_step.seconds) == ("imported", 3.0)
    assert recovery.moments["failed"] == (at(20.0), CONTROLLER)
    assert [p.same_clock for p in recovery.phases][1] is False  # controller → node


def test_the_failures_of_one_incident_are_one_recovery_and_a_later_one_another() -> None:
    events = [
        *FIRST_START,
        event("hang_detected", 10.0),
        event("worker_failed", 10.2),
        event("worker_failed", 10.4, node=2, cause="peer_lost"),
        event("rendezvous", 12.0),
        event("first_step", 16.0, **startup(process_started=13.0, first_step=15.0)),
        event("node_left", 30.0, node=None),
        event("rendezvous", 33.0),
    ]
    first, second = recoveries(events)
    assert first.cause == "hang_detected"
    assert phase_seconds(first)["rendezvous"] == 2.0
    assert second.cause == "node_left"
    assert not second.complete and second.total_s is None
    assert phase_seconds(second)["rendezvous"] == 3.0
    assert phase_seconds(second)["first_step"] is None


def test_events_are_taken_in_time_order_not_in_the_order_they_arrived() -> None:
    # The rendezvous's node reported before the failed worker's node did.
    events = [
        event("rendezvous", 11.0),
        event("worker_failed", 10.0, node=2),
        event("first_step", 14.0, **startup(process_started=12.0, first_step=13.0)),
    ]
    [recovery] = recoveries(events)
    assert phase_seconds(recovery)["rendezvous"] == 1.0
    assert recovery.complete


def test_a_job_that_never_failed_has_no_recovery_and_a_start_without_moments_none_either() -> None:
    assert recoveries(FIRST_START) == []
    events = [event("worker_failed", 10.0), event("rendezvous", 11.0), event("resumed", 12.0)]
    [recovery] = recoveries(events)
    assert set(recovery.moments) == {"failed", "rendezvous"}


def test_a_node_placed_before_the_first_rendezvous_opens_no_recovery() -> None:
    events = [event("node_joined", -1.0, node=2, cause="placed"), *FIRST_START]
    assert recoveries(events) == []


def test_a_fatal_failure_and_a_cancel_leave_no_recovery_waiting_forever() -> None:
    fatal = event("worker_failed", 10.0, fatal=True, cause="fatal_exit_code")
    assert recoveries([*FIRST_START, fatal]) == []
    failed = event("worker_failed", 10.0)
    assert recoveries([*FIRST_START, failed, event("cancelled", 11.0, node=None)]) == []
    # a recovery that came back stays
    back = [
        failed,
        event("rendezvous", 11.0),
        event("first_step", 14.0, **startup(process_started=12.0, first_step=13.0)),
    ]
    [recovery] = recoveries([*FIRST_START, *back, event("cancelled", 20.0, node=None)])
    assert recovery.complete


def test_a_phase_negative_within_the_clock_resolution_is_zero_and_beyond_it_is_kept() -> None:
    def process_start(started: float) -> float | None:
        events = [
            *FIRST_START,
            event("worker_failed", 10.0),
            event("rendezvous", 11.0),
            event("first_step", 14.0, **startup(process_started=started, first_step=13.0)),
        ]
        [recovery] = recoveries(events)
        return phase_seconds(recovery)["process_start"]

    assert process_start(10.995) == 0.0
    events = [
        *FIRST_START,
        event("worker_failed", 10.0),
        event("rendezvous", 11.0),
        event("first_step", 14.0, **startup(process_started=10.995, first_step=13.0)),
    ]
    [recovery] = recoveries(events)
    assert recovery.total_s == sum(p.seconds or 0.0 for p in recovery.phases)
    assert process_start(10.99) == 0.0
    assert process_start(10.98) == -0.02
    assert process_start(11.5) == 0.5


def test_a_worker_moment_out_of_bounds_is_taken_as_not_reported() -> None:
    def moments(**reported: float) -> set[str]:
        events = [
            *FIRST_START,
            event("worker_failed", 4000.0),
            event("rendezvous", 4001.0),
            event("first_step", 4010.0, **startup(**reported)),
        ]
        [recovery] = recoveries(events)
        return set(recovery.moments)

    # an hour before the failure, and sixty seconds after the event, are the bounds
    within = moments(process_started=400.0, imported=4070.0, first_step=4005.0)
    assert within == {"failed", "rendezvous", "process_started", "imported", "first_step"}
    beyond = moments(process_started=399.0, imported=4070.5, first_step=4005.0)
    assert beyond == {"failed", "rendezvous", "first_step"}


def test_a_later_start_with_more_moments_replaces_a_partial_one_of_the_same_kind() -> None:
    events = [
        *FIRST_START,
        event("worker_failed", 10.0),
        event("rendezvous", 11.0),
        event("first_step", 14.0, **startup(process_started=12.0)),
        event("first_step", 15.0, **startup(process_started=12.0, first_step=14.5)),
    ]
    [recovery] = recoveries(events)
    assert recovery.complete and recovery.total_s == 4.5


def report(attempt_id: int, *events: tuple[str, float, dict[str, Any]]) -> Any:
    return {
        "attempt_id": attempt_id,
        "events": [{"time": iso(s), "kind": kind, "data": data} for kind, s, data in events],
    }


def placed(api: Cluster, reconciler: Reconciler) -> tuple[int, int, dict[str, Any]]:
    """A one-node job placed on node "a": the node's id, the job's and its assignment."""
    node_id = register(api, "a")
    job_id = submit(api, nnodes="1")
    reconciler.run_once()
    [assignment] = heartbeat(api, node_id)
    return node_id, job_id, assignment


def test_the_recoveries_route_joins_the_reported_events(
    api: Cluster, reconciler: Reconciler
) -> None:
    node_id, job_id, assignment = placed(api, reconciler)
    rendezvous = {"world_size": 1, "group_rank": 0, "group_world_size": 1}
    first = startup(process_started=0.5, imported=1.0, process_group=1.5, first_step=2.0)
    again = {"process_started": 12.0, "imported": 13.0, "process_group": 13.5}
    again["snapshot_loaded"] = 14.0
    body = report(
        assignment["attempt_id"],
        ("rendezvous", 0.0, rendezvous),
        ("started", 1.8, {"world_size": 1, **first}),
        ("progress", 2.1, {"step": 1, "world_size": 1, **first}),
        ("worker_failed", 10.0, {"local_rank": 0, "global_rank": 0, "exitcode": -9}),
        ("rendezvous", 11.0, {**rendezvous, "restart_count": 1}),
        ("started", 14.1, {"world_size": 1, "resumed_from_step": 1, **startup(**again)}),
        ("progress", 15.0, {"step": 2, "world_size": 1, **startup(**again, first_step=14.5)}),
    )
    r = api.post(f"/api/v1/nodes/{node_id}/reports", json=body)
    assert r.status_code == 200, r.text
    kinds = [e["kind"] for e in api.get(f"/api/v1/jobs/{job_id}/events").json()["items"]]
    assert kinds.count("first_step") == 2

    [recovery] = api.get(f"/api/v1/jobs/{job_id}/recoveries").json()["items"]
    assert recovery["cause"] == "worker_failed"
    assert [(p["name"], p["seconds"]) for p in recovery["phases"]] == [
        ("detection", None),
        ("rendezvous", 1.0),
        ("process_start", 1.0),
        ("imports", 1.0),
        ("process_group", 0.5),
        ("snapshot_load", 0.5),
        ("first_step", 0.5),
    ]
    assert set(recovery["clocks"].values()) == {f"node {node_id}"}
    assert all(p["same_clock"] for p in recovery["phases"][1:])
    assert recovery["total_s"] == 4.5
    assert api.get("/api/v1/jobs/999/recoveries").status_code == 404


def test_a_process_start_goes_on_the_timeline_once_per_round_however_often_it_is_reported(
    api: Cluster, reconciler: Reconciler
) -> None:
    node_id, job_id, assignment = placed(api, reconciler)
    attempt_id = assignment["attempt_id"]
    rendezvous = {"world_size": 1, "group_rank": 0, "group_world_size": 1}
    partial = startup(process_started=0.5, imported=1.0)
    complete = startup(process_started=0.5, imported=1.0, first_step=2.0)

    def progress(step: int, moments: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
        return ("progress", 2.0 + step / 1000, {"step": step, "world_size": 1, **moments})

    def first_steps() -> list[dict[str, Any]]:
        items = api.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
        return [e for e in items if e["kind"] == "first_step"]

    many = [progress(i, partial) for i in range(300)] + [progress(i, complete) for i in range(300)]
    body = report(attempt_id, ("rendezvous", 0.0, rendezvous), *many)
    assert api.post(f"/api/v1/nodes/{node_id}/reports", json=body).status_code == 200
    # one without the first step's moment, then one with it; the rest are dropped
    assert len(first_steps()) == 2
    again = report(attempt_id, *[progress(300 + i, complete) for i in range(300)])
    assert api.post(f"/api/v1/nodes/{node_id}/reports", json=again).status_code == 200
    assert len(first_steps()) == 2
    # a new round takes a new start
    body = report(attempt_id, ("rendezvous", 3.0, rendezvous), progress(900, complete))
    assert api.post(f"/api/v1/nodes/{node_id}/reports", json=body).status_code == 200
    assert len(first_steps()) == 3
