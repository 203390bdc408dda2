"""Job service functions: the only code that changes a job's state.

Each takes an open session (the caller owns the transaction) and ``now``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any, TypeVar

from sqlalchemy import ScalarSelect, Select, bindparam, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.interfaces import ORMOption

from service import anatomy, fence, nodes
from service.attempts import end_attempt, running_attempt
from service.errors import IdempotencyMismatch, LimitReached, NotFound, StaleState
from service.job_events import add_event, add_events_alike
from service.models import (
    Attempt,
    AttemptMember,
    IdempotencyKey,
    Job,
    JobEvent,
    LogEntry,
    Metric,
    Node,
    Role,
    Snapshot,
    User,
)
from service.secrets import Keyring, seal_spec
from service.spec import JobSpec, parse_nnodes
from service.states import TERMINAL_JOB_STATES, JobState
from service.transitions import transition

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What one user's unfinished jobs may hold at once."""

    active_jobs: int
    nodes: int


def spec_digests(spec: JobSpec, keyring: Keyring) -> list[str]:
    """What a spec's digest may be, the one to store first: the same spec gives the same
    digests, however its JSON was spaced or ordered. Keyed (HMAC) with each key, since
    the spec holds the env's values in the clear; the unkeyed sha256 last, as digests
    were stored before."""
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return [*keyring.digests(canonical.encode()), hashlib.sha256(canonical.encode()).hexdigest()]


def submit_job(
    session: Session,
    spec: JobSpec,
    owner: User,
    now: datetime,
    limits: Limits,
    keyring: Keyring,
    idempotency_key: str | None = None,
) -> tuple[Job, bool]:
    """A new PENDING job of ``owner``; returns it and whether it was made now. Its
    env values are stored encrypted with ``keyring``'s first key.

    With ``idempotency_key``, a key this user sent before with the same spec
    gives back that job (``False``); with another spec it raises
    ``IdempotencyMismatch``. Two submits racing with one key: the unique key
    row lets one commit, and the other raises ``StaleState``; run again (as
    ``retry_on_stale`` does), it finds the first one's job.
    """
    # Lock the owner's row: their submits run one at a time, so two cannot both
    # pass the limits below, which are read from this row (the caller's copy may be
    # a few seconds old: ``auth.CredentialCache``).
    owner = session.scalars(select(User).where(User.id == owner.id).with_for_update()).one()
    digests = spec_digests(spec, keyring)
    if idempotency_key is not None:
        earlier = session.scalars(
            select(IdempotencyKey).where(
                IdempotencyKey.user_id == owner.id, IdempotencyKey.key == idempotency_key
            )
        ).one_or_none()
        if earlier is not None:
            if earlier.body_sha256 not in digests:
                raise IdempotencyMismatch(
                    f"Idempotency-Key {idempotency_key!r} was used for job {earlier.job_id} "
                    "with a different body; use a new key for a new job"
                )
            return get_job(session, earlier.job_id), False
    _check_limits(session, owner, spec, limits)
    job = Job(
        name=spec.name,
        owner_id=owner.id,
        spec=seal_spec(keyring, spec.model_dump(mode="json")),
        state=JobState.PENDING,
        created_at=now,
        updated_at=now,
        attempt_count=0,
        restart_count=0,
        membership_changes=0,
        message="",
    )
    session.add(job)
    session.flush()
    if idempotency_key is not None:
        session.add(
            IdempotencyKey(
                user_id=owner.id,
                key=idempotency_key,
                body_sha256=digests[0],
                job_id=job.id,
                created_at=now,
            )
        )
        try:
            session.flush()
        except IntegrityError as exc:
            raise StaleState(f"Idempotency-Key {idempotency_key!r} was just used") from exc
    add_event(session, job.id, "submitted", f"job {job.name!r} submitted by {owner.name}", now)
    logger.info("job=%s submitted name=%s owner=%s", job.id, job.name, owner.name)
    return job, True


