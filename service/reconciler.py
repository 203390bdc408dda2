"""The reconciler: read the database, decide with a pure function, apply each action.

Level-triggered: every pass decides from what the database says now, so a
restarted controller picks up where the last one stopped. ``plan`` is pure
(time is a parameter); ``Reconciler.apply`` executes one action per
transaction (placements a batch per transaction, ``service.placing``) and
re-checks its preconditions under locks or with compare-and-set, so an action
decided on stale data is skipped, never half-applied.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any, NamedTuple, cast

from sqlalchemy import Row, Select, and_, or_, select
from sqlalchemy.exc import MultipleResultsFound, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from contract.protocol import Device
from service.attempts import (
    active_holds,
    active_members,
    add_member,
    count_membership_change,
    end_attempt,
)
from service.db import transaction
from service.errors import StaleState
from service.heartbeats import allowed_silence
from service.job_events import add_event
from service.jobs import (
    change_job_state,
    chunked,
    explain_waiting,
    explain_waiting_jobs,
    get_job,
)
from service.leader import Leadership, LeaseLost, acquire, extend, hold, release
from service.metrics import ReconcilerMetrics
from service.models import (
    Attempt,
    AttemptMember,
    Job,
    Node,
    inline,
    json_text,
    parse_stored_spec,
)
from service.nodes import mark_lost
from service.passes import PassSignals
from service.placement import (
    BySlots,
    GpuNodes,
    Hold,
    Owner,
    Room,
    by_id,
    gpu_waiting_reason,
    resolve_device,
    stored_device,
)
from service.placing import PlaceJob, lock_room, place_jobs
from service.settings import ControllerSettings
from service.spec import JobSpec
from service.states import AttemptState, JobState, NodeState
from service.thread_time import SpanClock, Split

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeView:
    id: int
    state: NodeState
    last_heartbeat_at: datetime
    slots: int
    gpus: tuple[int, ...] = ()  # the indices of its GPUs
    # ACTIVE memberships of attempts that have ended (their launchers are finishing):
    # they hold the node (on "cpu") or their GPUs (on "cuda") as long as they last.
    ending: tuple[Hold, ...] = ()
    # The silence it may keep beyond the node timeout, having been told a longer
    # heartbeat interval (``service.heartbeats.allowed_silence``).
    extra_silence: timedelta = timedelta(0)


@dataclass(frozen=True)
class JobView:
    id: int
    state: JobState
    created_at: datetime
    spec: JobSpec
    attempt_id: int | None = None
    members: tuple[int, ...] = ()
    waiting_since: datetime | None = None
    not_before: datetime | None = None
    message: str = ""
    device: Device = "cpu"  # the running attempt's
    member_gpus: tuple[tuple[int, ...], ...] = ()  # the GPUs each of ``members`` holds
    owner: Owner = None  # the id of the user who submitted it


@dataclass(frozen=True)
class MarkNodeLost:
    node_id: int
    seen_before: datetime


@dataclass(frozen=True)
class AddMembers:
    """More nodes for a running attempt, on its device; ``gpus`` as in ``PlaceJob``."""

    job_id: int
    attempt_id: int
    node_ids: tuple[int, ...]
    gpus: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class WaitForNodes:
    """Fewer than MIN nodes of the running attempt are left: end it, wait, resume later."""

    job_id: int
    attempt_id: int


@dataclass(frozen=True)
class GiveUpWaiting:
    """A WAITING job found no MIN nodes before its deadline."""

    job_id: int
    waiting_since: datetime


@dataclass(frozen=True)
class ExplainWait:
    """A PENDING or WAITING job cannot be placed: its message (and timeline) says why.

    Decided only when ``reason`` differs from the job's message, so the
    timeline gets one event per change of reason, not one per pass.
    """

    job_id: int
    state: JobState
    reason: str


Action = MarkNodeLost | PlaceJob | AddMembers | WaitForNodes | GiveUpWaiting | ExplainWait


def _waiting_reason(min_nodes: int, per_node: int, alive: int, big_enough: int) -> str:
    """Why a job of ``min_nodes`` nodes of ``per_node`` slots is not placed, given
    ``alive`` nodes of which ``big_enough`` have the slots it needs: no node is alive, too
    few have its slots, or too few of those are free.

    It names what the job needs, never how many nodes are free or busy: the text changes
    only when the job moves from one case to another, not whenever a node is taken or
    freed, so a deep queue is not rewritten at every change of the cluster."""
    needs = f"needs {min_nodes}"
    if per_node > 1:
        needs += f" with {per_node} slots each"
    if alive == 0:
        return f"waiting for nodes: {needs}, no node is alive"
    if big_enough < min_nodes:
        if per_node > 1:
            return f"waiting for nodes: {needs}, too few alive nodes have that many slots"
        return f"waiting for nodes: {needs}, too few nodes are alive"
    return f"waiting for nodes: {needs}, too few are free; other jobs hold the rest"


class Reasons:
    """Why a job that is not placed waits, on the ``alive`` nodes (``plan``): what it asks
    and the alive nodes' slots and GPUs decide it, never which nodes are free, so every
    queued job of one ``Ask`` is told the same. Worked out once per ask."""

    def __init__(self, alive: Sequence[NodeView]) -> None:
        self.gpu_nodes = GpuNodes(alive)
        self._alive = len(alive)
        self._any_gpus = any(n.gpus for n in alive)
        self._big_enough = BySlots(alive)
        self._known: dict[tuple[Device, int, int], str] = {}

    def of(self, device: Device, min_nodes: int, per_node: int) -> str:
        """The reason of a job placed on ``device`` (resolved) that is not placed."""
        key = (device, min_nodes, per_node)
        if key not in self._known:
            if device == "cuda":
                gpus_exist = self.gpu_nodes.enough(min_nodes, per_node)
                reason = gpu_waiting_reason(min_nodes, per_node, self._any_gpus, gpus_exist)
            else:
                big_enough = len(self._big_enough.ids(per_node))
                reason = _waiting_reason(min_nodes, per_node, self._alive, big_enough)
            self._known[key] = reason
        return self._known[key]

    def of_ask(self, ask: Ask) -> str:
        """The reason of a queued job that asks ``ask`` (``job_ask``) and is not placed."""
        wanted, per_node, min_nodes, _ = ask
        device = resolve_device(wanted, self.gpu_nodes.enough(min_nodes, per_node))
        return self.of(device, min_nodes, per_node)


def plan(
    now: datetime,
    nodes: Sequence[NodeView],
    jobs: Sequence[JobView],
    node_timeout: timedelta,
    share_gpu_nodes: bool = False,
    fleet: Fleet | None = None,
) -> list[Action]:
    """Decide what to do now. Pure: same inputs, same actions (``fleet``: as in
    ``plan_with_room``).

    - A live node silent for longer than ``node_timeout`` (plus its
      ``extra_silence``, when it was told a longer heartbeat interval) is lost; its
      memberships end (the elastic agents of the other nodes carry on at the
      smaller world size).
    - An active job with fewer than MIN members left stops its attempt and
      WAITs; a WAITING job whose ``wait_for_nodes`` has run out fails.
    - PENDING and WAITING jobs, oldest first, are placed once at least MIN
      fitting nodes are free (a WAITING job not before its back-off ends);
      they get up to MAX. One that cannot be placed gets an ``ExplainWait``
      when the reason (no node is alive, too few have its slots or GPUs, or too
      few of those are free; never a count) differs from its message.
    - Then running jobs below MAX take free fitting nodes (scale up), a node
      that left that attempt and is back included: it joins again in place
      with a new membership, which its agent runs afresh.

    A node is held by one attempt on "cpu" (the whole node: ``nproc_per_node``
    at most its slots; nodes without GPUs first) or by any number of attempts on
    "cuda", each on ``nproc_per_node`` GPUs of its own: the nodes with the fewest
    free GPUs that fit first, on each its lowest free indices (``placement.Room``).
    Attempts on "cuda" share a node only if their jobs have one owner, unless
    ``share_gpu_nodes``. A membership of an ended attempt that is still ACTIVE
    (``NodeView.ending``) holds what it held. A job's device is resolved when it is
    placed (``resolve_device``); scale-up keeps the attempt's, and an attempt on
    "cpu" grows only onto nodes without GPUs (it would hold them whole until it ends).
    """
    return plan_with_room(now, nodes, jobs, node_timeout, share_gpu_nodes, fleet)[0]


def plan_with_room(
    now: datetime,
    nodes: Sequence[NodeView],
    jobs: Sequence[JobView],
    node_timeout: timedelta,
    share_gpu_nodes: bool = False,
    fleet: Fleet | None = None,
) -> tuple[list[Action], Room]:
    """``plan``, and the room its placeable jobs left (before any running attempt grew
    into it): a full room would take none of the jobs queued after them. ``fleet``, when
    given, is ``Fleet(now, nodes, node_timeout)``, worked out once for several plans."""
    fleet = Fleet(now, nodes, node_timeout) if fleet is None else fleet
    actions: list[Action] = [
        MarkNodeLost(n.id, now - node_timeout - n.extra_silence) for n in fleet.silent
    ]
    running, left = _place_queue(now, fleet, jobs, share_gpu_nodes, actions)
    room = left
    for job, remaining in running:
        if room.is_full():  # no attempt could grow
            break
        room_for = job.spec.max_nodes - len(remaining)
        if room_for <= 0 or job.attempt_id is None:
            continue
        # On "cpu" only nodes without GPUs: there is no scale-down to give them back.
        fitting = room.fitting(job.device, job.spec.nproc_per_node, job.owner, gpu_less=True)
        # On "cuda" a member node may have GPUs to spare; the attempt takes a node once.
        others = [(i, g) for i, g in fitting if i not in remaining][:room_for]
        if others:
            chosen, gpus = by_id(job.device, others)
            actions.append(AddMembers(job.id, job.attempt_id, chosen, gpus))
            room = room.taking(job.device, chosen, gpus, job.owner)
    return actions, left


def room_left(
    now: datetime, fleet: Fleet, jobs: Sequence[JobView], share_gpu_nodes: bool = False
) -> Room:
    """The room ``plan_with_room`` returns for ``jobs`` on ``fleet``, without deciding its
    other actions: what ``Reconciler`` asks of the queue's head, page after page."""
    return _place_queue(now, fleet, jobs, share_gpu_nodes, None)[1]


