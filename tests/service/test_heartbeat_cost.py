"""A heartbeat costs the database one statement (PostgreSQL) or two (SQLite), and its
answer is rendered once per change."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select, text

from contract.protocol import Heartbeat
from service import heartbeats
from service.api.app import create_app
from service.attempts import Membership
from service.models import Node, Role
from service.reconciler import Reconciler
from service.settings import ControllerSettings
from tests.helpers import FakeClock
from tests.service.helpers import (
    Cluster,
    commits,
    engines_of,
    heartbeat,
    register,
    statements,
    submit,
)


def running(api: Cluster, node_id: int, attempt_ids: list[int]) -> list[dict[str, Any]]:
    """A heartbeat of a node that runs ``attempt_ids``; its assignments."""
    body = {"running": [{"attempt_id": a, "processes": 1} for a in attempt_ids]}
    r = api.post(f"/api/v1/nodes/{node_id}/heartbeat", json=body)
    assert r.status_code == 200, r.text
    assignments: list[dict[str, Any]] = r.json()["assignments"]
    return assignments


def engine_of(api: Cluster) -> Engine:
    engine: Engine = api.app.state.session_factory.kw["bind"]  # type: ignore[attr-defined]
    return engine


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_heartbeat_of_a_node_at_work_is_one_update_and_one_select(
    api: Cluster, reconciler: Reconciler, jobs: int
) -> None:
    """However many attempts the node serves (on "cuda", one per GPU here)."""
    gpus = [{"index": i, "name": "gpu"} for i in range(3)]
    node_id = register(api, "a", gpus=gpus)
    for _ in range(jobs):
        submit(api, "1", device="cuda")
    reconciler.run_once()
    attempts = [a["attempt_id"] for a in heartbeat(api, node_id)]
    assert len(attempts) == jobs

    with statements(*engines_of(api.app)) as sent, commits(*engines_of(api.app)) as committed:
        assert [a["attempt_id"] for a in running(api, node_id, attempts)] == attempts
    work = [s.split()[0] for s in sent if not s.startswith("BEGIN")]  # SQLite's, sent as SQL
    if engine_of(api).dialect.name == "postgresql":  # an UPDATE in a WITH, committed alone
        assert work == ["WITH"] and sent[0].split()[3] == "(UPDATE", sent
        assert committed == []
    else:
        assert work == ["UPDATE", "SELECT"], sent
        assert len(committed) == 1


def test_an_answer_that_starts_an_attempt_holds_the_node_s_row_until_its_tokens_are_written(
    api: Cluster, reconciler: Reconciler
) -> None:
    """On PostgreSQL the one statement finds an assignment the node does not run, and the
    heartbeat is recorded again in a transaction that locks the node's row before the
    worker token is written: of two overlapping heartbeats the later one's token stays.
    That transaction is the main pool's, whose commits wait for the disk."""
    node_id = register(api, "a")
    submit(api, "1")
    reconciler.run_once()
    main = engine_of(api)
    with (
        statements(*engines_of(api.app)) as sent,
        statements(main) as on_main,
        commits(main) as committed,
    ):
        [assignment] = heartbeat(api, node_id)
    assert assignment["worker_token"]
    # Not SQLite's BEGIN, sent as SQL, nor the count of ALIVE nodes for the pace.
    work = [s for s in sent if not s.startswith(("BEGIN", "SELECT count(*)"))]
    if main.dialect.name == "postgresql":
        assert work[0].startswith("WITH"), sent
        work = work[1:]
    assert [s for s in on_main if not s.startswith(("BEGIN", "SELECT count(*)"))] == work
    recorded = work[0].startswith("UPDATE nodes")
    token_written = any(s.startswith("UPDATE attempt_members") for s in work[1:])
    assert recorded and token_written, sent
    assert len(committed) == 1  # the record and the token, together


