"""A job's detail and the job list are served from kept bodies only while every stored
value they show is unchanged: whatever changes, the next read answers the new body."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from service.api.answers import Answer, AnswerCache
from service.api.jobs import job_detail, jobs_page
from service.db import transaction
from service.models import Attempt, AttemptMember, Job, Metric, Role, Snapshot, User
from service.reconciler import Reconciler
from service.schemas import AttemptPublic, JobDetail, MemberPublic
from service.states import AttemptState, MemberState
from tests.service.helpers import Cluster, bearer, heartbeat, register, report, submit

# Each changes one value a job's answer shows, straight in the database: none of them
# moves the job's updated_at or adds an event.
CHANGES: dict[str, str] = {
    "job progress": "UPDATE jobs SET last_loss = 0.25, last_step = 7",
    "job message": "UPDATE jobs SET message = 'said again'",
    "attempt result": "UPDATE attempts SET result = 'it ended'",
    "attempt world size": "UPDATE attempts SET world_size = 3",
    "member exit code": "UPDATE attempt_members SET exit_code = 3",
    "member gpus": "UPDATE attempt_members SET gpus = '[0]'",
    "node name": "UPDATE nodes SET name = 'renamed'",
    "owner name": "UPDATE users SET name = 'root-renamed' WHERE name = 'root'",
}


def _add_snapshot(session: Session) -> None:
    job_id, attempt_id = session.execute(text("SELECT job_id, id FROM attempts")).one()
    session.add(
        Snapshot(
            job_id=job_id,
            attempt_id=attempt_id,
            step=5,
            epoch=0,
            path="/x",
            bytes=1,
            world_size=1,
            created_at=datetime(2026, 1, 2, tzinfo=UTC),
        )
    )


def _add_metric(session: Session) -> None:
    """A progress row the job's own columns do not show: only the step time moves."""
    job_id, attempt_id = session.execute(text("SELECT job_id, id FROM attempts")).one()
    at = datetime(2026, 1, 1, 0, 0, 9, tzinfo=UTC)
    session.add(
        Metric(job_id=job_id, attempt_id=attempt_id, time=at, step=9, epoch=0, world_size=1)
    )


def _progress(api: Cluster, node: int, attempt: int, step: int) -> None:
    event = {"time": f"2026-01-01T00:00:{step:02d}Z", "kind": "progress", "data": {"step": step}}
    assert report(api, node, attempt, events=[event]).status_code == 200


def _admin(session: Session) -> User:
    return session.scalars(select(User).where(User.role == Role.ADMIN)).first()  # type: ignore[return-value]


@pytest.fixture
def running(api: Cluster, reconciler: Reconciler) -> tuple[int, int, int]:
    """A job placed on one node: (job, node, attempt)."""
    node = register(api, "a")
    job_id = submit(api, "1")
    reconciler.run_once()
    [assignment] = heartbeat(api, node)
    return job_id, node, assignment["attempt_id"]


def _fresh(api: Cluster, build: Callable[[Session, User], str]) -> Any:
    """The answer built now, without any kept body."""
    with transaction(api.app.state.read_session_factory) as session:  # type: ignore[attr-defined]
        return json.loads(build(session, _admin(session)))


@pytest.mark.parametrize("change", [*CHANGES, "snapshot", "metric", "progress report"])
def test_any_change_is_answered_at_once_with_a_new_body(
    api: Cluster, running: tuple[int, int, int], change: str
) -> None:
    job_id, node, attempt = running
    _progress(api, node, attempt, 1)
    reads: dict[str, Callable[[Session, User], str]] = {
        f"/api/v1/jobs/{job_id}": lambda s, u: job_detail(s, job_id, u),
        "/api/v1/jobs": lambda s, u: jobs_page(s, u, None, 50, 0),
    }
    etags, before = {}, {}
    for path, build in reads.items():
        etags[path] = api.get(path).headers["etag"]
        before[path] = _fresh(api, build)
        assert api.get(path, headers={"if-none-match": etags[path]}).status_code == 304

    if change == "snapshot":
        with transaction(api.app.state.session_factory) as session:  # type: ignore[attr-defined]
            _add_snapshot(session)
    elif change == "metric":
        with transaction(api.app.state.session_factory) as session:  # type: ignore[attr-defined]
            _add_metric(session)
    elif change == "progress report":
        _progress(api, node, attempt, 3)
    else:
        with transaction(api.app.state.session_factory) as session:  # type: ignore[attr-defined]
            session.execute(text(CHANGES[change]))

    detail = f"/api/v1/jobs/{job_id}"
    assert _fresh(api, reads[detail]) != before[detail]  # every change shows in the detail
    for path, build in reads.items():
        now = _fresh(api, build)
        answered = api.get(path, headers={"if-none-match": etags[path]})
        if now == before[path]:  # the list shows no attempts
            assert answered.status_code == 304, (path, change)
            continue
        assert answered.status_code == 200, (path, change)
        assert answered.headers["etag"] != etags[path]
        assert answered.json() == now, (path, change)
        again = api.get(path, headers={"if-none-match": answered.headers["etag"]})
        assert again.status_code == 304


