"""A node's heartbeat: recorded with one UPDATE, answered from one SELECT.

A heartbeat comes from every node every few seconds, so its cost is the fleet's
times the rate. An ALIVE node's heartbeat, with its own token, is one UPDATE that
checks the token, records the time and the GPUs' use and returns nothing but the
id (``record``); anything else (an unknown token, a LOST or LEFT node coming back)
takes the slow way, ``service.nodes.record_heartbeat`` after the usual checks.

The answer lists the node's assignments (``answer``). One SELECT reads, for each of
the node's ACTIVE memberships of RUNNING attempts, every stored value that its
assignment depends on (``Membership``); the job's spec never changes after submit.
A membership of an attempt that SUCCEEDED less than ``FINISHING_GRACE_S`` ago stays
in the answer while the node still runs it: the job succeeds with its first node's
success, and another node's launcher may still be on its way out (past torch's exit
barrier, in its interpreter's teardown). Dropped from the answer, its agent would stop
it, and its own success would read "stopped".
An assignment is rendered (spec parsed, task arguments rendered, env decrypted) once
per distinct ``Membership`` and kept in ``Answers``, by node, until the node holds it no
more: a later heartbeat that reads the same values gets the same assignment without
rendering it again. The key is what
this heartbeat's own transaction read, never what this controller did, so
controllers that share a database stay right: a change that another one makes
(a member lost, a restart) changes the values read, hence the key.

The answer also tells the node when to send the next heartbeat (``Pace``): the
base interval while the fleet is small, longer once the ALIVE nodes at that
interval would send more than ``heartbeats_per_s_max`` a second. The interval
told is kept on the node's row, and the reconciler gives the node that much
more silence before it is lost (``service.reconciler.NodeView.extra_silence``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, ScalarSelect, and_, bindparam, func, or_, select, true, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, aliased, sessionmaker

from contract.protocol import Assignment, Heartbeat
from service import auth
from service.attempts import Membership, assignment_for
from service.fence import issue_worker_token
from service.models import Attempt, AttemptMember, Job, Node, parse_stored_spec
from service.secrets import Keyring
from service.settings import ControllerSettings
from service.states import AttemptState, MemberState, NodeState

logger = logging.getLogger(__name__)

# Nodes whose rendered assignments are kept per API process: more than a fleet's nodes.
NODES_KEPT = 20_000
# How long a count of the ALIVE nodes sets the pace before it is read again.
PACE_RECOUNT_S = 5.0
# The longest interval a node is told, however large the fleet: what it is told
# (a new assignment, a stop) never waits longer than this, but for the first heartbeat
# after its interval lengthened (``worker.agent.paced_wait``: up to the two together).
HEARTBEAT_INTERVAL_MAX_S = 60.0
# How long after its attempt SUCCEEDED a node that still runs its part is left to end
# by itself before its agent is told to stop it (it holds its room until it reports).
FINISHING_GRACE_S = 30.0


def paced_interval(alive_nodes: int, base_s: float, per_s_max: float) -> float:
    """The interval to tell a node: ``base_s``, or longer so that ``alive_nodes`` nodes
    send at most ``per_s_max`` heartbeats a second together; a longer one is rounded up
    to a tenth of a second, and at most ``HEARTBEAT_INTERVAL_MAX_S``."""
    needed = alive_nodes / per_s_max
    if needed <= base_s:
        return base_s
    return min(math.ceil(round(needed * 10, 6)) / 10, max(base_s, HEARTBEAT_INTERVAL_MAX_S))


def allowed_silence(node_timeout_s: float, base_s: float, told_s: float | None) -> float:
    """How long a node told ``told_s`` (None: ``base_s``) may be silent before it is lost:
    ``node_timeout_s``, plus twice what ``told_s`` exceeds ``base_s``. A node may then miss
    one heartbeat at any pace (given ``node_timeout_s`` at least twice ``base_s``), as it
    may miss several at the base interval."""
    extra = 0.0 if told_s is None else max(0.0, told_s - base_s)
    return node_timeout_s + 2 * extra


class Pace:
    """The heartbeat interval this controller tells nodes (``paced_interval``), from a
    count of the ALIVE nodes (``count_alive``, a short read of its own) taken at most
    every ``PACE_RECOUNT_S``. No lock is held while it counts: the heartbeats that come
    meanwhile are told the last interval. Every controller sharing the database counts
    the same nodes. Safe to share between threads."""

    def __init__(
        self,
        settings: ControllerSettings,
        count_alive: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._base_s = settings.heartbeat_interval_s
        self._per_s_max = settings.heartbeats_per_s_max
        self._count_alive = count_alive
        self._clock = clock
        self._lock = threading.Lock()
        self._interval_s = self._base_s
        self._due_at: float | None = None  # when the next count is due; None: now

    def last(self) -> float:
        """The interval last told, without counting."""
        with self._lock:
            return self._interval_s

    def interval(self) -> float:
        with self._lock:
            now = self._clock()
            if self._due_at is not None and now < self._due_at:
                return self._interval_s
            self._due_at = now + PACE_RECOUNT_S  # this thread counts; the others need not
        try:
            alive = self._count_alive()
        except Exception:
            with self._lock:
                self._due_at = None  # counted by the next heartbeat
            raise
        told = paced_interval(alive, self._base_s, self._per_s_max)
        with self._lock:
            self._interval_s = told
        return told


def count_alive(factory: sessionmaker[Session]) -> int:
    """The ALIVE nodes, in a short read of its own."""
    with factory() as session:
        return session.scalar(_ALIVE_NODES) or 0


@dataclass(frozen=True)
class Rendered:
    """An assignment without a worker token, and its JSON."""

    assignment: Assignment
    json: bytes


class Liveness:
    """What an overloaded controller still records of the heartbeats it sheds
    (``service.api.lane``): that the node was heard from, and when. A shed heartbeat
    gets a 503 and no assignments, but a node whose heartbeats are all shed must not be
    lost for it: that would fence its attempts and restart them, more work for a
    controller that already has too much. ``note`` costs no database; ``flush`` (on a
    heartbeat's own thread, before its work) writes what was noted in one batch of
    UPDATEs that set only ``last_heartbeat_at``, for ALIVE nodes whose token matches,
    never backwards, in the order of the nodes' ids (as every writer of many node rows
    takes them). Notes are kept by node and token, so a shed heartbeat with a made-up
    token cannot replace the node's own; at most ``PER_NODE`` tokens a node and ``size``
    notes in all are kept until the next flush, later ones dropped. Safe to share between
    threads."""

    PER_NODE = 4

    def __init__(self, size: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._size = size
        self._noted: dict[tuple[int, str], datetime] = {}
        self._per_node: dict[int, int] = {}

    def note(self, node_id: int, token: str | None, now: datetime) -> None:
        if token is None or not token.startswith(auth.NODE_TOKEN_PREFIX):
            return  # not a node's token: what a flush would refuse anyway
        key = (node_id, auth.token_hash(token))
        with self._lock:
            full = len(self._noted) >= self._size or self._per_node.get(node_id, 0) >= (
                self.PER_NODE
            )
            if key in self._noted or not full:
                self._keep(key, now)

    def _keep(self, key: tuple[int, str], seen_at: datetime) -> None:
        """Note ``key`` as seen at ``seen_at``, or later if it already was; under the lock."""
        if key not in self._noted:
            self._per_node[key[0]] = self._per_node.get(key[0], 0) + 1
        self._noted[key] = max(seen_at, self._noted.get(key, seen_at))

    def flush(self, factory: sessionmaker[Session]) -> int:
        """Write what was noted; how many notes that was. A write that fails keeps them
        for the next flush (a later note of the same node and token wins) and is logged,
        not raised: the heartbeat that flushes still gets its own answer."""
        with self._lock:
            noted, self._noted, self._per_node = self._noted, {}, {}
        if not noted:
            return 0
        batch = [
            {"node_id": node_id, "node_token_hash": token_hash, "seen_at": seen_at}
            for (node_id, token_hash), seen_at in sorted(noted.items())
        ]
        try:
            with factory() as session, session.begin():
                session.connection().execute(_SEEN, batch)
        except SQLAlchemyError as exc:
            logger.warning("could not record %d shed heartbeats yet: %s", len(batch), exc)
            with self._lock:
                for key, seen_at in noted.items():
                    self._keep(key, seen_at)
            return 0
        return len(batch)


class Answers:
    """Rendered assignments by node, each by the ``Membership`` it was rendered from.

    What a node is answered replaces what was kept for it (``keep``): only what it holds
    now stays, so an attempt that ended, or a membership whose values moved, is let go
    with the node's next heartbeat rather than kept until it is the least recently used
    of many. What is kept is then about the fleet's running memberships: an API process
    whose fleet keeps its nodes does not grow, and its garbage collector (which scans once
    enough more objects are alive) has little reason to run. A node not answered for
    ``kept_s`` (five times the longest heartbeat interval: lost, gone, or heard by another
    API process) has its answers dropped, decrypted env values and all; so has the node
    answered least recently beyond ``size`` nodes. Safe to share between threads."""

    def __init__(
        self,
        size: int = NODES_KEPT,
        kept_s: float = 5 * HEARTBEAT_INTERVAL_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._size = size
        self._kept_s = kept_s
        self._clock = clock
        # By node, in the order they were answered: when, and what.
        self._kept: OrderedDict[int, tuple[float, dict[Membership, Rendered]]] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, node_id: int) -> dict[Membership, Rendered]:
        """What was last kept for node ``node_id`` (not to be changed)."""
        with self._lock:
            found = self._kept.get(node_id)
        return {} if found is None else found[1]

    def keep(self, node_id: int, rendered: dict[Membership, Rendered]) -> None:
        """Keep ``rendered`` as all that node ``node_id`` is answered, in place of what was."""
        now = self._clock()
        with self._lock:
            self._kept[node_id] = (now, rendered)
            self._kept.move_to_end(node_id)
            while len(self._kept) > self._size:
                self._kept.popitem(last=False)
            while self._kept:
                oldest = next(iter(self._kept.values()))
                if oldest[0] >= now - self._kept_s:
                    break
                self._kept.popitem(last=False)

    def __len__(self) -> int:
        """How many assignments are kept, all nodes together."""
        with self._lock:
            return sum(len(held) for _at, held in self._kept.values())


def record(
    session: Session, node_id: int, token: str, body: Heartbeat, now: datetime, interval_s: float
) -> bool:
    """Record the heartbeat of node ``node_id`` if it is ALIVE and ``token`` is its node
    token, with the ``interval_s`` its answer tells it, in one UPDATE; False (nothing
    written) otherwise."""
    params = _record_params(node_id, token, body, now, interval_s)
    if params is None:
        return False
    return session.execute(_RECORD, params).first() is not None


def _record_params(
    node_id: int, token: str, body: Heartbeat, now: datetime, interval_s: float
) -> dict[str, Any] | None:
    """The parameters of ``_RECORD``; None if ``token`` is no node token."""
    if not token.startswith(auth.NODE_TOKEN_PREFIX):
        return None
    return {
        "node_id": node_id,
        "node_token_hash": auth.token_hash(token),
        "seen_at": now,
        "usage": [u.model_dump() for u in body.gpus],
        "interval_s": interval_s,
    }


def answer(
    session: Session,
    node_id: int,
    body: Heartbeat,
    settings: ControllerSettings,
    keyring: Keyring,
    answers: Answers,
    interval_s: float,
    now: datetime,
) -> bytes:
    """The JSON of the ``HeartbeatReply`` to node ``node_id`` (``reply``), its memberships
    read in ``session``."""
    found = memberships(session, node_id, now)
    return reply(node_id, found, body, settings, keyring, answers, interval_s, lambda: session)


def reply(
    node_id: int,
    found: list[tuple[Membership, bool]],
    body: Heartbeat,
    settings: ControllerSettings,
    keyring: Keyring,
    answers: Answers,
    interval_s: float,
    session: Callable[[], Session],
) -> bytes:
    """The JSON of the ``HeartbeatReply`` to node ``node_id``: an assignment for each
    membership ``found`` (``memberships``), rendered or taken from what ``answers`` kept
    for the node (what it is answered now is kept in its place), and the ``interval_s`` to
    wait before the next heartbeat. An assignment the node does not run yet carries a new
    worker token (``service.fence``): the node starts it with the token of the reply it
    acts on, and one it runs keeps the token its workers hold. One of an attempt that
    SUCCEEDED within ``FINISHING_GRACE_S`` is listed only if the node runs it (it is
    never started again). ``session`` is called only to read a spec not yet rendered or
    to write a worker token: not for a node that runs all it holds, all rendered."""
    running = {r.attempt_id for r in body.running}
    held = [m for m, finishing in found if not finishing or m.attempt_id in running]
    kept = answers.of(node_id)
    rendered = {m: kept[m] for m in held if m in kept}
    missing = {m.job_id for m in held if m not in rendered}
    try:
        if missing:
            stmt = select(Job.id, Job.spec).where(Job.id.in_(missing))
            specs: dict[int, dict[str, Any]] = {
                job_id: spec for job_id, spec in session().execute(stmt)
            }
            for m in held:
                if m not in rendered:
                    stored = specs[m.job_id]
                    made = assignment_for(m, parse_stored_spec(stored), stored, settings, keyring)
                    rendered[m] = Rendered(made, made.model_dump_json().encode())
    finally:  # what was rendered is kept, even if one assignment could not be
        answers.keep(node_id, rendered)
    parts = []
    for m in held:
        if m.attempt_id in running:
            parts.append(rendered[m].json)
        else:
            token = issue_worker_token(session(), m.member_id)
            told = rendered[m].assignment.model_copy(update={"worker_token": token})
            parts.append(told.model_dump_json().encode())
    pace = f'],"heartbeat_interval_s":{interval_s!r}}}'.encode()
    return b'{"assignments":[' + b",".join(parts) + pace


def starts_something(found: list[tuple[Membership, bool]], body: Heartbeat) -> bool:
    """Whether the answer to ``body`` would carry an assignment the node does not run yet
    (``reply`` issues it a worker token), of the memberships ``found``."""
    running = {r.attempt_id for r in body.running}
    return any(not finishing and m.attempt_id not in running for m, finishing in found)


class OneStatement:
    """Records an ALIVE node's heartbeat and reads its memberships in one statement,
    committed by itself (PostgreSQL: an UPDATE in a WITH of the SELECT).

    ``record`` then ``memberships`` in a transaction cost five round trips to the
    server (BEGIN, UPDATE, SELECT, COMMIT, and a ping of the pooled connection if
    idle); this costs one. The SELECT reads the statement's snapshot, taken before the
    UPDATE waited for the node's row if it had to: a membership committed meanwhile comes
    with the next heartbeat. An answer that starts something (``starts_something``) is
    not made from it: the route records the heartbeat again the long way, in a
    transaction that holds the node's row until its worker tokens are written, so that
    of two heartbeats of one node that overlap (an agent's retry) the later one's tokens
    are the ones kept."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._engine = engine.execution_options(isolation_level="AUTOCOMMIT")

    @staticmethod
    def serves(engine: Engine) -> bool:
        """Whether the database takes an UPDATE in a WITH (SQLite does not)."""
        return engine.dialect.name == "postgresql"

    def __call__(
        self, node_id: int, token: str, body: Heartbeat, now: datetime, interval_s: float
    ) -> list[tuple[Membership, bool]] | None:
        """What ``memberships`` reads, once the heartbeat is recorded as ``record`` does;
        None if it was not (not an ALIVE node's heartbeat with its own token)."""
        params = _record_params(node_id, token, body, now, interval_s)
        if params is None:
            return None
        params["finishing_since"] = now - timedelta(seconds=FINISHING_GRACE_S)
        with self._engine.connect() as conn:
            rows = conn.execute(_BEAT, params).all()
        if not rows:
            return None
        return [_membership(row[1:]) for row in rows if row[1] is not None]


def memberships(session: Session, node_id: int, now: datetime) -> list[tuple[Membership, bool]]:
    """The node's ACTIVE memberships of RUNNING attempts as stored, and of attempts that
    SUCCEEDED within ``FINISHING_GRACE_S`` (True beside those), by id: one SELECT."""
    since = now - timedelta(seconds=FINISHING_GRACE_S)
    params = {"node_id": node_id, "finishing_since": since}
    return [_membership(row) for row in session.execute(_MEMBERSHIPS, params)]


def _membership(row: Sequence[Any]) -> tuple[Membership, bool]:
    """A row of ``_MEMBERSHIPS`` as ``memberships`` answers it."""
    (
        member_id,
        attempt_id,
        job_id,
        number,
        rdzv_id,
        device,
        gpus,
        restart_count,
        left,
        active,
        total,
        state,
    ) = row
    return (
        Membership(
            member_id=member_id,
            attempt_id=attempt_id,
            job_id=job_id,
            attempt_number=number,
            rdzv_id=rdzv_id,
            device=device,
            gpus=tuple(gpus or ()),
            restart_count=restart_count,
            # An attempt that has ended re-forms nothing: a member that left it since
            # moves no generation a node would act on (it acts only on a rise).
            generation=left if state is AttemptState.RUNNING else 0,
            active_members=active,
            memberships=total,
        ),
        state is not AttemptState.RUNNING,
    )


def _members_of_attempt(state: MemberState | None) -> ScalarSelect[int]:
    """The count of the memberships (in ``state``, if given) of the attempt of the row."""
    other = aliased(AttemptMember)
    stmt = select(func.count()).select_from(other).where(other.attempt_id == Attempt.id)
    if state is not None:
        stmt = stmt.where(other.state == state)
    return stmt.correlate(Attempt).scalar_subquery()


# Built once: building a statement costs more than running it.
# A heartbeat writes to its node's row only while the node is ALIVE and the call carries
# the node's own token: as answered (``_RECORD``) or as shed (``_SEEN``).
_OWN_ALIVE_NODE = (
    Node.id == bindparam("node_id"),
    Node.token_hash == bindparam("node_token_hash"),
    Node.state == NodeState.ALIVE,
)
_RECORD = (
    update(Node)
    .where(*_OWN_ALIVE_NODE)
    .values(
        last_heartbeat_at=bindparam("seen_at", type_=Node.__table__.c.last_heartbeat_at.type),
        gpu_usage=bindparam("usage", type_=Node.__table__.c.gpu_usage.type),
        heartbeat_interval_s=bindparam("interval_s"),
        # The token arrived: the key of the registration that issued it is spent.
        registration_key_hash=None,
    )
    .returning(Node.id)
    .execution_options(synchronize_session=False)
)
_SEEN_AT = bindparam("seen_at", type_=Node.__table__.c.last_heartbeat_at.type)
_SEEN = (
    update(Node)
    .where(*_OWN_ALIVE_NODE, Node.last_heartbeat_at < _SEEN_AT)
    .values(last_heartbeat_at=_SEEN_AT)
    .execution_options(synchronize_session=False)
)
_ALIVE_NODES = select(func.count()).select_from(Node).where(Node.state == NodeState.ALIVE)
_MEMBERSHIPS = (
    select(
        AttemptMember.id,
        AttemptMember.attempt_id,
        Attempt.job_id,
        Attempt.number,
        Attempt.rdzv_id,
        Attempt.device,
        AttemptMember.gpus,
        Job.restart_count,
        _members_of_attempt(MemberState.LEFT),
        _members_of_attempt(MemberState.ACTIVE),
        _members_of_attempt(None),
        Attempt.state,
    )
    .join(Attempt, Attempt.id == AttemptMember.attempt_id)
    .join(Job, Job.id == Attempt.job_id)
    .where(
        AttemptMember.node_id == bindparam("node_id"),
        AttemptMember.state == MemberState.ACTIVE,
        or_(
            Attempt.state == AttemptState.RUNNING,
            and_(
                Attempt.state == AttemptState.SUCCEEDED,
                Attempt.ended_at
                >= bindparam("finishing_since", type_=Attempt.__table__.c.ended_at.type),
            ),
        ),
    )
    .order_by(AttemptMember.id)
)
_RECORDED = _RECORD.cte("recorded")
_HELD = _MEMBERSHIPS.order_by(None).subquery("held")
# One row per membership, each with the node's id; one row of NULLs beside the id for a
# node that holds none; no row if the UPDATE matched no row.
_BEAT = (
    select(_RECORDED.c.id, *_HELD.c)
    .select_from(_RECORDED.outerjoin(_HELD, true()))
    .order_by(_HELD.c.id)
)