class Fleet:
    """The nodes as ``plan`` sees them at ``now``: the ALIVE ones silent too long
    (``silent``: to be marked lost) and the others it places on (``alive``, by id)."""

    def __init__(self, now: datetime, nodes: Sequence[NodeView], node_timeout: timedelta) -> None:
        self.silent = [n for n in nodes if _silent_too_long(now, n, node_timeout)]
        gone = {n.id for n in self.silent}
        self.alive = sorted(
            (n for n in nodes if n.state is NodeState.ALIVE and n.id not in gone),
            key=lambda n: n.id,
        )
        self.alive_ids = {n.id for n in self.alive}
        self.reasons = Reasons(self.alive)
        # The last ``running`` worked out: for which jobs (by identity; the jobs kept, so
        # that no other object takes one's id) and sharing, and what it was.
        self._running: tuple[tuple[int | bool, ...], list[JobView], Running] | None = None

    def running(self, jobs: Sequence[JobView], share_gpu_nodes: bool) -> Running:
        """What the running attempts of ``jobs`` hold on these nodes: those left MIN nodes
        (each with its nodes still alive), a ``WaitForNodes`` for each of the others, and
        the room the first leave. Worked out once for the same running attempts: a pass
        asks it of the queue's head (``room_left``), then of its plan."""
        active = [job for job in jobs if job.state.is_active() and job.attempt_id is not None]
        key = (*map(id, active), share_gpu_nodes)
        if self._running is not None and self._running[0] == key:
            return self._running[2]
        alive_ids = self.alive_ids
        running: list[tuple[JobView, list[int]]] = []
        waits: list[Action] = []
        whole: set[int] = set()  # nodes an attempt on "cpu" holds
        held: dict[int, set[int]] = {}  # GPUs attempts on "cuda" hold, by node
        owners: dict[int, set[Owner]] = {}  # whose attempts on "cuda" hold GPUs, by node
        for n in self.alive:
            for ended in n.ending:
                if ended.device == "cuda":
                    held.setdefault(n.id, set()).update(ended.gpus)
                    owners.setdefault(n.id, set()).add(ended.owner)
                else:
                    whole.add(n.id)
        for job in active:
            remaining = [m for m in job.members if m in alive_ids]
            if len(remaining) < job.spec.min_nodes:
                waits.append(WaitForNodes(job.id, cast(int, job.attempt_id)))
                continue
            if job.device == "cuda":
                for node_id, holds in zip(job.members, job.member_gpus, strict=True):
                    if node_id in alive_ids:
                        held.setdefault(node_id, set()).update(holds)
                        owners.setdefault(node_id, set()).add(job.owner)
            else:
                whole.update(remaining)
            running.append((job, remaining))
        result = Running(running, waits, Room(self.alive, whole, held, owners, share_gpu_nodes))
        self._running = (key, active, result)
        return result