def test_a_kept_body_is_the_body_built_from_scratch(
    api: Cluster, running: tuple[int, int, int]
) -> None:
    job_id, node, attempt = running
    _progress(api, node, attempt, 1)
    _progress(api, node, attempt, 2)
    for _ in range(2):  # built, then kept
        shown = api.get(f"/api/v1/jobs/{job_id}")
        assert shown.json() == _fresh(api, lambda s, u: job_detail(s, job_id, u))
        assert shown.json()["step_time_s"] == 1.0
        assert shown.json()["attempts"][0]["members"][0]["node_name"] == "a"
    assert len(api.app.state.answers) == 1  # type: ignore[attr-defined]


def test_another_users_job_is_not_found_even_with_its_etag(api: Cluster) -> None:
    alice, bob = api.add_user("alice"), api.add_user("bob")
    job_id = submit(api, "1")  # the admin's job
    alices = api.post(
        "/api/v1/jobs", json={"name": "a", "task": {"name": "regression"}}, headers=bearer(alice)
    ).json()["id"]
    etag = api.get(f"/api/v1/jobs/{alices}", headers=bearer(alice)).headers["etag"]

    for asked in (alices, job_id):
        foreign = api.get(f"/api/v1/jobs/{asked}", headers={"if-none-match": etag, **bearer(bob)})
        assert foreign.status_code == 404 and "etag" not in foreign.headers
        assert foreign.json()["detail"] == f"job {asked} does not exist"
    missing = api.get("/api/v1/jobs/999", headers={"if-none-match": etag, **bearer(bob)})
    assert missing.status_code == 404
    assert missing.json().keys() == foreign.json().keys()

    # The admin sees alice's job, and the same body she does.
    admins = api.get(f"/api/v1/jobs/{alices}", headers={"if-none-match": etag})
    assert admins.status_code == 304


def test_each_caller_gets_their_own_list(api: Cluster) -> None:
    alice, bob = api.add_user("alice"), api.add_user("bob")
    submit(api, "1")
    for token in (alice, bob):
        api.post(
            "/api/v1/jobs",
            json={"name": "x", "task": {"name": "regression"}},
            headers=bearer(token),
        )
    everything = api.get("/api/v1/jobs")
    assert everything.json()["total"] == 3
    for name, token in (("alice", alice), ("bob", bob)):
        own = api.get(
            "/api/v1/jobs", headers={"if-none-match": everything.headers["etag"], **bearer(token)}
        )
        assert own.status_code == 200
        assert [j["owner"] for j in own.json()["items"]] == [name]
        assert own.json()["total"] == 1


def test_the_cache_keeps_one_body_per_key_within_its_bounds() -> None:
    cache = AnswerCache(max_bytes=10, max_entries=2)
    cache.put("a", 1, Answer.of(b"12345"))
    assert cache.get("a", 1) == Answer.of(b"12345")
    assert cache.get("a", 2) is None  # another version
    cache.put("a", 2, Answer.of(b"abcde"))
    assert cache.get("a", 1) is None and len(cache) == 1
    cache.put("b", 1, Answer.of(b"xy"))
    cache.put("c", 1, Answer.of(b"z"))  # three entries: the least recently used goes
    assert cache.get("a", 2) is None and len(cache) == 2
    cache.put("d", 1, Answer.of(b"0123456789"))  # ten bytes: every other body goes
    assert len(cache) == 1 and cache.get("d", 1) is not None
    cache.put("e", 1, Answer.of(b"0123456789x"))  # larger than the cache: not kept
    assert cache.get("e", 1) is None and cache.get("d", 1) is not None


def test_a_body_read_while_the_job_changed_is_served_but_not_kept() -> None:
    cache = AnswerCache()
    versions = iter([1, 2, 2, 2])
    built = cache.answer("k", lambda: next(versions), lambda: '{"n": 1}')
    assert built.body == b'{"n": 1}' and len(cache) == 0  # version 1 before, 2 after
    again = cache.answer("k", lambda: next(versions), lambda: '{"n": 2}')
    assert again.body == b'{"n": 2}' and cache.get("k", 2) == again