def _check_limits(session: Session, owner: User, spec: JobSpec, limits: Limits) -> None:
    max_jobs = owner.max_active_jobs or limits.active_jobs
    max_nodes = owner.max_nodes or limits.nodes
    specs = session.scalars(
        select(Job.spec).where(Job.owner_id == owner.id, Job.state.not_in(TERMINAL_JOB_STATES))
    ).all()
    if len(specs) >= max_jobs:
        raise LimitReached(
            f"user {owner.name!r} has {len(specs)} unfinished jobs, the limit is {max_jobs}; "
            "wait for one to finish or cancel one"
        )
    held = sum(parse_nnodes(str(s.get("nnodes", "1")))[1] for s in specs)
    if held + spec.max_nodes > max_nodes:
        raise LimitReached(
            f"user {owner.name!r} has jobs that may hold {held} nodes; this one may take "
            f"{spec.max_nodes} more, the limit is {max_nodes}; lower nnodes MAX or wait"
        )


# Built once: building a statement costs more than running it.
_JOB = select(Job).where(Job.id == bindparam("job_id"))
_JOB_FOR_UPDATE = _JOB.with_for_update()


def get_job(session: Session, job_id: int, *, for_update: bool = False) -> Job:
    stmt = _JOB_FOR_UPDATE if for_update else _JOB
    job = session.scalars(stmt, {"job_id": job_id}).one_or_none()
    if job is None:
        raise NotFound(f"job {job_id} does not exist")
    return job


def _visible(stmt: Select[Any], viewer: User) -> Select[Any]:
    """Only the viewer's own jobs, unless the viewer is an admin."""
    return stmt if viewer.role is Role.ADMIN else stmt.where(Job.owner_id == viewer.id)


def job_for(session: Session, job_id: int, viewer: User, *, for_update: bool = False) -> Job:
    """Job ``job_id`` as ``viewer`` may see it. Another user's job is NotFound, the same
    answer as a job that does not exist, so ids of others' jobs are not revealed."""
    job = get_job(session, job_id, for_update=for_update)
    if viewer.role is not Role.ADMIN and job.owner_id != viewer.id:
        raise NotFound(f"job {job_id} does not exist")
    return job


def _listed(stmt: Select[Any], viewer: User, state: JobState | None) -> Select[Any]:
    stmt = _visible(stmt, viewer)
    return stmt if state is None else stmt.where(Job.state == state)


def list_jobs(
    session: Session, viewer: User, state: JobState | None, limit: int, offset: int
) -> tuple[list[Job], int]:
    stmt = _listed(select(Job), viewer, state)
    count = _listed(select(func.count()).select_from(Job), viewer, state)
    jobs = session.scalars(stmt.order_by(Job.id.desc()).limit(limit).offset(offset)).all()
    return list(jobs), session.scalar(count) or 0


# What a job's answer (``JobPublic``) is built from, besides its spec, which never changes
# after submit: the row's other columns, its owner's name, and what ``last_snapshot_times``
# and ``last_step_times`` read (metrics are only ever added, so their ids stand for them).
# Plain table columns and statements built once: these are read on every poll, and an
# ORM statement built per call costs more than running it.
_jobs, _users = Job.__table__.c, User.__table__.c
_snapshots, _metrics = Snapshot.__table__.c, Metric.__table__.c
_attempts, _members, _nodes = Attempt.__table__.c, AttemptMember.__table__.c, Node.__table__.c


def _newest_metric(newer: int) -> ScalarSelect[Any]:
    """The id of the job's metric ``newer`` places before its newest (0: the newest), by
    ``ix_metrics_job_id_id``; for a statement that reads ``jobs``."""
    return (
        select(_metrics.id)
        .where(_metrics.job_id == _jobs.id)
        .order_by(_metrics.id.desc())
        .limit(1)
        .offset(newer)
        .scalar_subquery()
    )