class Running(NamedTuple):
    """What ``Fleet.running`` says of the running attempts."""

    attempts: list[tuple[JobView, list[int]]]  # each left enough nodes, with them
    waits: list[Action]  # a ``WaitForNodes`` for each of the others
    room: Room  # what the first leave


def _place_queue(
    now: datetime,
    fleet: Fleet,
    jobs: Sequence[JobView],
    share_gpu_nodes: bool,
    actions: list[Action] | None,
) -> tuple[list[tuple[JobView, list[int]]], Room]:
    """What the running attempts hold, then the placeable jobs placed oldest first: the
    running attempts left MIN nodes (each with its nodes still alive) and the room the
    placements left. Decides, into ``actions`` (none: decides nothing but the room), the
    ``WaitForNodes``, ``GiveUpWaiting``, ``PlaceJob`` and ``ExplainWait`` of ``plan``."""
    running, waits, room = fleet.running(jobs, share_gpu_nodes)
    if actions is not None:
        actions += waits
    pending: list[JobView] = []
    for job in sorted((j for j in jobs if j.state.is_placeable()), key=queue_key):
        if job.state is JobState.WAITING and job.waiting_since is not None:
            if now - job.waiting_since > timedelta(seconds=job.spec.wait_for_nodes_s):
                if actions is not None:
                    actions.append(GiveUpWaiting(job.id, job.waiting_since))
                continue
            if job.not_before is not None and now < job.not_before:
                continue
        pending.append(job)
    # By what a job asks: a deep queue asks the same few questions of the nodes.
    reasons = fleet.reasons
    for job in pending:
        per_node, min_nodes = job.spec.nproc_per_node, job.spec.min_nodes
        device = resolve_device(job.spec.device, reasons.gpu_nodes.enough(min_nodes, per_node))
        fitting = room.fitting(device, per_node, job.owner)
        if len(fitting) >= min_nodes:
            chosen, gpus = by_id(device, fitting[: job.spec.max_nodes])
            if actions is not None:
                actions.append(PlaceJob(job.id, chosen, device, gpus))
            room = room.taking(device, chosen, gpus, job.owner)
            continue
        if actions is None:
            continue
        reason = reasons.of(device, min_nodes, per_node)
        if reason != job.message:
            actions.append(ExplainWait(job.id, job.state, reason))
    return running, room


def _silent_too_long(now: datetime, node: NodeView, node_timeout: timedelta) -> bool:
    return (
        node.state is NodeState.ALIVE
        and now - node.last_heartbeat_at > node_timeout + node.extra_silence
    )


# What a job asks of the room it is placed in: its device as the spec says it, slots or
# GPUs per node, the fewest nodes, and (where attempts on "cuda" share nodes only among
# one owner's jobs) its owner.
Ask = tuple[str, int, int, Owner]


def job_ask(job: JobView, share_gpu_nodes: bool = False) -> Ask:
    owner = None if share_gpu_nodes or job.spec.device == "cpu" else job.owner
    return job.spec.device, job.spec.nproc_per_node, job.spec.min_nodes, owner


def takes_any(room: Room, asks: Iterable[Ask], gpu_nodes: GpuNodes) -> bool:
    """Whether ``room`` could take a job of any of ``asks``, as ``plan`` decides it (the
    device resolved, then enough fitting nodes)."""
    for wanted, per_node, min_nodes, owner in asks:
        device = resolve_device(wanted, gpu_nodes.enough(min_nodes, per_node))
        if len(room.fitting(device, per_node, owner)) >= min_nodes:
            return True
    return False


# A parsed spec by the job's id and submit time (a spec never changes after submit).
SpecCache = dict[tuple[int, datetime], JobSpec]


class ViewCache:
    """The views one pass made, by id, with what each was made of (a node's row and what
    ended attempts hold on it; a job's row and its running attempt): the next pass gives a
    row that has not changed the view it had, rather than make it again. Each pass keeps
    the views of its own rows alone. A pass reads every node and placed job, and most of
    them are as they were: a heartbeat changes one node's row."""

    def __init__(self) -> None:
        # By id: what the view was made of, and the view.
        self.nodes: dict[int, tuple[tuple[Any, ...], NodeView]] = {}
        self.jobs: dict[int, tuple[tuple[Any, ...], JobView]] = {}


def load_views(
    session: Session, specs: SpecCache | None = None, base_interval_s: float | None = None
) -> tuple[list[NodeView], list[JobView]]:
    """The nodes and every open job (``read_fleet`` and the whole queue, ``read_queue``);
    ``specs`` is left holding the open jobs' specs only."""
    specs = {} if specs is None else specs
    nodes, jobs = read_fleet(session, specs, base_interval_s)
    jobs += read_queue(session, specs)
    _keep_specs(specs, jobs)
    return nodes, jobs


