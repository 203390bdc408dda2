"""Node agents: registration, heartbeats, and what each node must run."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, case, exists, func, select
from sqlalchemy.orm import Session

from contract.protocol import Heartbeat, NodeRegister
from service import auth
from service.attempts import drop_member, end_member
from service.errors import Conflict, NotFound, StaleState, Unauthenticated
from service.models import Attempt, AttemptMember, JobEvent, Node
from service.states import AttemptState, MemberState, NodeState
from service.transitions import transition

logger = logging.getLogger(__name__)


def register_node(
    session: Session, body: NodeRegister, now: datetime, interval_s: float | None = None
) -> Node:
    """Create the node, or take it back after an agent restart; ``interval_s``: the
    heartbeat interval its reply tells it (None: the controller's base interval).

    An agent registers only when it starts (having ended what its previous life
    left running) or when the controller forgot it, so any membership its name
    still holds is over.

    The name of a node that is ALIVE is taken back only by whoever holds that
    node's current token (its agent, restarted), or the registration key of the
    registration that issued that token (the same agent, retrying a registration
    whose answer it never got): an enrolment credential alone would let anyone push
    a live node out of its attempts. ``Conflict`` otherwise. A LOST or LEFT node's
    name is free to any admitted registration.

    A retry by key keeps the node's memberships of running attempts: the agent never
    got the token it needs to learn of them, so it has started none, and its first
    heartbeat finds them. The key is spent by the node's first heartbeat (its token
    arrived), so it cannot take back a node that runs anything.
    """
    node = session.scalars(
        select(Node).where(Node.name == body.name).with_for_update()
    ).one_or_none()
    key_hash = None if body.registration_key is None else auth.token_hash(body.registration_key)
    held = node is not None and holds_token(node, body)
    retry = (
        node is not None
        and not held
        and auth.hashes_to(body.registration_key, node.registration_key_hash)
    )
    if node is not None and node.state is NodeState.ALIVE and not held and not retry:
        raise Conflict(
            f"node {body.name} is alive; registering under its name needs its node token"
        )
    if node is None:
        node = Node(
            name=body.name,
            address=body.address,
            slots=body.slots,
            pid=body.pid,
            state=NodeState.ALIVE,
            registered_at=now,
            last_heartbeat_at=now,
            heartbeat_interval_s=interval_s,
            registration_key_hash=key_hash,
        )
        _take_inventory(node, body)
        session.add(node)
        session.flush()
        logger.info(
            "node=%s registered name=%s address=%s gpus=%d",
            node.id,
            node.name,
            node.address,
            len(node.gpus),
        )
        return node
    if not (retry and node.state is NodeState.ALIVE):
        for member in memberships(session, node.id):
            drop_member(session, member, now, "its agent restarted")
    _release_finishing(session, node.id, now)
    if node.state is not NodeState.ALIVE and not transition(session, node, NodeState.ALIVE):
        raise StaleState(f"node {node.id} is no longer {node.state}")
    node.address, node.slots, node.pid = body.address, body.slots, body.pid
    node.registered_at, node.last_heartbeat_at = now, now
    node.heartbeat_interval_s = interval_s
    node.registration_key_hash = key_hash
    _take_inventory(node, body)
    logger.info(
        "node=%s registered again name=%s gpus=%d%s",
        node.id,
        node.name,
        len(node.gpus),
        " (a retry whose answer was lost)" if retry else "",
    )
    return node


def _take_inventory(node: Node, body: NodeRegister) -> None:
    """What the registration says the node has, in place of what it said before; the use
    of GPUs it no longer has is forgotten."""
    node.gpus = [g.model_dump() for g in sorted(body.gpus, key=lambda g: g.index)]
    node.gpu_usage = []
    node.gpu_driver, node.cuda_version, node.cpus = body.gpu_driver, body.cuda_version, body.cpus


def holds_token(node: Node, body: NodeRegister) -> bool:
    """Whether the registration carries ``node``'s current token."""
    return auth.hashes_to(body.node_token, node.token_hash)


def memberships(session: Session, node_id: int) -> list[AttemptMember]:
    """The node's active memberships of running attempts."""
    return _active_memberships(session, node_id, Attempt.state == AttemptState.RUNNING)


def _active_memberships(
    session: Session, node_id: int, attempt_is: ColumnElement[bool]
) -> list[AttemptMember]:
    """The node's ACTIVE memberships of the attempts ``attempt_is`` selects."""
    stmt = (
        select(AttemptMember)
        .join(Attempt, Attempt.id == AttemptMember.attempt_id)
        .where(
            AttemptMember.node_id == node_id,
            AttemptMember.state == MemberState.ACTIVE,
            attempt_is,
        )
    )
    return list(session.scalars(stmt))


def _release_finishing(session: Session, node_id: int, now: datetime) -> None:
    """End as LEFT the node's memberships still ACTIVE in attempts that have ended (an
    attempt that SUCCEEDED waits for each member's own exit): a node that is gone
    or restarted will not report them."""
    for member in _active_memberships(session, node_id, Attempt.state != AttemptState.RUNNING):
        end_member(session, member, MemberState.LEFT, now)


def get_node(session: Session, node_id: int, *, for_update: bool = False) -> Node:
    """The node, read afresh and locked with ``for_update``; ``NotFound`` if there is none."""
    if for_update:
        node = session.get(Node, node_id, with_for_update=True, populate_existing=True)
    else:
        node = session.get(Node, node_id)
    if node is None:
        raise NotFound(f"node {node_id} is not registered")
    return node


