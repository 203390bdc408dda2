"""A report reads its node, its attempt and the node's membership of it in one statement
before it takes its job's lock; it used to take three round trips, which under load each
wait for the server and then for the interpreter lock. A progress report that puts nothing
on the timeline does not ask when the attempt's members last changed, reads no whole rows
and takes no lock on its job before its last statement."""

from __future__ import annotations

from typing import Any

from service.reconciler import Reconciler
from tests.service.helpers import (
    Cluster,
    bearer,
    event,
    heartbeat,
    job,
    kinds,
    register,
    report,
    statements,
    submit,
)
from tests.service.test_heartbeat_cost import engine_of


def at_work(api: Cluster, reconciler: Reconciler) -> tuple[int, int, dict[str, Any]]:
    """A node told to run a one-node job: the node, the job, and its assignment."""
    node_id = register(api, "a")
    job_id = submit(api, "1")
    reconciler.run_once()
    (assignment,) = heartbeat(api, node_id)
    return node_id, job_id, assignment


def test_a_report_reads_its_node_attempt_and_membership_in_one_statement(
    api: Cluster, reconciler: Reconciler
) -> None:
    node_id, _, assignment = at_work(api, reconciler)
    attempt_id = assignment["attempt_id"]

    # a snapshot's failure goes on the timeline: the general path, which locks the job
    failed = event("snapshot_failed", step=4, error="disk full")
    with statements(engine_of(api)) as sent:
        r = report(api, node_id, attempt_id, member_id=assignment["member_id"], events=[failed])
        assert r.status_code == 200, r.text
    work = [" ".join(s.split()) for s in sent if not s.startswith("BEGIN")]
    reporter, job, *_ = work
    assert "FROM nodes LEFT OUTER JOIN attempts" in reporter, reporter
    assert "LEFT OUTER JOIN attempt_members" in reporter, reporter
    assert job.startswith("SELECT jobs.id"), job
    if engine_of(api).dialect.name == "postgresql":
        assert job.endswith("FOR UPDATE"), job


def test_a_report_on_another_node_s_membership_is_fenced(
    api: Cluster, reconciler: Reconciler
) -> None:
    """The membership is the reporting node's own: naming another node's is refused, and
    so is an attempt that does not exist."""
    a, b = register(api, "a"), register(api, "b")
    submit(api, "2:2")
    reconciler.run_once()
    (on_a,) = heartbeat(api, a)
    (on_b,) = heartbeat(api, b)
    assert on_a["attempt_id"] == on_b["attempt_id"]

    theirs = report(api, a, on_a["attempt_id"], member_id=on_b["member_id"])
    assert theirs.status_code == 409, theirs.text
    nowhere = report(api, a, on_a["attempt_id"] + 100)
    assert nowhere.status_code == 409, nowhere.text
    own = report(api, a, on_a["attempt_id"], member_id=on_a["member_id"])
    assert own.status_code == 200, own.text


def test_a_progress_report_reads_the_timeline_only_for_what_it_puts_there(
    api: Cluster, reconciler: Reconciler
) -> None:
    node_id, job_id, assignment = at_work(api, reconciler)
    attempt_id = assignment["attempt_id"]
    progress = event("progress", step=10, epoch=0, loss=0.5, samples_per_s=1.0, world_size=1)

    with statements(engine_of(api)) as sent:
        r = report(api, node_id, attempt_id, events=[progress])
        assert r.status_code == 200, r.text
    assert not [s for s in sent if "job_events" in s], sent

    # The first progress of a new worker process goes on the timeline: then it asks.
    first = event(
        "progress",
        step=11,
        epoch=0,
        loss=0.5,
        samples_per_s=1.0,
        world_size=1,
        startup={"process_started_at": progress["time"], "first_step_at": progress["time"]},
    )
    with statements(engine_of(api)) as sent:
        r = report(api, node_id, attempt_id, events=[first])
        assert r.status_code == 200, r.text
    assert [s for s in sent if "max(job_events.time)" in s], sent
    assert "first_step" in kinds(api, job_id)


def _work(sent: list[str]) -> list[str]:
    return [" ".join(s.split()) for s in sent if not s.startswith("BEGIN")]