def read_fleet(
    session: Session,
    specs: SpecCache,
    base_interval_s: float | None = None,
    heard_since: datetime | None = None,
    views: ViewCache | None = None,
) -> tuple[list[NodeView], list[JobView]]:
    """The nodes (with their GPUs, what ended attempts' active members still hold on
    them and, given the ``base_interval_s`` of heartbeats, the silence each was allowed
    beyond it) and the open jobs that have been placed (WAITING, RUNNING, RESTARTING:
    no more than the nodes hold or held), each with its owner and its running attempt's
    device and active members (with the GPUs each holds). The PENDING jobs, the queue,
    are ``read_queue``'s. A node last heard from before ``heard_since`` counts as heard
    from then (``Reconciler``: heartbeats sent while no controller led may be unrecorded).

    A fixed number of statements however many jobs are open: nodes, placed jobs with
    their running attempts, every active member (of any attempt), and the specs of
    the jobs ``specs`` lacks (one statement per ``chunked`` run of them), which are
    added to it; the views are put together here. A job with two running attempts is
    an error, as ``running_attempt`` says.

    A pass reads every node and every placed job, so this runs on the session's
    connection (rows, not ORM results), and reads the JSON lists of GPUs as text, each
    distinct text parsed once and kept (``_gpu_indices``, ``_held_gpus``): a node without
    GPUs says ``[]``, a node's list (its GPUs' UUIDs included) changes only when it
    registers, and memberships hold a few lists of indices. A fleet of more GPU nodes than
    the 4,096 texts kept has the rest parsed on every pass, as before.
    """
    db = session.connection()
    views = ViewCache() if views is None else views
    node_columns = (
        Node.id,
        Node.state,
        Node.last_heartbeat_at,
        Node.slots,
        json_text(Node.gpus),
        Node.heartbeat_interval_s,
    )
    node_rows = db.execute(select(*node_columns)).all()
    # Each placed job with its running attempt, if any, in one statement.
    placed = (
        select(*_JOB_COLUMNS, Attempt.id, Attempt.device)
        .outerjoin(Attempt, and_(Attempt.job_id == Job.id, Attempt.state == AttemptState.RUNNING))
        .where(Job.state.in_([s for s in JobState if s.is_placed()]))
        .order_by(Job.id)  # the same input to ``plan`` whatever order the join returns
    )
    job_rows = db.execute(placed).all()
    attempt_of: dict[int, int] = {}
    device_of: dict[int, Device] = {}
    for row in job_rows:
        running_id = row[-2]
        if running_id is not None:
            if row[0] in attempt_of:
                raise MultipleResultsFound(f"job {row[0]} has more than one running attempt")
            attempt_of[row[0]] = running_id
            device_of[running_id] = stored_device(row[-1])
    members_of: dict[int, list[int]] = defaultdict(list)
    gpus_of: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    ending: dict[int, list[Hold]] = defaultdict(list)
    for node_id, member_of, device, gpus, held_by in db.execute(held_now()).all():
        if member_of in device_of:
            members_of[member_of].append(node_id)
            gpus_of[member_of].append(_held_gpus(gpus))
        else:
            on = stored_device(device)
            ending[node_id].append(Hold(held_by, on, _held_gpus(gpus) if on == "cuda" else ()))
    node_views: dict[int, tuple[tuple[Any, ...], NodeView]] = {}
    nodes = []
    kept_nodes = views.nodes
    for node_id, state, seen, slots, gpus, told_s in node_rows:
        heard = seen if heard_since is None or seen >= heard_since else heard_since
        ends = tuple(ending.get(node_id, ()))
        key = (state, heard, slots, gpus, told_s, base_interval_s, ends)
        kept = kept_nodes.get(node_id)
        if kept is not None and kept[0] == key:
            view = kept[1]
        else:
            view = NodeView(
                node_id,
                state,
                heard,
                slots,
                _gpu_indices(gpus),
                ends,
                _extra_silence(told_s, base_interval_s),
            )
        node_views[node_id] = (key, view)
        nodes.append(view)
    views.nodes = node_views
    running_of = {
        job_id: RunningAttempt(
            attempt_id,
            device_of[attempt_id],
            tuple(members_of.get(attempt_id, ())),
            tuple(gpus_of.get(attempt_id, ())),
        )
        for job_id, attempt_id in attempt_of.items()
    }
    jobs = _job_views(session, specs, [row[:-2] for row in job_rows], running_of, views)
    return nodes, jobs


def held_now() -> Select[int, int, str, Any, int | None]:
    """What every ACTIVE membership holds (``active_holds``) as ``read_fleet`` reads it:
    the GPUs as text, in the order the memberships were made."""
    return active_holds(gpus_as_text=True).order_by(AttemptMember.id)


@lru_cache(maxsize=4096)
def _gpu_indices(stored: str | None) -> tuple[int, ...]:
    """A node's GPUs (``Node.gpus`` as text) as their sorted indices."""
    return tuple(sorted(int(g["index"]) for g in json.loads(stored or "[]") or ()))


@lru_cache(maxsize=4096)
def _held_gpus(stored: str | None) -> tuple[int, ...]:
    """The GPUs a membership holds (``AttemptMember.gpus`` as text)."""
    return tuple(json.loads(stored or "[]") or ())


_JOB_COLUMNS = (
    Job.id,
    Job.state,
    Job.created_at,
    Job.waiting_since,
    Job.not_before,
    Job.message,
    Job.owner_id,
)

# A row of ``_JOB_COLUMNS``.
JobRow = Row[int, JobState, datetime, datetime | None, datetime | None, str, int | None]

# Where a job stands in the queue: jobs are placed oldest first (``plan``).
QueueKey = tuple[datetime, int]


def queue_key(job: JobView) -> QueueKey:
    return job.created_at, job.id