_JOB_SHOWN = select(
    *(column for column in _jobs if column.key != "spec"),
    _users.name.label("owner_name"),
    select(func.max(_snapshots.created_at))
    .where(_snapshots.job_id == _jobs.id)
    .scalar_subquery()
    .label("last_snapshot_at"),
    *(_newest_metric(newer).label(f"metric_{newer}") for newer in (0, 1)),
).select_from(Job.__table__.outerjoin(User.__table__, _users.id == _jobs.owner_id))
_JOB_VERSION = _JOB_SHOWN.where(_jobs.id == bindparam("job_id"))
# And what its attempts (``AttemptPublic``) are built from.
_ATTEMPTS_VERSION = (
    select(
        *(_attempts[name] for name in ("id", "number", "rdzv_id", "state", "device")),
        *(_attempts[name] for name in ("world_size", "created_at", "ended_at", "result")),
        *(_members[name] for name in ("id", "node_id", "state", "joined_at", "left_at")),
        _members.exit_code,
        _members.gpus,
        _nodes.name,
    )
    .select_from(
        Attempt.__table__.outerjoin(
            AttemptMember.__table__, _members.attempt_id == _attempts.id
        ).outerjoin(Node.__table__, _nodes.id == _members.node_id)
    )
    .where(_attempts.job_id == bindparam("job_id"))
    .order_by(_attempts.id, _members.id)
)


@cache
def _page_version(everyone: bool, one_state: bool) -> tuple[Select[Any], Select[Any]]:
    """A page of ``list_jobs`` and its count, as ``jobs_version`` reads them."""
    page = _JOB_SHOWN.order_by(_jobs.id.desc())
    count = select(func.count()).select_from(Job.__table__)
    if not everyone:
        page = page.where(_jobs.owner_id == bindparam("owner_id"))
        count = count.where(_jobs.owner_id == bindparam("owner_id"))
    if one_state:
        page = page.where(_jobs.state == bindparam("state"))
        count = count.where(_jobs.state == bindparam("state"))
    return page.limit(bindparam("limit")).offset(bindparam("offset")), count


def job_version(session: Session, job_id: int, viewer: User) -> tuple[Any, ...]:
    """Every stored value that job ``job_id``'s detail shows (but its spec), read in two
    statements, and for a job that waits for nodes the node counts it shows, in a third:
    equal versions give equal details. Raises ``NotFound`` as ``job_for`` does,
    for a job the viewer may not see as for one that does not exist."""
    connection = session.connection()
    row = connection.execute(_JOB_VERSION, {"job_id": job_id}).one_or_none()
    if row is None or (viewer.role is not Role.ADMIN and row.owner_id != viewer.id):
        raise NotFound(f"job {job_id} does not exist")
    attempts = connection.execute(_ATTEMPTS_VERSION, {"job_id": job_id}).all()
    # A job that waits for nodes shows the alive and idle nodes as they are now.
    now = nodes.alive_and_idle(session) if JobState(row.state).is_placeable() else None
    return tuple(row), tuple(tuple(a) for a in attempts), now


def jobs_version(
    session: Session, viewer: User, state: JobState | None, limit: int, offset: int
) -> tuple[Any, ...]:
    """Every stored value that this page of ``list_jobs`` shows (but the specs), read in
    two statements: equal versions give equal pages."""
    page, count = _page_version(viewer.role is Role.ADMIN, state is not None)
    params = {"owner_id": viewer.id, "state": state, "limit": limit, "offset": offset}
    connection = session.connection()
    rows = connection.execute(page, params).all()
    total = connection.execute(count, params).scalar()
    return tuple(tuple(r) for r in rows), total


def change_job_state(
    session: Session, job: Job, new: JobState, now: datetime, message: str | None = None
) -> None:
    """Move ``job`` to ``new`` if the lifecycle allows it and nobody moved it first.

    Raises ``InvalidTransition`` for a change the table forbids, ``StaleState``
    when the row's state is no longer the one ``job`` was read with.
    """
    old = job.state
    values: dict[str, Any] = {"updated_at": now}
    if message is not None:
        values["message"] = message
    if new is JobState.RUNNING and job.started_at is None:
        values["started_at"] = now
    if new.is_terminal():
        values["finished_at"] = now
    if not transition(session, job, new, **values):
        raise StaleState(f"job {job.id} is no longer {old}")
    if new.is_terminal():
        fence.forget_job(session, job.id)
    logger.info("job=%s state %s -> %s", job.id, old, new)


# The most job ids one statement names: both databases take far more bound parameters
# (SQLite 32,766, PostgreSQL 65,535), so up to this many jobs cost one statement.
MAX_IDS_PER_STATEMENT = 10_000


