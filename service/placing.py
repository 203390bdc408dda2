"""Placements into the database: each job a new attempt on nodes that still have the room
the reconciler's plan found for it, a batch of jobs in a few statements however many.

Every check is made again under the rows' locks (the jobs', then the nodes', each in id
order), so a placement decided on stale data is skipped, never half-applied.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from contract.protocol import Device
from service.attempts import active_holds, rdzv_id_for
from service.errors import StaleState
from service.job_events import add_events
from service.models import Attempt, AttemptMember, Job, Node
from service.placement import Owner
from service.states import AttemptState, JobState, MemberState, NodeState
from service.transitions import transition_all

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlaceJob:
    """A new attempt on ``node_ids``; on "cuda", each node's ``gpus`` (in the same order)."""

    job_id: int
    node_ids: tuple[int, ...]
    device: Device = "cpu"
    gpus: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Holder:
    """An active membership on a node, and what it holds there."""

    attempt_id: int | None  # None: an attempt this batch creates
    device: str
    gpus: tuple[int, ...]
    owner: Owner


@dataclass
class LockedRoom:
    """Nodes, locked, and the active memberships that hold them, by node id."""

    nodes: dict[int, Node]
    holders: dict[int, list[Holder]]

    def check(
        self,
        node_ids: Sequence[int],
        device: Device,
        gpus: Sequence[Sequence[int]],
        owner: Owner,
        share_gpu_nodes: bool,
        joining: int | None = None,
    ) -> list[Node]:
        """The named nodes if every one is alive and still has the room an action decided
        on: on "cpu", no active member of any attempt (one that ended holds the node until
        its launcher reports); on "cuda", no member of an attempt on "cpu" nor of
        ``joining`` (the attempt the nodes join, if any), none of a job another user than
        ``owner`` owns (unless ``share_gpu_nodes``), and each node's ``gpus`` are its own
        and held by no other member. ``StaleState`` if not."""
        nodes = [self.nodes[i] for i in node_ids if i in self.nodes]
        if len(nodes) != len(node_ids):
            raise StaleState(f"nodes {list(node_ids)} are no longer all registered")
        if any(n.state is not NodeState.ALIVE for n in nodes):
            raise StaleState(f"nodes {list(node_ids)} are no longer all alive")
        if device == "cpu":
            if any(self.holders.get(i) for i in node_ids):
                raise StaleState(f"nodes {list(node_ids)} are no longer free")
            return nodes
        wanted = dict(zip(node_ids, gpus, strict=True))
        for node in nodes:
            taking = wanted[node.id]
            if len(set(taking)) != len(taking) or not set(taking) <= set(node.gpu_indices):
                raise StaleState(f"node {node.id} has no GPUs {list(taking)} to give")
            for held in self.holders.get(node.id, ()):
                if held.device != "cuda" or (joining is not None and held.attempt_id == joining):
                    raise StaleState(f"node {node.id} is no longer free for attempts on cuda")
                if held.owner != owner and not share_gpu_nodes:
                    raise StaleState(f"node {node.id} serves another user's job on cuda")
                if set(taking) & set(held.gpus):
                    raise StaleState(f"GPUs {list(taking)} of node {node.id} are taken")
        return nodes

    def take(
        self, node_ids: Sequence[int], device: Device, gpus: Sequence[Sequence[int]], owner: Owner
    ) -> None:
        """What a new attempt of this batch holds, for the checks after it."""
        for i, node_id in enumerate(node_ids):
            held = tuple(gpus[i]) if device == "cuda" else ()
            self.holders.setdefault(node_id, []).append(Holder(None, device, held, owner))


def lock_room(session: Session, node_ids: Sequence[int]) -> LockedRoom:
    """The nodes named, locked in id order, and what holds them: two statements."""
    ids = sorted(set(node_ids))
    stmt = select(Node).where(Node.id.in_(ids)).with_for_update().order_by(Node.id)
    nodes = {n.id: n for n in session.scalars(stmt)}
    holders: dict[int, list[Holder]] = defaultdict(list)
    rows = session.execute(active_holds().where(AttemptMember.node_id.in_(ids))).all()
    for node_id, attempt_id, device, gpus, owner in rows:
        holders[node_id].append(Holder(attempt_id, device, tuple(gpus), owner))
    return LockedRoom(nodes, holders)


def _gpus_text(gpus: Sequence[int]) -> str:
    """`` (GPUs 0, 1)`` after a node's name in a timeline line; '' for none."""
    if not gpus:
        return ""
    return f" (GPU{'s' if len(gpus) > 1 else ''} {', '.join(str(g) for g in gpus)})"