def test_a_progress_report_writes_each_row_once(api: Cluster, reconciler: Reconciler) -> None:
    """One read of the columns its fencing checks, then one statement for each table it
    writes: first the job's last step (its row locked by an UPDATE, as the general path
    locks it before its inserts), then its progress and its log lines, nothing more."""
    node_id, job_id, assignment = at_work(api, reconciler)
    progress = [
        event("progress", step=step, epoch=0, loss=1 / step, samples_per_s=1.0, world_size=1)
        for step in (3, 4)
    ]
    lines = [{"time": progress[0]["time"], "line": f"step {step}"} for step in (3, 4)]

    with statements(engine_of(api)) as sent:
        r = report(api, node_id, assignment["attempt_id"], events=progress, logs=lines)
        assert r.status_code == 200, r.text
    read, *writes = _work(sent)
    assert read.startswith("SELECT nodes.token_hash, attempts.job_id, attempts.state"), read
    assert "FOR UPDATE" not in read, read
    assert [w.split(" (")[0].split(" SET ")[0] for w in writes] == [
        "UPDATE jobs",
        "INSERT INTO metrics",
        "INSERT INTO log_lines",
    ], writes
    detail = job(api, job_id)
    assert (detail["last_step"], detail["last_loss"]) == (4, 0.25), detail
    logged = api.get(f"/api/v1/jobs/{job_id}/logs").json()
    assert [line["line"] for line in logged["items"]][-2:] == ["step 3", "step 4"], logged


def test_a_progress_report_on_an_attempt_that_is_over_is_fenced_and_writes_nothing(
    api: Cluster, reconciler: Reconciler
) -> None:
    """The lean path's fencing refuses as the general path does: 409 with the reason, and
    neither its line nor its progress is kept."""
    node_id, job_id, assignment = at_work(api, reconciler)
    assert api.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 200
    reconciler.run_once()
    progress = event("progress", step=9, epoch=0, loss=0.5, samples_per_s=1.0, world_size=1)
    line = {"time": progress["time"], "line": "after the end"}

    r = report(api, node_id, assignment["attempt_id"], events=[progress], logs=[line])
    assert r.status_code == 409, r.text
    assert r.json()["reason"] == "cancelled", r.json()
    assert job(api, job_id)["last_step"] is None
    logged = api.get(f"/api/v1/jobs/{job_id}/logs").json()
    assert "after the end" not in [line["line"] for line in logged["items"]], logged


def test_a_progress_report_with_another_node_s_token_is_refused(
    api: Cluster, reconciler: Reconciler
) -> None:
    node_id, job_id, assignment = at_work(api, reconciler)
    other = register(api, "b")
    progress = event("progress", step=2, epoch=0, loss=0.5, samples_per_s=1.0, world_size=1)

    body = {"attempt_id": assignment["attempt_id"], "events": [progress]}
    theirs = bearer(api.node_tokens[other])

    r = api.post(f"/api/v1/nodes/{node_id}/reports", json=body, headers=theirs)
    assert r.status_code == 403, r.text
    r = api.post(f"/api/v1/nodes/{other}/reports", json=body)
    assert r.status_code == 409, r.text  # b's own token, but b is no member of the attempt
    assert job(api, job_id)["last_step"] is None
    r = report(api, node_id, assignment["attempt_id"], events=[progress])
    assert r.status_code == 200, r.text
    assert job(api, job_id)["last_step"] == 2


def test_a_rendezvous_that_changes_no_world_size_writes_only_the_node_s_round(
    api: Cluster, reconciler: Reconciler
) -> None:
    """The second node of a round reports the world size the first one already wrote:
    the job and the attempt are not written again."""
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api, "2:2")
    reconciler.run_once()
    (on_a,) = heartbeat(api, a)
    assert [m["attempt_id"] for m in heartbeat(api, b)] == [on_a["attempt_id"]]
    attempt_id = on_a["attempt_id"]

    def rendezvous(rank: int) -> dict[str, Any]:
        return event("rendezvous", world_size=2, group_rank=rank, group_world_size=2)

    assert report(api, a, attempt_id, events=[rendezvous(0)]).status_code == 200
    with statements(engine_of(api)) as sent:
        r = report(api, b, attempt_id, events=[rendezvous(1)])
        assert r.status_code == 200, r.text
    writes = [w for w in _work(sent) if not w.startswith("SELECT")]
    assert len(writes) == 1 and writes[0].startswith("UPDATE attempt_members SET"), writes
    assert api.get(f"/api/v1/jobs/{job_id}").json()["world_size"] == 2