def test_a_kept_page_follows_jobs_that_come_leave_its_filter_or_shift_it(
    api: Cluster, reconciler: Reconciler
) -> None:
    alice = api.add_user("alice")
    register(api, "a")
    first = submit(api, "1")
    pages = {
        "pending": {"state": "PENDING"},
        "running": {"state": "RUNNING"},
        "second": {"limit": 1, "offset": 1},
    }

    def read(page: str, etag: str | None = None, token: str | None = None) -> Any:
        headers = {"if-none-match": etag} if etag else {}
        return api.get(
            "/api/v1/jobs",
            params=pages[page],
            headers={**headers, **bearer(token)} if token else headers,
        )

    etags = {page: read(page).headers["etag"] for page in pages}
    assert [j["id"] for j in read("pending").json()["items"]] == [first]

    reconciler.run_once()  # the job is placed: RUNNING, no longer PENDING
    assert read("pending", etags["pending"]).json()["items"] == []
    assert [j["id"] for j in read("running", etags["running"]).json()["items"]] == [first]

    second = submit(api, "2")  # the newest comes first: the first job moves to page two
    assert [j["id"] for j in read("second", etags["second"]).json()["items"]] == [first]
    assert read("second").json()["total"] == 2

    # Alice's own page (the same parameters) is hers alone, before and after her submit.
    assert read("second", token=alice).json() == {"items": [], "total": 0, "limit": 1, "offset": 1}
    theirs = api.post(
        "/api/v1/jobs", json={"name": "x", "task": {"name": "regression"}}, headers=bearer(alice)
    )
    assert read("second", token=alice).json()["total"] == 1
    assert [j["id"] for j in read("second").json()["items"]] == [second]
    assert theirs.json()["id"] not in (first, second)


def _new_values(node: int) -> dict[tuple[str, str], Any]:
    """A new stored value for each field of an attempt and a member that the detail
    shows; ``node`` is another node's id."""
    later = datetime(2030, 1, 1, tzinfo=UTC)
    return {
        ("attempts", "number"): 7,
        ("attempts", "rdzv_id"): "another",
        ("attempts", "state"): AttemptState.STOPPED,
        ("attempts", "device"): "cuda",
        ("attempts", "world_size"): 5,
        ("attempts", "created_at"): later,
        ("attempts", "ended_at"): later,
        ("attempts", "result"): "ended",
        ("attempt_members", "node_id"): node,
        ("attempt_members", "state"): MemberState.LEFT,
        ("attempt_members", "joined_at"): later,
        ("attempt_members", "left_at"): later,
        ("attempt_members", "exit_code"): 9,
        ("attempt_members", "gpus"): [5],
    }


# Shown but not changed here: ids (an attempt's id is referred to by its members, so
# it is never changed), the node's name (CHANGES) and the members (their fields are).
NOT_CHANGED = {("attempts", "id"), ("attempts", "members"), ("attempt_members", "node_name")}


def test_every_field_of_an_attempt_and_a_member_is_in_the_version(
    api: Cluster, running: tuple[int, int, int]
) -> None:
    """A field added to AttemptPublic or MemberPublic must be added to the version (and
    here): otherwise its changes would be answered with the old body."""
    job_id, _, _ = running
    other = register(api, "b")
    values = _new_values(other)
    shown = {("attempts", f) for f in AttemptPublic.model_fields}
    shown |= {("attempt_members", f) for f in MemberPublic.model_fields}
    assert shown - NOT_CHANGED == set(values)
    path = f"/api/v1/jobs/{job_id}"
    for (table, column), value in values.items():
        before = api.get(path)
        with transaction(api.app.state.session_factory) as session:  # type: ignore[attr-defined]
            rows = Attempt.__table__ if table == "attempts" else AttemptMember.__table__
            session.execute(update(rows).values({column: value}))
        after = api.get(path, headers={"if-none-match": before.headers["etag"]})
        assert after.status_code == 200, column
        assert after.json() != before.json(), column
        assert after.json() == _fresh(api, lambda s, u: job_detail(s, job_id, u)), column


def test_every_field_of_a_job_is_a_column_of_its_row_or_read_into_the_version() -> None:
    """The version reads the job's whole row (but its spec); a field of the detail that
    comes from elsewhere must be read into it by hand (and named here)."""
    from_elsewhere = {
        "owner": "the owner's name",
        "spec": "never changes after submit",
        "min_nodes": "from the spec",
        "max_nodes": "from the spec",
        "step_time_s": "the ids of the two newest metrics",
        "last_snapshot_at": "the newest snapshot's time",
        "device": "the newest attempt's",
        "attempts": "the attempts' version",
        "nodes_now": "the alive and idle nodes, counted into the version of a waiting job",
    }
    columns = {c.key for c in Job.__table__.columns} - {"spec"}  # not in the version
    assert set(JobDetail.model_fields) - columns == set(from_elsewhere)