def place_jobs(
    session: Session, actions: Sequence[PlaceJob], now: datetime, share_gpu_nodes: bool
) -> dict[int, str]:
    """Apply ``actions`` in order, each one only if it still holds: its job is still waiting
    to be placed and not backing off, and its nodes have the room (``LockedRoom.check``,
    counting what the placements before it in the batch took). Each job placed is RUNNING
    with a new attempt whose members are its nodes, and a ``placed`` event on its timeline.

    The statements do not grow with the batch: the jobs and the nodes are each read and
    locked in one, the jobs change state in one per state they waited in, and the
    attempts, their members and the events are each inserted in one. Returns why each
    skipped job was skipped, by job id.
    """
    stmt = select(Job).where(Job.id.in_([a.job_id for a in actions])).order_by(Job.id)
    jobs = {j.id: j for j in session.scalars(stmt.with_for_update())}
    room = lock_room(session, [n for a in actions for n in a.node_ids])
    skipped: dict[int, str] = {}
    kept: list[tuple[PlaceJob, int, list[Node]]] = []  # the placements that hold, by job id
    numbers: dict[int, int] = {}  # the number of each one's attempt, by job id
    waiting: list[Job] = []
    states: dict[int, JobState] = {}  # the state each one waited in
    for action in actions:
        job = jobs.get(action.job_id)
        try:
            if job is None:
                raise StaleState(f"job {action.job_id} no longer exists")
            if not job.state.is_placeable():
                raise StaleState(f"job {job.id} is {job.state}, not waiting to be placed")
            if job.not_before is not None and now < job.not_before:
                raise StaleState(f"job {job.id} backs off until {job.not_before}")
            owner = job.owner_id
            nodes = room.check(action.node_ids, action.device, action.gpus, owner, share_gpu_nodes)
        except StaleState as exc:
            skipped[action.job_id] = str(exc)
            continue
        room.take(action.node_ids, action.device, action.gpus, owner)
        kept.append((action, job.id, nodes))
        numbers[job.id] = job.attempt_count + 1
        states[job.id] = job.state
        waiting.append(job)
    if not kept:
        return skipped
    written = transition_all(
        session,
        waiting,
        JobState.RUNNING,
        message="",
        updated_at=now,
        started_at=func.coalesce(Job.started_at, now),
        waiting_since=None,
        not_before=None,
        attempt_count=Job.attempt_count + 1,
    )
    if len(written) != len(kept):  # the rows are locked: not expected
        lost = sorted(set(numbers) - written)
        raise StaleState(f"jobs {lost} changed state while locked")
    for job_id, state in states.items():
        logger.info("job=%s state %s -> %s", job_id, state, JobState.RUNNING)
    rows = session.execute(
        insert(Attempt).returning(Attempt.rdzv_id, Attempt.id),
        [
            {
                "job_id": job_id,
                "number": numbers[job_id],
                "rdzv_id": rdzv_id_for(job_id, numbers[job_id]),
                "state": AttemptState.RUNNING,
                "started_count": 0,
                "created_at": now,
                "result": "",
                "device": action.device,
            }
            for action, job_id, _ in kept
        ],
    ).all()
    attempt_ids: dict[str, int] = {rdzv_id: attempt_id for rdzv_id, attempt_id in rows}
    members: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for action, job_id, nodes in kept:
        number = numbers[job_id]
        attempt_id = attempt_ids[rdzv_id_for(job_id, number)]
        gpus: Mapping[int, Sequence[int]] = (
            dict(zip(action.node_ids, action.gpus, strict=True)) if action.device == "cuda" else {}
        )
        members += [
            {
                "attempt_id": attempt_id,
                "node_id": node.id,
                "state": MemberState.ACTIVE,
                "joined_at": now,
                "gpus": list(gpus.get(node.id, ())),
            }
            for node in nodes
        ]
        where = ", ".join(n.name + _gpus_text(gpus.get(n.id, ())) for n in nodes)
        data: dict[str, object] = {"nodes": [n.name for n in nodes]}
        if action.device == "cuda":
            data |= {"device": "cuda", "gpus": {n.name: list(gpus[n.id]) for n in nodes}}
        events.append(
            {
                "job_id": job_id,
                "attempt_id": attempt_id,
                "kind": "placed",
                "message": f"attempt {number} placed on {where} "
                f"(rendezvous id {rdzv_id_for(job_id, number)})"
                + (" and resumes from its newest snapshot" if number > 1 else ""),
                "data": data,
            }
        )
    session.execute(insert(AttemptMember), members)
    add_events(session, events, now)
    return skipped
