"""The one compare-and-set of a lifecycle state: through its table, on the state it was read in."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.fernet import Fernet
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from contract.protocol import Heartbeat, NodeRegister
from service.auth import issue_node_token
from service.db import make_engine, make_session_factory, transaction, upgrade_to_head
from service.errors import StaleState
from service.models import Job, Node
from service.nodes import leave, mark_lost, record_heartbeat, register_node
from service.secrets import Keyring
from service.settings import ControllerSettings
from service.states import AttemptState, InvalidTransition, JobState, NodeState
from service.transitions import transition, write
from tests.service.helpers import statements

T0 = datetime(2026, 1, 1, tzinfo=UTC)
KEYRING = Keyring((Fernet.generate_key(),), "a test key")


@pytest.fixture
def factory(db_url: str) -> Iterator[sessionmaker[Session]]:
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    yield make_session_factory(engine)
    engine.dispose()


def _add(factory: sessionmaker[Session], row: Job | Node) -> int:
    with transaction(factory) as session:
        session.add(row)
        session.flush()
        return row.id


def _node(factory: sessionmaker[Session], state: NodeState = NodeState.ALIVE) -> int:
    row = Node(
        name="n1",
        address="127.0.0.1",
        slots=1,
        pid=1,
        state=state,
        registered_at=T0,
        last_heartbeat_at=T0,
    )
    return _add(factory, row)


def _job(factory: sessionmaker[Session], state: JobState = JobState.PENDING) -> int:
    row = Job(
        name="j",
        spec={"name": "j", "task": {"name": "regression"}},
        state=state,
        created_at=T0,
        updated_at=T0,
        attempt_count=0,
        restart_count=0,
        membership_changes=0,
        message="",
    )
    return _add(factory, row)


def _read_job(factory: sessionmaker[Session], job_id: int) -> Job:
    with transaction(factory) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def test_an_allowed_change_is_written_with_its_values(factory: sessionmaker[Session]) -> None:
    job_id = _job(factory)
    later = T0 + timedelta(seconds=5)
    with transaction(factory) as session:
        job = session.get(Job, job_id)
        assert job is not None
        assert transition(session, job, JobState.RUNNING, started_at=later, message="placed")
        assert (job.state, job.started_at, job.message) == (JobState.RUNNING, later, "placed")
        assert not session.is_modified(job)  # written once, by the compare-and-set
    stored = _read_job(factory, job_id)
    assert (stored.state, stored.started_at, stored.message) == (JobState.RUNNING, later, "placed")


def test_a_change_not_in_the_table_raises_and_writes_nothing(
    factory: sessionmaker[Session],
) -> None:
    job_id = _job(factory, JobState.SUCCEEDED)
    node_id = _node(factory)
    with transaction(factory) as session:
        job = session.get(Job, job_id)
        node = session.get(Node, node_id)
        assert job is not None and node is not None
        with pytest.raises(InvalidTransition, match="JobState cannot go from SUCCEEDED to RUNNING"):
            transition(session, job, JobState.RUNNING, message="again")
        with pytest.raises(InvalidTransition, match="NodeState cannot go from ALIVE to ALIVE"):
            transition(session, node, NodeState.ALIVE)
        assert (job.state, job.message) == (JobState.SUCCEEDED, "")
    stored = _read_job(factory, job_id)
    assert (stored.state, stored.message) == (JobState.SUCCEEDED, "")


def test_a_state_of_another_lifecycle_is_refused(factory: sessionmaker[Session]) -> None:
    job_id = _job(factory, JobState.RUNNING)
    with transaction(factory) as session:
        job = session.get(Job, job_id)
        assert job is not None
        # AttemptState.SUCCEEDED equals "SUCCEEDED", as JobState.SUCCEEDED does.
        with pytest.raises(TypeError, match="Job has a JobState"):
            transition(session, job, AttemptState.SUCCEEDED)
    assert _read_job(factory, job_id).state is JobState.RUNNING


def test_a_stale_state_loses_the_race_and_changes_nothing(
    factory: sessionmaker[Session],
) -> None:
    job_id = _job(factory)
    stale = _read_job(factory, job_id)  # read as PENDING
    with transaction(factory) as session:  # another writer moves it first
        job = session.get(Job, job_id)
        assert job is not None
        assert transition(session, job, JobState.RUNNING)
    with transaction(factory) as session:
        session.add(stale)
        assert not transition(session, stale, JobState.CANCELLED, message="stale writer")
        assert (stale.state, stale.message) == (JobState.PENDING, "")
    stored = _read_job(factory, job_id)
    assert (stored.state, stored.message) == (JobState.RUNNING, "")


def test_an_extra_condition_that_fails_loses_the_race(factory: sessionmaker[Session]) -> None:
    node_id = _node(factory)
    with transaction(factory) as session:
        node = session.get(Node, node_id)
        assert node is not None
        assert not transition(
            session, node, NodeState.LOST, also_where=[Node.last_heartbeat_at < T0]
        )
        assert node.state is NodeState.ALIVE
        assert transition(session, node, NodeState.LOST, also_where=[Node.last_heartbeat_at <= T0])
        assert node.state is NodeState.LOST
    with transaction(factory) as session:
        stored = session.get(Node, node_id)
        assert stored is not None and stored.state is NodeState.LOST


def _read_node(factory: sessionmaker[Session], node_id: int) -> Node:
    with transaction(factory) as session:
        node = session.get(Node, node_id)
        assert node is not None
        return node


def test_a_node_changes_state_only_along_its_lifecycle(
    factory: sessionmaker[Session], settings: ControllerSettings
) -> None:
    node_id = _node(factory, NodeState.LOST)
    t1, t2, t3 = (T0 + timedelta(seconds=s) for s in (1, 2, 3))
    with transaction(factory) as session:  # a heartbeat brings a LOST node back
        record_heartbeat(session, node_id, Heartbeat(), t1)
    node = _read_node(factory, node_id)
    assert (node.state, node.last_heartbeat_at) == (NodeState.ALIVE, t1)
    with transaction(factory) as session:  # a heartbeat of an ALIVE node keeps it ALIVE
        record_heartbeat(session, node_id, Heartbeat(), t2)
    node = _read_node(factory, node_id)
    assert (node.state, node.last_heartbeat_at) == (NodeState.ALIVE, t2)
    with transaction(factory) as session:  # heard from at t2: not lost for silence before t1
        assert not mark_lost(session, node_id, seen_before=t1, now=t3)
    with transaction(factory) as session:
        assert leave(session, node_id, "stopping", t3)
        assert not leave(session, node_id, "stopping", t3)  # LEFT already
        assert not mark_lost(session, node_id, seen_before=t3, now=t3)  # left, not silent
    assert _read_node(factory, node_id).state is NodeState.LEFT
    token: str | None = None
    for _ in range(2):  # registering brings it back, and (with its token) keeps it ALIVE
        again = NodeRegister(name="n1", address="10.0.0.2", slots=2, pid=2, node_token=token)
        with transaction(factory) as session:
            registered = register_node(session, again, t3)
            assert registered.id == node_id
            token = issue_node_token(session, registered)
        node = _read_node(factory, node_id)
        assert (node.state, node.address, node.slots) == (NodeState.ALIVE, "10.0.0.2", 2)


def _engine(session: Session) -> Engine:
    engine = session.get_bind()
    assert isinstance(engine, Engine)
    return engine


def test_a_write_sends_only_what_changed_in_one_update(factory: sessionmaker[Session]) -> None:
    job_id = _job(factory, JobState.RUNNING)
    with transaction(factory) as session:
        job = session.get(Job, job_id)
        assert job is not None
        with statements(_engine(session)) as sent:
            write(session, job, last_step=7, last_loss=0.5, message="")  # message: unchanged
            write(session, job, last_step=7)  # nothing changed: nothing sent
        assert len(sent) == 1, sent
        assert sent[0].startswith("UPDATE jobs SET last_step="), sent
        assert "message" not in sent[0], sent
        assert (job.last_step, job.last_loss) == (7, 0.5)
        assert not session.is_modified(job)  # written once, not again at the flush
    stored = _read_job(factory, job_id)
    assert (stored.last_step, stored.last_loss, stored.state) == (7, 0.5, JobState.RUNNING)


def test_a_write_does_not_change_a_state(factory: sessionmaker[Session]) -> None:
    job_id = _job(factory, JobState.RUNNING)
    with transaction(factory) as session:
        job = session.get(Job, job_id)
        assert job is not None
        with pytest.raises(ValueError, match="by transition"):
            write(session, job, state=JobState.SUCCEEDED)
    assert _read_job(factory, job_id).state is JobState.RUNNING


def test_transitions_of_one_shape_each_check_their_own_row(
    factory: sessionmaker[Session],
) -> None:
    """A compare-and-set's statement is built once for its table and columns; each use
    still names its own row and the state that row was read in."""
    first, second, third = _job(factory), _job(factory), _job(factory)
    with transaction(factory) as session:
        rows = [session.get(Job, job_id) for job_id in (first, second, third)]
        a, b, c = rows
        assert a is not None and b is not None and c is not None
        assert transition(session, a, JobState.CANCELLED, message="one")
        assert transition(session, b, JobState.CANCELLED, message="two")
        session.execute(Job.__table__.update().where(Job.id == third).values(state="RUNNING"))
        assert not transition(session, c, JobState.CANCELLED, message="three")
    stored = [_read_job(factory, job_id) for job_id in (first, second, third)]
    assert [(j.state, j.message) for j in stored] == [
        (JobState.CANCELLED, "one"),
        (JobState.CANCELLED, "two"),
        (JobState.RUNNING, ""),
    ]


def test_a_write_to_a_row_that_is_gone_raises(factory: sessionmaker[Session]) -> None:
    job_id = _job(factory)
    with transaction(factory) as session:
        job = session.get(Job, job_id)
        assert job is not None
        session.execute(Job.__table__.delete().where(Job.id == job_id))
        with pytest.raises(StaleState, match="is gone"):
            write(session, job, last_step=1)