def record_heartbeat(
    session: Session,
    node_id: int,
    body: Heartbeat,
    now: datetime,
    interval_s: float | None = None,
    *,
    token: str | None = None,
) -> None:
    """Record that the node lives (a LOST or LEFT node is ALIVE again), how its GPUs
    are used and the ``interval_s`` its answer tells it (None: the base interval): the
    way for any node, where ``service.heartbeats.record`` is the short way for an ALIVE
    one. ``token``, the caller's, is checked again under the row's lock: a registration
    that committed since the caller's token was checked has made it stale
    (``Unauthenticated``), and it must not spend that registration's key."""
    node = get_node(session, node_id, for_update=True)
    if token is not None and not auth.hashes_to(token, node.token_hash):
        raise Unauthenticated(f"node {node_id} registered again: this node token is no longer its")
    usage = [u.model_dump() for u in body.gpus]
    if node.state is not NodeState.ALIVE:
        if not transition(
            session,
            node,
            NodeState.ALIVE,
            last_heartbeat_at=now,
            gpu_usage=usage,
            heartbeat_interval_s=interval_s,
            registration_key_hash=None,
        ):
            raise StaleState(f"node {node.id} is no longer {node.state}")
        logger.info("node=%s name=%s is back", node.id, node.name)
    else:
        node.last_heartbeat_at, node.gpu_usage = now, usage
        node.heartbeat_interval_s = interval_s
        node.registration_key_hash = None  # its token arrived: the key is spent


@dataclass(frozen=True)
class Serving:
    """An attempt a node serves (running, or ended while its launcher finishes), and the
    node's GPUs its membership holds."""

    attempt: Attempt
    gpus: tuple[int, ...]


def list_nodes(
    session: Session, limit: int, offset: int
) -> tuple[list[tuple[Node, list[Serving]]], int]:
    """A page of nodes by id, each with the attempts its ACTIVE memberships serve (by
    attempt id: one on "cpu", or any number on "cuda"), an attempt that ended included
    while its launcher there finishes; and the total."""
    nodes = list(session.scalars(select(Node).order_by(Node.id).limit(limit).offset(offset)))
    total = session.scalar(select(func.count()).select_from(Node)) or 0
    serving: dict[int, list[Serving]] = defaultdict(list)
    stmt = (
        select(AttemptMember.node_id, AttemptMember.gpus, Attempt)
        .join(Attempt, Attempt.id == AttemptMember.attempt_id)
        .where(
            AttemptMember.node_id.in_([n.id for n in nodes]),
            AttemptMember.state == MemberState.ACTIVE,
        )
        .order_by(Attempt.id)
    )
    for node_id, gpus, attempt in session.execute(stmt).all():
        serving[node_id].append(Serving(attempt, tuple(gpus or ())))
    return [(node, serving.get(node.id, [])) for node in nodes], total


def alive_and_idle(session: Session) -> tuple[int, int]:
    """How many nodes are ALIVE, and how many of those no ACTIVE membership holds."""
    held = exists().where(
        AttemptMember.node_id == Node.id, AttemptMember.state == MemberState.ACTIVE
    )
    stmt = select(func.count(), func.coalesce(func.sum(case((held, 0), else_=1)), 0)).where(
        Node.state == NodeState.ALIVE
    )
    alive, idle = session.execute(stmt).one()
    return int(alive), int(idle)


def zygote_memory(session: Session, serving: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """For each (node id, attempt id): the memory of the warm zygote the node runs for the
    attempt, as its last ``zygote`` event said when it was ready; absent when that event
    says it is gone or there is none."""
    if not serving:
        return {}
    attempts = {attempt_id for _, attempt_id in serving}
    stmt = (
        select(JobEvent.node_id, JobEvent.attempt_id, JobEvent.data)
        .where(JobEvent.kind == "zygote", JobEvent.attempt_id.in_(attempts))
        .order_by(JobEvent.id)
    )
    latest: dict[tuple[int, int], dict[str, object]] = {}
    for node_id, attempt_id, data in session.execute(stmt).all():
        if node_id is not None and attempt_id is not None:
            latest[(node_id, attempt_id)] = data or {}
    found = {}
    for key in serving:
        data = latest.get(key, {})
        rss = data.get("rss_bytes")
        if data.get("state") == "ready" and isinstance(rss, int):
            found[key] = rss
    return found


def leave(session: Session, node_id: int, reason: str, now: datetime) -> bool:
    """ALIVE → LEFT at once, for an agent that says it is stopping: the other members
    re-form without waiting out the heartbeat timeout. The node comes back by registering."""
    if not _end_node(session, get_node(session, node_id), NodeState.LEFT, now, reason):
        return False
    logger.info("node=%s left: %s", node_id, reason)
    return True


def mark_lost(session: Session, node_id: int, seen_before: datetime, now: datetime) -> bool:
    """ALIVE → LOST, only if no heartbeat arrived since ``seen_before`` (compare-and-set)."""
    node = session.get(Node, node_id)
    if node is None or not _end_node(
        session, node, NodeState.LOST, now, "no heartbeat", Node.last_heartbeat_at <= seen_before
    ):
        return False
    logger.warning("node=%s lost: no heartbeat since %s", node_id, seen_before)
    return True


def _end_node(
    session: Session,
    node: Node,
    new: NodeState,
    now: datetime,
    why: str,
    *still: ColumnElement[bool],
) -> bool:
    """ALIVE → ``new`` (LOST or LEFT) if the row is still ALIVE (and ``still`` holds);
    end its memberships."""
    if node.state is not NodeState.ALIVE or not transition(session, node, new, also_where=still):
        return False
    for member in memberships(session, node.id):
        drop_member(session, member, now, why)
    _release_finishing(session, node.id, now)
    return True