def chunked(ids: Sequence[int]) -> list[Sequence[int]]:
    """``ids`` in runs of at most ``MAX_IDS_PER_STATEMENT``."""
    return [
        ids[first : first + MAX_IDS_PER_STATEMENT]
        for first in range(0, len(ids), MAX_IDS_PER_STATEMENT)
    ]


def explain_waiting_jobs(
    session: Session, reasons: Mapping[int, tuple[JobState, str]], now: datetime
) -> list[int]:
    """Make each reason the message of its job, a job that waits to be placed, and put it
    on the job's timeline; ``reasons`` maps a job's id to the state it waits in and why.

    Compare-and-set on the rows, two statements for each reason (and state) however
    many jobs give it (and ``MAX_IDS_PER_STATEMENT`` at most in each): a job no
    longer in its state (placed, cancelled or failed meanwhile) or already saying its
    reason is left as it is, so two passes never record one reason twice. Returns the
    ids of the jobs written, in order.
    """
    if any(not state.is_placeable() for state, _ in reasons.values()):
        raise ValueError("only a job waiting to be placed has a waiting reason")
    jobs_by_reason: dict[tuple[JobState, str], list[int]] = {}
    for job_id in sorted(reasons):
        jobs_by_reason.setdefault(reasons[job_id], []).append(job_id)
    written: list[int] = []
    for (state, reason), ids in jobs_by_reason.items():
        for chunk in chunked(ids):
            stmt = (
                update(Job)
                .where(Job.id.in_(chunk), Job.state == state, Job.message != reason)
                .values(message=reason, updated_at=now)
                .returning(Job.id)
                .execution_options(synchronize_session=False)
            )
            changed = sorted(session.scalars(stmt))
            add_events_alike(session, changed, "waiting", reason, now)
            written += changed
    return sorted(written)


def explain_waiting(
    session: Session, job: Job, state: JobState, reason: str, now: datetime
) -> None:
    """Make ``reason`` the message of a job that waits to be placed, and put it on the timeline.

    Raises ``StaleState`` when the job is no longer in ``state`` (it was placed,
    cancelled or failed meanwhile) or already says ``reason``
    (``explain_waiting_jobs``, for one job).
    """
    if not state.is_placeable():
        raise ValueError(f"only a job waiting to be placed has a waiting reason, not {state}")
    if not explain_waiting_jobs(session, {job.id: (state, reason)}, now):
        raise StaleState(f"job {job.id} is no longer {state} or already says why it waits")
    set_committed_value(job, "message", reason)
    set_committed_value(job, "updated_at", now)


def cancel_job(session: Session, job_id: int, viewer: User, now: datetime) -> Job:
    """Cancel a job; cancelling a job that already ended changes nothing."""
    job = job_for(session, job_id, viewer, for_update=True)
    if job.state.is_terminal():
        return job
    change_job_state(session, job, JobState.CANCELLED, now, message=f"cancelled by {viewer.name}")
    attempt = running_attempt(session, job.id)
    if attempt is not None:
        end_attempt(session, attempt, "STOPPED", now, "job cancelled")
    add_event(session, job.id, "cancelled", "job cancelled; its nodes stop its processes", now)
    return job


Row = TypeVar("Row", JobEvent, Metric, LogEntry)


def _page_after(
    session: Session,
    model: type[Row],
    job_id: int,
    viewer: User,
    after_id: int,
    limit: int,
    *filters: Any,
    load: Sequence[ORMOption] = (),
) -> list[Row]:
    """A job's rows of ``model`` with ids above ``after_id``, oldest first (for polling)."""
    job_for(session, job_id, viewer)
    stmt = (
        select(model)
        .where(model.job_id == job_id, model.id > after_id, *filters)
        .order_by(model.id)
        .limit(limit)
        .options(*load)
    )
    return list(session.scalars(stmt))


def job_events(
    session: Session, job_id: int, viewer: User, after_id: int, limit: int
) -> list[JobEvent]:
    return _page_after(session, JobEvent, job_id, viewer, after_id, limit)