@contextmanager
def _placed(
    settings: ControllerSettings, clock: FakeClock
) -> Iterator[tuple[Cluster, int, dict[str, Any]]]:
    """An app of ``settings`` with one node, given one job's assignment by its first
    heartbeat: its client, the node's id, the assignment."""
    app = create_app(settings, clock=clock, run_background=False)
    with Cluster(app) as api:
        api.node_tokens, api.name_tokens = {}, {}
        api.user_token = api.add_user("root", Role.ADMIN)
        reconciler = Reconciler(app.state.session_factory, settings, clock)
        node_id = register(api, "a")
        submit(api, "1")
        reconciler.run_once()
        [assignment] = heartbeat(api, node_id)
        yield api, node_id, assignment


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_on_postgresql_a_heartbeat_can_still_be_a_transaction_of_two(
    settings: ControllerSettings, clock: FakeClock
) -> None:
    """``heartbeat_one_statement`` off: as on SQLite; what it answers is the same."""
    with _placed(settings.model_copy(update={"heartbeat_one_statement": False}), clock) as (
        api,
        node_id,
        assignment,
    ):
        assert assignment["worker_token"]
        with statements(*engines_of(api.app)) as sent, commits(*engines_of(api.app)) as committed:
            [again] = running(api, node_id, [assignment["attempt_id"]])
        assert again == {**assignment, "worker_token": None}
        assert [s.split()[0] for s in sent] == ["UPDATE", "SELECT"]
        assert len(committed) == 1


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("synchronous", [False, True])
def test_on_postgresql_a_heartbeat_s_commit_waits_for_the_disk_only_if_asked(
    settings: ControllerSettings, clock: FakeClock, synchronous: bool
) -> None:
    """By default the one statement runs on a pool of its own whose commits do not wait
    for the server's flush; every other write's still do. What it answers is the same."""
    settings = settings.model_copy(update={"heartbeat_synchronous_commit": synchronous})
    with _placed(settings, clock) as (api, node_id, assignment):
        main = engine_of(api)
        beating = api.app.state.heartbeat_one_statement.engine
        assert (beating.pool is main.pool) == synchronous
        with statements(main) as on_main, statements(beating) as on_beating:
            [again] = running(api, node_id, [assignment["attempt_id"]])
        assert again == {**assignment, "worker_token": None}
        assert [s.split()[0] for s in on_beating] == ["WITH"], on_beating
        if not synchronous:
            assert on_main == []

        def flushing(engine: Engine) -> tuple[str, str]:
            """The setting of a connection of ``engine``, and the server's for a session."""
            with engine.connect() as conn:
                shown = conn.exec_driver_sql("SHOW synchronous_commit").scalar_one()
                default = conn.exec_driver_sql(
                    "SELECT reset_val FROM pg_settings WHERE name = 'synchronous_commit'"
                ).scalar_one()
            return shown, default

        shown, default = flushing(main)
        assert shown == default  # every other write waits as the server says
        shown, default = flushing(beating)
        assert shown == (default if synchronous else "off")


