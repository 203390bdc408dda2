"""Two controllers on one database: exactly one acts, and the other takes over."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.db import transaction
from service.leader import Leadership, LeaseLost, acquire, hold
from service.models import Attempt, AttemptMember, ControllerLease
from service.reconciler import PlaceJob, Reconciler
from service.settings import ControllerSettings
from service.states import AttemptState, MemberState
from tests.helpers import FakeClock
from tests.service.helpers import statements

LEASE_S = 10.0


def _controller(settings: ControllerSettings, name: str) -> ControllerSettings:
    return settings.model_copy(update={"controller_id": name, "leader_lease_s": LEASE_S})


@pytest.fixture
def factory(api: TestClient) -> sessionmaker[Session]:
    return api.app.state.session_factory  # type: ignore[attr-defined, no-any-return]


@pytest.fixture
def pair(
    factory: sessionmaker[Session], settings: ControllerSettings, clock: FakeClock
) -> Iterator[tuple[Reconciler, Reconciler]]:
    yield (
        Reconciler(factory, _controller(settings, "ctl-a"), clock),
        Reconciler(factory, _controller(settings, "ctl-b"), clock),
    )


def _register(api: TestClient, *names: str) -> None:
    for name in names:
        body = {"name": name, "address": "127.0.0.1", "slots": 1, "pid": 1}
        assert api.post("/api/v1/nodes/register", json=body).status_code == 200


def _submit(api: TestClient, nnodes: str = "1") -> int:
    spec = {"name": "j", "task": {"name": "regression"}, "nnodes": nnodes}
    job_id: int = api.post("/api/v1/jobs", json=spec).json()["id"]
    return job_id


def _attempts(api: TestClient, job_id: int) -> list[dict[str, object]]:
    items: list[dict[str, object]] = api.get(f"/api/v1/jobs/{job_id}").json()["attempts"]
    return items


def test_only_the_lease_holder_acts(
    api: TestClient, pair: tuple[Reconciler, Reconciler], clock: FakeClock
) -> None:
    a, b = pair
    _register(api, "n1")
    job_id = _submit(api)
    assert [type(x) for x in b.run_once()] == [PlaceJob]  # the first to ask leads
    for _ in range(3):
        assert a.run_once() == [] and not a.is_leader  # the other stands by while it renews
        clock.advance(LEASE_S / 2)
        b.run_once()
        assert b.is_leader
    assert len(_attempts(api, job_id)) == 1


def _lease_expiry(factory: sessionmaker[Session]) -> datetime:
    with transaction(factory) as session:
        return session.scalars(select(ControllerLease.expires_at)).one()


def test_a_leader_renews_its_lease_once_a_quarter_of_it_has_passed(
    api: TestClient,
    factory: sessionmaker[Session],
    settings: ControllerSettings,
    pair: tuple[Reconciler, Reconciler],
    clock: FakeClock,
) -> None:
    """Passes while the lease is young send nothing for it; the one after a quarter of the
    lease renews it. Meanwhile a standby still stands by and the leader still places."""
    a, b = pair
    _register(api, "n1", "n2")
    a.run_once()
    taken = _lease_expiry(factory)
    clock.advance(LEASE_S * 0.2)
    job_id = _submit(api)
    with statements(factory.kw["bind"]) as sent:
        assert [type(x) for x in a.run_once()] == [PlaceJob]  # its apply still holds the lease
    read = [s for s in sent if "controller_leases" in s]
    assert len(read) == 1 and read[0].startswith("SELECT"), read  # the apply's hold only
    assert _lease_expiry(factory) == taken and a.lease_age_s == LEASE_S * 0.2
    assert b.run_once() == [] and not b.is_leader
    clock.advance(LEASE_S * 0.1)  # a third of the lease old
    a.run_once()
    assert _lease_expiry(factory) > taken and a.lease_age_s == 0.0
    assert len(_attempts(api, job_id)) == 1
    # A clock stepped back: the lease is renewed from it at once, not kept unrenewed for
    # the step and a quarter of the lease (a standby would wait that much longer).
    renewed = _lease_expiry(factory)
    clock.advance(-5.0)
    a.run_once()
    assert _lease_expiry(factory) < renewed and a.lease_age_s == 0.0


def test_a_standby_takes_over_once_the_leader_stops_renewing(
    api: TestClient, pair: tuple[Reconciler, Reconciler], clock: FakeClock
) -> None:
    a, b = pair
    _register(api, "n1")
    a.run_once()
    assert a.is_leader
    clock.advance(LEASE_S - 1)
    assert b.run_once() == [] and not b.is_leader  # not yet expired
    job_id = _submit(api)
    clock.advance(2)  # a died: its lease runs out
    actions = b.run_once()
    assert b.is_leader
    assert [type(x) for x in actions] == [PlaceJob]
    assert len(_attempts(api, job_id)) == 1
    assert api.get("/healthz").json()["leader"] == "ctl-b"


def test_a_stopped_leader_hands_the_lease_over_at_once(
    api: TestClient, pair: tuple[Reconciler, Reconciler]
) -> None:
    a, b = pair
    a.run_once()
    a.stop()
    b.run_once()
    assert b.is_leader


def test_a_leader_that_stalled_past_its_lease_cannot_commit(
    factory: sessionmaker[Session], clock: FakeClock
) -> None:
    with transaction(factory) as session:
        stale = acquire(session, "ctl-a", clock(), LEASE_S)
    assert stale is not None
    clock.advance(LEASE_S + 1)
    with transaction(factory) as session:
        fresh = acquire(session, "ctl-b", clock(), LEASE_S)
    assert fresh is not None and fresh.term == stale.term + 1
    with pytest.raises(LeaseLost, match="passed to ctl-b"), transaction(factory) as session:
        hold(session, stale, clock())
    with transaction(factory) as session:
        hold(session, fresh, clock())  # the new holder may act


def test_an_expired_lease_fences_even_its_holder(
    factory: sessionmaker[Session], clock: FakeClock
) -> None:
    with transaction(factory) as session:
        mine = acquire(session, "ctl-a", clock(), LEASE_S)
    assert isinstance(mine, Leadership)
    clock.advance(LEASE_S)
    with pytest.raises(LeaseLost, match="expired"), transaction(factory) as session:
        hold(session, mine, clock())


def test_racing_takeovers_elect_exactly_one(
    factory: sessionmaker[Session], clock: FakeClock
) -> None:
    """Eight controllers try to take a free lease at the same moment: one wins."""
    barrier = threading.Barrier(8)
    won: list[str] = []

    def contend(name: str) -> None:
        barrier.wait()
        with transaction(factory) as session:
            if acquire(session, name, clock(), LEASE_S) is not None:
                won.append(name)

    threads = [threading.Thread(target=contend, args=(f"ctl-{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1


def test_racing_reconciler_passes_never_place_a_job_twice(
    api: TestClient,
    factory: sessionmaker[Session],
    settings: ControllerSettings,
    clock: FakeClock,
) -> None:
    """Two passes of the same leader (two threads) race over six jobs and four nodes."""
    _register(api, "n1", "n2", "n3", "n4")
    jobs = [_submit(api, nnodes="1:2") for _ in range(6)]
    shared = _controller(settings, "ctl-a")  # both passes hold the same lease
    passes = [Reconciler(factory, shared, clock) for _ in range(2)]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(r: Reconciler) -> None:
        barrier.wait()
        for _ in range(5):
            try:
                r.run_once()
            except Exception as exc:
                errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in passes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with transaction(factory) as session:
        running = session.scalars(
            select(Attempt).where(Attempt.state == AttemptState.RUNNING)
        ).all()
        members = session.scalars(
            select(AttemptMember.node_id)
            .join(Attempt, Attempt.id == AttemptMember.attempt_id)
            .where(Attempt.state == AttemptState.RUNNING, AttemptMember.state == MemberState.ACTIVE)
        ).all()
    per_job = [a.job_id for a in running]
    assert len(per_job) == len(set(per_job)), f"a job placed twice: {per_job}"
    assert len(members) == len(set(members)), f"a node in two attempts: {members}"
    assert set(per_job) <= set(jobs)
    assert len(members) == 4, "every node should be used once"
    assert errors == []


def test_a_leader_whose_pass_outlasts_its_lease_keeps_it(
    api: TestClient, factory: sessionmaker[Session], settings: ControllerSettings, clock: FakeClock
) -> None:
    """Each placement takes 3 s of a 10 s lease: the pass extends the lease as it goes,
    so it places all five jobs instead of losing the lease at the fourth."""
    _register(api, *(f"n{i}" for i in range(5)))
    jobs = [_submit(api) for _ in range(5)]

    def slow_clock() -> datetime:
        clock.advance(3)
        return clock()

    leader = Reconciler(factory, _controller(settings, "ctl-a"), slow_clock)
    assert [type(x) for x in leader.run_once()] == [PlaceJob] * 5
    assert leader.is_leader
    assert all(len(_attempts(api, job_id)) == 1 for job_id in jobs)
    assert api.get("/healthz").json()["leader"] == "ctl-a"