# The most timeline events ``job_recoveries`` reads: a job's code decides how often its
# workers fail, so its timeline may grow without bound.
MAX_RECOVERY_EVENTS = 500


def job_recoveries(session: Session, job_id: int, viewer: User) -> list[anatomy.Recovery]:
    """The job's restarts and re-forms with their phases, oldest first (see ``anatomy``):
    those among its last ``MAX_RECOVERY_EVENTS`` recovery events (causes, rendezvous,
    worker starts, a cancel); older recoveries are not shown."""
    job_for(session, job_id, viewer)
    kinds = (*anatomy.CAUSES, *anatomy.ENDS, "rendezvous", *anatomy.STARTUP_KINDS)
    rows = session.scalars(
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.kind.in_(kinds))
        .order_by(JobEvent.id.desc())
        .limit(MAX_RECOVERY_EVENTS)
    )
    return anatomy.recoveries(anatomy.from_rows(list(rows)[::-1]))


def job_metrics(
    session: Session, job_id: int, viewer: User, after_id: int, limit: int
) -> list[Metric]:
    return _page_after(session, Metric, job_id, viewer, after_id, limit)


def job_logs(
    session: Session,
    job_id: int,
    viewer: User,
    after_id: int,
    limit: int,
    local_rank: int | None = None,
    node_id: int | None = None,
) -> list[LogEntry]:
    filters = []
    if local_rank is not None:
        filters.append(LogEntry.local_rank == local_rank)
    if node_id is not None:
        filters.append(LogEntry.node_id == node_id)
    # Each line is shown with its node's name and the job's own attempt number.
    load = (selectinload(LogEntry.node), selectinload(LogEntry.attempt))
    return _page_after(session, LogEntry, job_id, viewer, after_id, limit, *filters, load=load)


def last_snapshot_times(session: Session, job_ids: list[int]) -> dict[int, datetime]:
    """When each of these jobs last committed a snapshot (jobs with none are left out)."""
    if not job_ids:
        return {}
    stmt = (
        select(Snapshot.job_id, func.max(Snapshot.created_at))
        .where(Snapshot.job_id.in_(job_ids))
        .group_by(Snapshot.job_id)
    )
    return {job_id: when for job_id, when in session.execute(stmt).all()}


# Each job's two newest metrics: their ids, then the metrics themselves. Two statements
# for a page of jobs, where one a job made a page of 50 cost 50.
_NEWEST_METRICS = select(_jobs.id, _newest_metric(0), _newest_metric(1)).where(
    _jobs.id.in_(bindparam("job_ids", expanding=True))
)
_METRICS_BY_ID = select(_metrics.id, _metrics.attempt_id, _metrics.time, _metrics.step).where(
    _metrics.id.in_(bindparam("ids", expanding=True))
)


def last_step_times(session: Session, job_ids: list[int]) -> dict[int, float]:
    """Each job's latest mean step time, in seconds: between its last two progress reports,
    when both came from the same attempt and the step moved on (others are left out)."""
    times: dict[int, float] = {}
    if not job_ids:
        return times
    connection = session.connection()
    pairs = [
        (job_id, last, earlier)
        for job_id, last, earlier in connection.execute(_NEWEST_METRICS, {"job_ids": job_ids})
        if earlier is not None
    ]
    if not pairs:
        return times
    ids = [metric_id for _, last, earlier in pairs for metric_id in (last, earlier)]
    metrics = {row.id: row for row in connection.execute(_METRICS_BY_ID, {"ids": ids})}
    for job_id, last, earlier in pairs:
        end, start = metrics[last], metrics[earlier]
        if end.attempt_id == start.attempt_id and end.step > start.step and end.time >= start.time:
            times[job_id] = (end.time - start.time).total_seconds() / (end.step - start.step)
    return times


def job_snapshots(
    session: Session, job_id: int, viewer: User, limit: int, offset: int
) -> list[Snapshot]:
    job_for(session, job_id, viewer)
    stmt = (
        select(Snapshot)
        .where(Snapshot.job_id == job_id)
        .order_by(Snapshot.step)
        .limit(limit)
        .offset(offset)
    )
    return list(session.scalars(stmt))