def read_queue(
    session: Session,
    specs: SpecCache,
    *,
    after: QueueKey | None = None,
    limit: int | None = None,
    unexplained: bool = False,
) -> list[JobView]:
    """The PENDING jobs (never placed: no attempt), oldest first: all of them, or the
    ``limit`` first after ``after``, or (``unexplained``) those that do not yet say why
    they wait (submitted since the last pass). Their specs are added to ``specs``."""
    stmt = select(*_JOB_COLUMNS).where(Job.state == inline(JobState.PENDING))  # ix_jobs_queue
    if unexplained:
        stmt = stmt.where(Job.message == inline(""))  # ix_jobs_unexplained
    if after is not None:
        created_at, job_id = after
        stmt = stmt.where(
            or_(Job.created_at > created_at, and_(Job.created_at == created_at, Job.id > job_id))
        )
    stmt = stmt.order_by(Job.created_at, Job.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    return _job_views(session, specs, session.connection().execute(stmt).all())


class RunningAttempt(NamedTuple):
    """What a placed job's view holds of its running attempt."""

    id: int | None
    device: Device
    members: tuple[int, ...]  # its active members' nodes
    member_gpus: tuple[tuple[int, ...], ...]  # the GPUs each of them holds


# A job's view without an attempt holds JobView's defaults.
NO_ATTEMPT = RunningAttempt(None, "cpu", (), ())


def _job_views(
    session: Session,
    specs: SpecCache,
    rows: Sequence[tuple[Any, ...]],
    running: Mapping[int, RunningAttempt] | None = None,
    views: ViewCache | None = None,
) -> list[JobView]:
    """The views of the jobs ``rows`` hold (``_JOB_COLUMNS``), their specs added to
    ``specs`` where it lacks them, each with its running attempt as ``running`` has it
    by job (none: no attempt). Given ``views``, a job whose row and attempt are those of
    a view it holds gets that view, and it is left holding these jobs' views alone."""
    running = running or {}
    made: dict[int, tuple[tuple[Any, ...], JobView]] = {}
    kept = {} if views is None else views.jobs
    out: list[JobView | tuple[Any, ...]] = []
    for row in rows:
        key = (*row, running.get(row[0], NO_ATTEMPT))
        old = kept.get(row[0])
        if old is not None and old[0] == key:
            out.append(old[1])
            made[row[0]] = old
        else:
            out.append(key)
    _read_specs(
        session,
        specs,
        [(key[0], key[2]) for key in out if not isinstance(key, JobView)],
    )
    result = []
    for item in out:
        if isinstance(item, JobView):
            result.append(item)
            continue
        job_id, state, created_at, waiting_since, not_before, message, owner, attempt = item
        view = JobView(
            id=job_id,
            state=state,
            created_at=created_at,
            spec=specs[job_id, created_at],
            attempt_id=attempt.id,
            members=attempt.members,
            waiting_since=waiting_since,
            not_before=not_before,
            message=message,
            device=attempt.device,
            member_gpus=attempt.member_gpus,
            owner=owner,
        )
        made[job_id] = (item, view)
        result.append(view)
    if views is not None:
        views.jobs = made
    return result


def _read_specs(session: Session, specs: SpecCache, keys: list[tuple[int, datetime]]) -> None:
    """Add to ``specs`` those of the jobs ``keys`` name that it lacks."""
    missing = sorted({job_id for job_id, created_at in keys if (job_id, created_at) not in specs})
    for chunk in chunked(missing):
        stmt = select(Job.id, Job.created_at, Job.spec).where(Job.id.in_(chunk))
        for job_id, created_at, stored in session.execute(stmt):
            specs[job_id, created_at] = parse_stored_spec(stored)


def _keep_specs(specs: SpecCache, jobs: Sequence[JobView]) -> None:
    """Leave ``specs`` holding the specs of ``jobs`` only (every open job's, after a
    whole read)."""
    wanted = {(job.id, job.created_at) for job in jobs}
    for gone in [key for key in specs if key not in wanted]:
        del specs[gone]


@lru_cache(maxsize=1024)
def _extra_silence(told_s: float | None, base_s: float | None) -> timedelta:
    """The silence a node told ``told_s`` may keep beyond the node timeout
    (``service.heartbeats.allowed_silence``); none without a base interval."""
    if base_s is None:
        return timedelta(0)
    return timedelta(seconds=allowed_silence(0.0, base_s, told_s))


def stalled(last_pass: datetime | None, now: datetime, node_timeout: timedelta) -> bool:
    """Whether the pass at ``now`` comes so late after the last one (half the node timeout)
    that this controller was likely starved: its heartbeat handlers too, so a node's
    silence since then says nothing about the node. Dropping a healthy node ends its
    attempt's workers everywhere; waiting a little longer for a dead one costs less."""
    return last_pass is not None and now - last_pass > node_timeout / 2


def rest_after(
    took_s: float,
    cpu_s: float,
    max_share: float,
    interval_s: float,
    lease_s: float,
    node_timeout_s: float,
    lease_age_s: float = 0.0,
) -> float:
    """How long the loop rests after a pass that took ``took_s`` (wall time), ``cpu_s`` of
    it on a CPU (its thread's time, when it held the interpreter lock the API's threads
    need): long enough that passes take at most ``max_share`` of the CPU time, but never so
    long that more than a third of the lease would pass between its last renewal (
    ``lease_age_s`` before this pass began; 0: this pass renewed it) and the next pass,
    nor that the next pass would count as ``stalled`` (half the node timeout after this
    pass began, less an interval). A pass that waited on the database rests no longer
    for it."""
    wanted = cpu_s * (1 - max_share) / max_share
    lease = lease_s / 3 - lease_age_s - took_s
    stall = node_timeout_s / 2 - interval_s - took_s
    return max(0.0, min(wanted, lease, stall))


def utcnow() -> datetime:
    return datetime.now(UTC)


class _PhaseTimer:
    """Times the phases of one pass into ``relaunch_reconcile_phase_seconds``, and keeps
    them (``seconds``) for the log line of a slow pass."""

    def __init__(self, metrics: ReconcilerMetrics | None) -> None:
        self._metrics = metrics
        self._since = time.perf_counter()
        self._clock = SpanClock()
        self.seconds: dict[str, float] = {}
        self.split: Split | None = None

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self._since
        if self._metrics is not None:
            self._metrics.reconcile_phase.labels(phase).observe(self.seconds[phase])
        self._since = now

    def ended(self) -> None:
        """The pass has ended: split its time (``relaunch_reconcile_pass_split_seconds``)."""
        self.split = self._clock.split()
        if self._metrics is not None and self.split is not None:
            for state, seconds in vars(self.split).items():
                self._metrics.reconcile_split.labels(state).observe(seconds)

    def describe_slow(
        self, limit_s: float, nodes: int, jobs: int, actions: list[Action], whole: bool
    ) -> None:
        """Log the pass if it took longer than ``limit_s`` (its interval): where the time
        went, by phase and by what its thread did, and what it did, by kind of action."""
        total = sum(self.seconds.values())
        if total <= limit_s:
            return
        phases = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.seconds.items())
        kinds = Counter(type(a).__name__ for a in actions)
        logger.info(
            "slow reconciler pass: %.2f s (%s%s) over %d nodes and %d open jobs read (%s); "
            "actions: %s",
            total,
            phases,
            "" if self.split is None else "; " + self.split.describe(),
            nodes,
            jobs,
            "the whole queue" if whole else "the queue's head",
            ", ".join(f"{kind} {count}" for kind, count in kinds.most_common()) or "none",
        )


# The largest and the smallest first page of the queue a pass reads
# (``Reconciler._with_queue``; twice the room's openings, between the two), and how often
# at least it reads the queue whole.
QUEUE_PAGE = 256
FIRST_PAGE_MIN = 16
WHOLE_READ_EVERY_S = 300.0
# How soon after a whole read a change of the alive nodes that changes a queued ask's
# reason makes a pass read the queue whole again: while a fleet starts, every
# registration can change one.
SHAPE_READ_EVERY_S = 10.0
# How old a leader lets its lease grow, as a share of it, before a pass renews it: a
# leader that stalls keeps at least the rest (7.5 s of a 10 s lease) before a standby
# may take over, and passes in between read nothing for the lease.
LEASE_RENEW_AFTER = 0.25
# The most placements applied in one transaction (``Reconciler._apply_all``): more take
# fewer statements in all, and hold their nodes' locks, which heartbeats wait on, longer.
PLACE_BATCH = 100


@dataclass(frozen=True)
class WholeRead:
    """A pass that read the whole queue and whose reasons were written: in which term of
    the lease, when (``time.monotonic``, and the pass's time), how many open jobs it
    found, and the reason the queued jobs of each ask (``job_ask``) were told: by it, or,
    for an ask first seen since, by the pass that explained its first jobs."""

    term: int
    at: float
    open_jobs: int
    now: datetime
    told: dict[Ask, str]