def test_an_answer_is_rendered_once_until_the_attempt_changes(
    api: Cluster, reconciler: Reconciler, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rendered again when a member is lost: the membership generation it carries moved,
    though this controller's heartbeat route did nothing to the attempt."""
    rendered: list[int] = []
    render = heartbeats.assignment_for

    def counted(*args: Any, **kwargs: Any) -> Any:
        rendered.append(args[0].attempt_id)
        return render(*args, **kwargs)

    monkeypatch.setattr(heartbeats, "assignment_for", counted)
    a, b, _silent = (register(api, name) for name in "abc")
    submit(api, "2:3")
    reconciler.run_once()
    [first] = heartbeat(api, a)
    for _ in range(3):
        [again] = running(api, a, [first["attempt_id"]])
        assert again == {**first, "worker_token": None}
    heartbeat(api, b)
    assert rendered == [first["attempt_id"]] * 2  # a's once, b's once
    answers: heartbeats.Answers = api.app.state.heartbeat_answers
    assert len(answers) == 2

    clock.advance(11)  # c falls silent past the node timeout
    heartbeat(api, a)
    heartbeat(api, b)
    reconciler.run_once()
    [told] = running(api, a, [first["attempt_id"]])
    assert (told["membership_generation"], told["active_members"]) == (1, 2)
    assert rendered == [first["attempt_id"]] * 3
    assert running(api, a, [first["attempt_id"]]) == [told]
    assert rendered == [first["attempt_id"]] * 3
    # a's first assignment, which it holds no more, was let go with a's next heartbeat.
    assert [m.generation for m in answers.of(a)] == [1]
    assert len(answers) == 2
    api.post(f"/api/v1/jobs/{first['job_id']}/cancel")
    reconciler.run_once()
    assert running(api, a, []) == [] and len(answers) == 1  # b's, until b is heard from


def test_a_lost_node_heartbeating_again_is_alive_and_told_nothing_it_lost(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    """The long way: the short UPDATE matches only an ALIVE node."""
    a = register(api, "a")
    submit(api, "1")
    reconciler.run_once()
    [assignment] = heartbeat(api, a)
    clock.advance(11)
    reconciler.run_once()
    nodes = {n["id"]: n["state"] for n in api.get("/api/v1/nodes").json()["items"]}
    assert nodes[a] == "LOST"
    assert running(api, a, [assignment["attempt_id"]]) == []
    nodes = {n["id"]: n["state"] for n in api.get("/api/v1/nodes").json()["items"]}
    assert nodes[a] == "ALIVE"


def test_a_shed_heartbeat_keeps_only_its_own_alive_node_heard_from(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    """What ``Liveness`` writes: the time a shed heartbeat came, for an ALIVE node whose
    token it carried; never a LOST node's, never another node's token, never backwards."""
    a, b, lost = register(api, "a"), register(api, "b"), register(api, "lost")
    reconciler.run_once()
    clock.advance(11)
    heartbeat(api, a)
    heartbeat(api, b)
    reconciler.run_once()
    states = {n["id"]: n["state"] for n in api.get("/api/v1/nodes").json()["items"]}
    assert states == {a: "ALIVE", b: "ALIVE", lost: "LOST"}
    before = last_heard(api)
    liveness = heartbeats.Liveness()
    later = clock.now + timedelta(seconds=3)
    liveness.note(a, api.node_tokens[a], later)
    liveness.note(b, api.node_tokens[a], later)  # a's token on b's heartbeat
    liveness.note(lost, api.node_tokens[lost], later)
    liveness.note(b, "rlu_not-a-node-token", later)  # not noted: a user token
    assert liveness.flush(api.app.state.session_factory) == 3  # type: ignore[attr-defined]
    assert last_heard(api) == before | {a: later}
    # A made-up token on a's shed heartbeat does not replace a's own note.
    liveness.note(a, api.node_tokens[a], later + timedelta(seconds=1))
    liveness.note(a, "rln_made-up", later + timedelta(seconds=2))
    liveness.flush(api.app.state.session_factory)  # type: ignore[attr-defined]
    later += timedelta(seconds=1)
    assert last_heard(api)[a] == later
    liveness.note(a, api.node_tokens[a], clock.now)  # older than what is stored
    liveness.flush(api.app.state.session_factory)  # type: ignore[attr-defined]
    assert last_heard(api)[a] == later
    assert liveness.flush(api.app.state.session_factory) == 0  # type: ignore[attr-defined]


def last_heard(api: Cluster) -> dict[int, datetime]:
    with api.app.state.session_factory() as session:  # type: ignore[attr-defined]
        return dict(session.execute(select(Node.id, Node.last_heartbeat_at)).all())  # type: ignore[arg-type]


def test_liveness_keeps_few_notes_a_node_and_a_failed_write_for_the_next(
    api: Cluster, monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """Made-up tokens for one node fill only that node's few places, and a write that
    fails keeps its notes for the next flush instead of losing them."""
    a = register(api, "a")
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    liveness = heartbeats.Liveness()
    for n in range(10):
        liveness.note(a, f"rln_made-up-{n}", clock.now)
    liveness.note(a, api.node_tokens[a], clock.now)  # too late: a's places are taken
    assert liveness.flush(factory) == heartbeats.Liveness.PER_NODE

    later = clock.now + timedelta(seconds=3)
    liveness.note(a, api.node_tokens[a], later)
    monkeypatch.setattr(heartbeats, "_SEEN", text("UPDATE no_such_table SET x = :seen_at"))
    assert liveness.flush(factory) == 0  # failed, logged, kept
    monkeypatch.undo()
    assert liveness.flush(factory) == 1
    assert last_heard(api)[a] == later


def _membership(member_id: int) -> Membership:
    return Membership(
        member_id=member_id,
        attempt_id=member_id,
        job_id=member_id,
        attempt_number=1,
        rdzv_id=f"r{member_id}",
        device=None,
        gpus=(),
        restart_count=0,
        generation=0,
        active_members=1,
        memberships=1,
    )


def test_what_is_kept_for_a_node_is_what_it_was_last_answered() -> None:
    answers = heartbeats.Answers(size=2)
    first, second, third = (_membership(i) for i in (1, 2, 3))
    made = heartbeats.Rendered(None, b"{}")  # type: ignore[arg-type]
    assert answers.of(10) == {}
    answers.keep(10, {first: made, second: made})
    answers.keep(20, {third: made})
    assert set(answers.of(10)) == {first, second} and len(answers) == 3
    answers.keep(10, {second: made})  # first ended: let go
    assert set(answers.of(10)) == {second} and len(answers) == 2
    answers.keep(30, {})  # the third node pushes out the one answered least recently
    assert answers.of(20) == {} and set(answers.of(10)) == {second} and len(answers) == 1


def test_a_node_not_answered_for_a_while_has_its_answers_dropped() -> None:
    """A node lost, gone or now heard by another API process does not keep its
    assignments (decrypted env values among them) until many other nodes push them out."""
    now = [0.0]
    answers = heartbeats.Answers(size=100, kept_s=300.0, clock=lambda: now[0])
    made = heartbeats.Rendered(None, b"{}")  # type: ignore[arg-type]
    gone, stays = _membership(1), _membership(2)
    answers.keep(10, {gone: made})
    answers.keep(20, {stays: made})
    now[0] = 200.0
    answers.keep(20, {stays: made})  # node 20 is still heard from; node 10 is not
    now[0] = 301.0
    answers.keep(30, {})
    assert answers.of(10) == {} and set(answers.of(20)) == {stays} and len(answers) == 1


def test_what_was_rendered_is_kept_even_when_another_assignment_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One membership whose assignment cannot be made does not cost the node's others a
    rendering again at every heartbeat."""
    fine, broken = _membership(1), _membership(2)

    class Made:
        def model_dump_json(self) -> str:
            return "{}"

    def assignment_for(held: Membership, *args: Any) -> Made:
        if held == broken:
            raise ValueError("cannot be rendered")
        return Made()

    class Session:
        def execute(self, stmt: Any) -> list[tuple[int, dict[str, Any]]]:
            return [(fine.job_id, {}), (broken.job_id, {})]

    monkeypatch.setattr(heartbeats, "assignment_for", assignment_for)
    monkeypatch.setattr(heartbeats, "parse_stored_spec", lambda stored: None)
    answers = heartbeats.Answers()
    body = Heartbeat(running=[{"attempt_id": m.attempt_id} for m in (fine, broken)])
    with pytest.raises(ValueError, match="cannot be rendered"):
        heartbeats.reply(
            7, [(fine, False), (broken, False)], body, None, None, answers, 1.0, Session
        )  # type: ignore[arg-type]
    assert set(answers.of(7)) == {fine}
