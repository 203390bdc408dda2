"""A job shows its step time, computed from its last two progress reports."""

from __future__ import annotations

from typing import Any

from service import jobs
from service.db import transaction
from service.reconciler import Reconciler
from tests.service.helpers import Cluster, heartbeat, job, register, report, statements, submit

SPEC = {"task": {"name": "regression", "params": {"epochs": 2}}}


def progress(time: str, step: int, **data: Any) -> dict[str, Any]:
    return {"time": time, "kind": "progress", "data": {"step": step, **data}}


def test_a_job_shows_the_mean_step_time_between_its_last_two_progress_reports(
    api: Cluster, reconciler: Reconciler
) -> None:
    node_id = register(api, "a")
    job_id = submit(api, nnodes="1:1")
    reconciler.run_once()
    [assignment] = heartbeat(api, node_id)
    attempt_id = assignment["attempt_id"]

    r = report(api, node_id, attempt_id, events=[progress("2026-11-22T00:00:00Z", 1)])
    assert r.status_code == 200, r.text
    assert job(api, job_id)["step_time_s"] is None  # one report: no interval yet

    events = [
        progress("2026-11-22T00:00:01Z", 5, step_time_s=0.25, metrics={"acc": 0.5}),
        progress("2026-11-22T00:00:03Z", 13, step_time_s=0.25, metrics={"acc": 0.75}),
    ]
    r = report(api, node_id, attempt_id, events=events)
    assert r.status_code == 200, r.text

    shown = job(api, job_id)
    assert shown["last_step"] == 13
    assert shown["step_time_s"] == 0.25  # 2 s over 8 steps
    [listed] = api.get("/api/v1/jobs").json()["items"]
    assert listed["step_time_s"] == 0.25
    metrics = api.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"]
    assert [m["named"] for m in metrics] == [None, {"acc": 0.5}, {"acc": 0.75}]


def test_too_many_named_metrics_are_refused(api: Cluster, reconciler: Reconciler) -> None:
    node_id = register(api, "a")
    submit(api, nnodes="1:1")
    reconciler.run_once()
    [assignment] = heartbeat(api, node_id)
    metrics = {f"m{i}": 1.0 for i in range(17)}
    events = [progress("2026-11-22T00:00:00Z", 1, metrics=metrics)]
    r = report(api, node_id, assignment["attempt_id"], events=events)
    assert r.status_code == 422
    assert "metrics" in r.text


def test_a_page_of_jobs_reads_its_step_times_in_two_statements(
    api: Cluster, reconciler: Reconciler
) -> None:
    """However many jobs the page lists; a job whose step did not move on, or that
    reported once, shows none."""
    nodes = [register(api, name) for name in "abc"]
    job_ids = [submit(api, nnodes="1:1") for _ in nodes]
    reconciler.run_once()
    steps = {0: [1, 5], 1: [7, 7], 2: [3]}  # by node: the steps its progress reports say
    times = [f"2026-11-22T00:00:0{second}Z" for second in (1, 3)]
    for n, node_id in enumerate(nodes):
        [assignment] = heartbeat(api, node_id)
        events = [progress(t, step) for t, step in zip(times, steps[n], strict=False)]
        r = report(api, node_id, assignment["attempt_id"], events=events)
        assert r.status_code == 200, r.text
    placed = {a["job_id"] for node_id in nodes for a in heartbeat(api, node_id)}
    assert placed == set(job_ids)
    by_node = {node_id: heartbeat(api, node_id)[0]["job_id"] for node_id in nodes}

    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session, statements(session.get_bind()) as sent:
        shown = jobs.last_step_times(session, job_ids)
    assert shown == {by_node[nodes[0]]: 0.5}  # 2 s over 4 steps
    assert len([s for s in sent if not s.startswith("BEGIN")]) == 2, sent  # SQLite's BEGIN