class Reconciler:
    """Runs ``plan`` against the database and applies the actions: every ``interval``, or
    after a wake, and after each pass no sooner than its rest (``rest_after``)."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        settings: ControllerSettings,
        clock: Callable[[], datetime] = utcnow,
        metrics: ReconcilerMetrics | None = None,
        signals: PassSignals | None = None,
        after_pass: Callable[[list[int]], None] | None = None,
    ) -> None:
        self._factory = factory
        self._metrics = metrics
        # Called after each pass of the loop with the tickets it answers (``PassSignals.ask``):
        # the reconciler's own process sends them, and its metrics, to the controller then.
        self._after_pass = after_pass
        self._settings = settings
        self._clock = clock
        self._signals = PassSignals() if signals is None else signals
        self._thread: threading.Thread | None = None
        self._leadership: Leadership | None = None
        # Set when this controller takes the lease, and again after a pass that
        # came late (``stalled``): heartbeats sent while no controller acted, or
        # while this one was starved, may not have been recorded, so a node's
        # silence counts from then at the earliest.
        self._leading_since = clock()
        self._last_pass: datetime | None = None  # wall time of the loop's last pass
        self._specs: SpecCache = {}  # the open jobs' specs, read once each
        self._views = ViewCache()  # the last pass's views of the nodes and placed jobs
        # The last whole read of the queue; its ``told`` holds what the PENDING jobs ask
        # (at least): the asks of that read, and of every job read since (``_with_queue``).
        self._whole_read: WholeRead | None = None
        self.place_batch = PLACE_BATCH
        # How old the lease was as the last pass began (0: that pass renewed it).
        self.lease_age_s = 0.0

    @property
    def is_leader(self) -> bool:
        return self._leadership is not None

    def run_once(self) -> list[Action]:
        """One pass: renew (or take) the lease, then plan and apply; a standby does nothing.
        A leader's pass is timed into ``relaunch_reconcile_pass_seconds``, lease included."""
        started = time.perf_counter()
        phase = _PhaseTimer(self._metrics)
        now = self._clock()
        node_timeout = timedelta(seconds=self._settings.node_timeout_s)
        leadership = self._lead(now)
        if self._metrics is not None:
            self._metrics.leader.set(0 if leadership is None else 1)
        if leadership is None:
            return []
        phase.done("lease")
        actions = self._plan_and_apply(leadership, now, node_timeout, phase)
        if self._metrics is not None:
            self._metrics.reconcile_pass.observe(time.perf_counter() - started)
            self._metrics.leader.set(0 if self._leadership is None else 1)
            for action in actions:
                self._metrics.reconcile_actions.labels(type(action).__name__).inc()
        return actions

    def _plan_and_apply(
        self, leadership: Leadership, now: datetime, node_timeout: timedelta, phase: _PhaseTimer
    ) -> list[Action]:
        share = self._settings.share_gpu_nodes_across_users
        with transaction(self._factory) as session:
            nodes, placed = read_fleet(
                session,
                self._specs,
                self._settings.heartbeat_interval_s,
                self._leading_since,
                self._views,
            )
            fleet = Fleet(now, nodes, node_timeout)
            phase.done("fleet")
            jobs, whole = self._with_queue(session, leadership, now, fleet, placed)
        phase.done("queue")
        actions = plan(now, nodes, jobs, node_timeout, share, fleet)
        phase.done("plan")
        self._apply_all(leadership, actions, now)
        phase.done("apply")
        phase.ended()
        if whole is not None and self._leadership is not None:
            self._whole_read = whole  # the reasons it decided are written
        if self._metrics is not None:
            self._metrics.reconcile_queue_reads.labels("whole" if whole else "head").inc()
        phase.describe_slow(
            self._settings.reconcile_interval_s, len(nodes), len(jobs), actions, whole is not None
        )
        return actions

    def _with_queue(
        self,
        session: Session,
        leadership: Leadership,
        now: datetime,
        fleet: Fleet,
        placed: list[JobView],
    ) -> tuple[list[JobView], WholeRead | None]:
        """``placed`` and the queue, as far as this pass needs it: its jobs decide the
        same placements, and every job in it left unread already says why it waits.

        The whole queue is read when it may hold a reason that is no longer right: on
        this controller's first pass of a term, when the alive nodes changed so that some
        ask's reason (``Reasons``) is no longer the one its jobs were told (no sooner than
        ``SHAPE_READ_EVERY_S`` after the last whole read: a reason may lag the nodes that
        long, a placement never), at least every ``WHOLE_READ_EVERY_S``, and when the
        specs kept have grown well past the open jobs. A node lost or back that changes
        no reason (a deep queue of jobs that fit any node, on a fleet of alike nodes) reads
        no more of the queue than any other pass. Otherwise the jobs that
        do not yet say why they wait (new ones) are read, for ``plan`` to explain, and
        the queue is read oldest first, a page at a time (the first of twice as many jobs
        as the room has openings, from ``FIRST_PAGE_MIN`` to ``QUEUE_PAGE``; then
        ``QUEUE_PAGE``, doubling), up
        to where the room the jobs read leave takes none of the asks (``job_ask``) of the
        queue: those of the last whole read and of every job read since, a set that
        holds every PENDING job's. No job after that point could be placed (``plan``
        takes them oldest first, and a room only shrinks). Returns the jobs and, for a
        whole read, what to remember of it once its pass is applied.
        """
        share = self._settings.share_gpu_nodes_across_users
        last = self._whole_read
        reasons = fleet.reasons
        if (
            last is None
            or last.term != leadership.term
            or (
                now - last.now >= timedelta(seconds=SHAPE_READ_EVERY_S)
                and any(reasons.of_ask(ask) != told for ask, told in last.told.items())
            )
            or time.monotonic() - last.at > WHOLE_READ_EVERY_S
            or len(self._specs) > 2 * last.open_jobs + QUEUE_PAGE
        ):
            at = time.monotonic()
            queue = read_queue(session, self._specs)
            return self._read_whole(leadership, reasons, at, now, placed, queue)

        def telling(jobs: list[JobView]) -> None:
            """``jobs`` are read, and those that do not yet say why they wait will be told
            this pass's reason: their asks count from here on, and an ask new since the
            last whole read is told that reason (one told another before keeps it: the
            older jobs still say that)."""
            for job in jobs:
                ask = job_ask(job, share)
                last.told.setdefault(ask, reasons.of_ask(ask))

        new = read_queue(session, self._specs, unexplained=True)
        telling(new)
        gpu_nodes = reasons.gpu_nodes
        head: list[JobView] = []
        page = 0  # sized to the room once it is known
        while True:
            # The room the jobs queued up to the last one read leave (none read: the room
            # the running attempts leave); a WAITING job queued after it does not come
            # before the jobs not read.
            upto = queue_key(head[-1]) if head else None
            before = [
                j
                for j in placed
                if not j.state.is_placeable() or (upto is not None and queue_key(j) <= upto)
            ]
            room = room_left(now, fleet, before + head, share)
            if room.is_full() or not takes_any(room, last.told, gpu_nodes):
                break
            # A job placed takes an opening at least: a first page of twice as many jobs
            # as there are openings is most often all a pass needs. One that was not (its
            # jobs did not fit) is followed by pages as before: QUEUE_PAGE, doubling.
            if page == 0:
                page = min(QUEUE_PAGE, max(FIRST_PAGE_MIN, 2 * room.openings()))
            else:
                page = max(QUEUE_PAGE, page * 2)
            read = read_queue(session, self._specs, after=upto, limit=page)
            head += read
            # A job submitted since the new ones were read may be among them (read again,
            # it no longer says nothing).
            telling(read)
            if len(read) < page:  # the whole queue after all
                return self._read_whole(leadership, reasons, time.monotonic(), now, placed, head)
        seen = {job.id for job in head}
        return placed + head + [j for j in new if j.id not in seen], None

    def _read_whole(
        self,
        leadership: Leadership,
        reasons: Reasons,
        at: float,
        now: datetime,
        placed: list[JobView],
        queue: list[JobView],
    ) -> tuple[list[JobView], WholeRead]:
        """What ``_with_queue`` returns once it has read the whole ``queue`` (begun at
        ``at``): the asks and the specs kept become those of the open jobs, each ask told
        its reason on these nodes (``plan`` tells every job not placed so)."""
        share = self._settings.share_gpu_nodes_across_users
        jobs = placed + queue
        _keep_specs(self._specs, jobs)
        told = {ask: reasons.of_ask(ask) for ask in {job_ask(job, share) for job in queue}}
        return jobs, WholeRead(leadership.term, at, len(jobs), now, told)

    def _apply_all(self, leadership: Leadership, actions: list[Action], now: datetime) -> None:
        """Apply the actions in order, each in a transaction of its own, except: each run of
        ``PlaceJob``s is applied in batches of up to ``place_batch`` (``place_jobs``, a few
        statements a batch), and the ``ExplainWait``s are written last, together, in one
        (``explain_waiting_jobs``), so that neither a pass that places hundreds of jobs nor
        the reasons of a deep queue cost a few statements per job. A stale action is
        skipped; once the lease is lost, nothing more is applied. A pass that runs longer
        than half the lease extends it (``extend``)."""
        steps: list[Action | list[PlaceJob] | list[ExplainWait]] = []
        for action in actions:
            if isinstance(action, ExplainWait):
                continue
            last = steps[-1] if steps else None
            if isinstance(action, PlaceJob):
                if isinstance(last, list) and len(last) < self.place_batch:
                    cast(list[PlaceJob], last).append(action)
                else:
                    steps.append([action])
            else:
                steps.append(action)
        explanations = [a for a in actions if isinstance(a, ExplainWait)]
        if explanations:
            steps.append(explanations)
        # Half the lease before it runs out, the next step extends it as it acts.
        lease_s = self._settings.leader_lease_s
        share = self._settings.share_gpu_nodes_across_users
        todo = deque(steps)
        while todo:
            step = todo.popleft()
            skipped: dict[int, str] = {}
            try:
                with transaction(self._factory) as session:
                    at = self._clock()
                    if at < leadership.expires_at - timedelta(seconds=lease_s / 2):
                        hold(session, leadership, at)
                        extended = None
                    else:
                        extended = extend(session, leadership, at, lease_s)
                    if not isinstance(step, list):
                        self.apply(session, step, now)
                    elif isinstance(step[0], PlaceJob):
                        skipped = place_jobs(session, cast(list[PlaceJob], step), now, share)
                    else:
                        self._explain(session, cast(list[ExplainWait], step), now)
                if extended is not None:  # committed
                    leadership = self._leadership = extended
            except LeaseLost as exc:
                logger.warning("controller %s stops acting: %s", leadership.holder, exc)
                self._leadership = None
                break
            except StaleState as exc:
                logger.info("skipped %s: %s", step, exc)
            except SQLAlchemyError:
                if not (isinstance(step, list) and isinstance(step[0], PlaceJob) and len(step) > 1):
                    raise
                # A deadlock, a lock timeout, a row no check foresaw: the batch is rolled
                # back whole; its placements are tried again one a transaction, so that one
                # bad placement does not hold back the others.
                logger.exception("a batch of %d placements failed; one at a time", len(step))
                todo.extendleft([a] for a in reversed(step))
            for job_id, why in skipped.items():
                logger.info("skipped placing job %s: %s", job_id, why)

    def _explain(self, session: Session, actions: list[ExplainWait], now: datetime) -> None:
        reasons = {a.job_id: (a.state, a.reason) for a in actions}
        written = set(explain_waiting_jobs(session, reasons, now))
        for action in actions:
            if action.job_id not in written:
                logger.info(
                    "skipped %s: job %s is no longer %s or already says why it waits",
                    action,
                    action.job_id,
                    action.state,
                )

    def _lead(self, now: datetime) -> Leadership | None:
        """The lease, renewed (or taken) unless this controller renewed it less than
        ``LEASE_RENEW_AFTER`` of the lease ago: until it expires no other controller can take
        it, and every transaction a pass applies still checks it (``hold``), so a fresh lease
        costs a pass no round trip. None: another controller holds it."""
        held = self._leadership
        lease = timedelta(seconds=self._settings.leader_lease_s)
        if held is not None:
            age = now - (held.expires_at - lease)
            # A negative age is a clock stepped back: renewed, the lease counts from it.
            if timedelta(0) <= age < lease * LEASE_RENEW_AFTER:
                self.lease_age_s = age.total_seconds()
                return held
        self.lease_age_s = 0.0
        me = self._settings.controller_id
        with transaction(self._factory) as session:
            leadership = acquire(session, me, now, self._settings.leader_lease_s)
        if leadership is None:
            if self._leadership is not None:
                logger.warning("controller %s lost the lease; standing by", me)
            self._leadership = None
            return None
        if self._leadership is None or self._leadership.term != leadership.term:
            logger.info("controller %s leads (term %d)", me, leadership.term)
            self._leading_since = now
        self._leadership = leadership
        return leadership

    def apply(self, session: Session, action: Action, now: datetime) -> None:
        if isinstance(action, MarkNodeLost):
            mark_lost(session, action.node_id, action.seen_before, now)
        elif isinstance(action, PlaceJob):
            self._place(session, action, now)
        elif isinstance(action, AddMembers):
            self._add_members(session, action, now)
        elif isinstance(action, WaitForNodes):
            self._wait_for_nodes(session, action, now)
        elif isinstance(action, GiveUpWaiting):
            self._give_up_waiting(session, action, now)
        elif isinstance(action, ExplainWait):
            job = get_job(session, action.job_id, for_update=True)
            explain_waiting(session, job, action.state, action.reason, now)

    def _place(self, session: Session, action: PlaceJob, now: datetime) -> None:
        share = self._settings.share_gpu_nodes_across_users
        skipped = place_jobs(session, [action], now, share)
        if skipped:
            raise StaleState(skipped[action.job_id])

    def _add_members(self, session: Session, action: AddMembers, now: datetime) -> None:
        job = get_job(session, action.job_id, for_update=True)
        attempt = session.get(Attempt, action.attempt_id)
        if not job.state.is_active() or attempt is None or attempt.state.is_terminal():
            raise StaleState(f"job {job.id} is no longer running attempt {action.attempt_id}")
        device = stored_device(attempt.device)
        if (device == "cuda") != bool(action.gpus):
            raise StaleState(f"attempt {attempt.id} runs on {device}; the action assumed not")
        room = lock_room(session, action.node_ids)
        share = self._settings.share_gpu_nodes_across_users
        nodes = room.check(action.node_ids, device, action.gpus, job.owner_id, share, attempt.id)
        if device == "cpu" and any(node.gpus for node in nodes):
            raise StaleState(f"attempt {attempt.id} on cpu grows only onto nodes without GPUs")
        gpus = dict(zip(action.node_ids, action.gpus, strict=True)) if action.gpus else {}
        for node in nodes:
            add_member(session, attempt, node, now, gpus.get(node.id, ()))
            if attempt.world_size is None:
                # No rendezvous has completed yet: the node is part of the first
                # world, as if placed with the others; nothing re-forms.
                add_event(
                    session,
                    job.id,
                    "node_joined",
                    f"node {node.name} joins attempt {attempt.number} before its first "
                    "rendezvous (not a membership change)",
                    now,
                    attempt_id=attempt.id,
                    node_id=node.id,
                    data={"cause": "placed"},
                )
                continue
            changes = count_membership_change(session, job.id)
            add_event(
                session,
                job.id,
                "node_joined",
                f"node {node.name} joins attempt {attempt.number}; the workers re-form "
                f"at the larger world size (membership change {changes}, "
                "not counted as a restart)",
                now,
                attempt_id=attempt.id,
                node_id=node.id,
                data={"cause": "node_joined"},
            )

    def _wait_for_nodes(self, session: Session, action: WaitForNodes, now: datetime) -> None:
        job = get_job(session, action.job_id, for_update=True)
        attempt = session.get(Attempt, action.attempt_id)
        if attempt is None or attempt.state is not AttemptState.RUNNING:
            raise StaleState(f"attempt {action.attempt_id} is no longer running")
        spec = job.job_spec
        live = [m for m in active_members(session, attempt.id) if m.node.state is NodeState.ALIVE]
        if len(live) >= spec.min_nodes:
            raise StaleState(f"attempt {attempt.id} has MIN live members again")
        end_attempt(
            session, attempt, AttemptState.STOPPED, now, f"fewer than {spec.min_nodes} nodes left"
        )
        change_job_state(session, job, JobState.WAITING, now, message="waiting for nodes")
        job.waiting_since, job.not_before = now, None
        add_event(
            session,
            job.id,
            "waiting_for_nodes",
            f"{len(live)} node(s) of attempt {attempt.number} left, fewer than MIN "
            f"{spec.min_nodes}; the job waits up to {spec.wait_for_nodes_s:g} s for nodes and "
            "resumes from its newest snapshot (not counted as a restart)",
            now,
            attempt_id=attempt.id,
            data={"cause": "below_min", "deadline_s": spec.wait_for_nodes_s},
        )

    def _give_up_waiting(self, session: Session, action: GiveUpWaiting, now: datetime) -> None:
        job = get_job(session, action.job_id, for_update=True)
        if job.state is not JobState.WAITING or job.waiting_since != action.waiting_since:
            raise StaleState(f"job {job.id} is no longer waiting since {action.waiting_since}")
        spec = job.job_spec
        why = f"fewer than {spec.min_nodes} nodes for {spec.wait_for_nodes_s:g} s"
        change_job_state(session, job, JobState.FAILED, now, message=why)
        add_event(session, job.id, "failed", f"job failed: {why}", now)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.loop, name="reconciler", daemon=True)
        self._thread.start()

    def wake(self, wait_s: float = 0.0) -> bool:
        """Begin the next pass without waiting for the interval (a job was submitted, a
        node registered); with ``wait_s``, wait for it to end (``PassSignals.wake``).
        Safe from any thread."""
        return self._signals.wake(wait_s)

    def stop(self) -> None:
        """Stop the loop and hand the lease back, so a standby takes over at once."""
        self._signals.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._leadership is None:
            return
        try:
            with transaction(self._factory) as session:
                release(session, self._settings.controller_id, self._clock())
        except Exception:
            logger.exception("could not release the lease; a standby waits for it to expire")
        self._leadership = None

    def note_pass(self, wall: datetime) -> None:
        """Called by the loop before each pass with the wall time: after a stall (``stalled``)
        a node's silence counts from now, as after a takeover."""
        if stalled(self._last_pass, wall, timedelta(seconds=self._settings.node_timeout_s)):
            logger.warning(
                "controller %s: no reconciler pass for %s (overloaded?); nodes' silence "
                "counts from now",
                self._settings.controller_id,
                wall - self._last_pass if self._last_pass else None,
            )
            self._leading_since = self._clock()
        self._last_pass = wall

    def loop(self) -> None:
        """Pass after pass until stopped, each followed by its rest (``rest_after``) and
        then by the rest of the interval unless woken. ``start`` runs it on a thread."""
        signals = self._signals
        while not signals.stop.is_set():
            tickets = signals.begin()
            self.note_pass(utcnow())
            started, cpu_started = time.monotonic(), time.thread_time()
            try:
                self.run_once()
            except Exception:
                logger.exception("reconciler pass failed; retrying")
            signals.end()
            if self._after_pass is not None:
                self._after_pass(tickets)
            settings = self._settings
            interval = settings.reconcile_interval_s
            rest = rest_after(
                time.monotonic() - started,
                time.thread_time() - cpu_started,
                settings.reconcile_max_share,
                interval,
                settings.leader_lease_s,
                settings.node_timeout_s,
                self.lease_age_s,
            )
            signals.rest(rest, interval)
