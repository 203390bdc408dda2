"""Job service functions: the only code that changes a job's state.

Each takes an open session (the caller owns the transaction) and ``now``.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.errors import NotFound, StaleState
from service.models import Job, JobEvent, LogEntry, Metric, Snapshot
from service.schemas import JobSpec
from service.states import JOB_TRANSITIONS, JobState, check_transition

logger = logging.getLogger(__name__)


def submit_job(session: Session, spec: JobSpec, now: datetime) -> Job:
    job = Job(
        name=spec.name,
        spec=spec.model_dump(mode="json"),
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
    add_event(session, job.id, "submitted", f"job {job.name!r} submitted", now)
    logger.info("job=%s submitted name=%s", job.id, job.name)
    return job


def get_job(session: Session, job_id: int, *, for_update: bool = False) -> Job:
    stmt = select(Job).where(Job.id == job_id)
    if for_update:
        stmt = stmt.with_for_update()
    job = session.scalars(stmt).one_or_none()
    if job is None:
        raise NotFound(f"job {job_id} does not exist")
    return job


def list_jobs(
    session: Session, state: JobState | None, limit: int, offset: int
) -> tuple[list[Job], int]:
    stmt = select(Job)
    count = select(func.count()).select_from(Job)
    if state is not None:
        stmt = stmt.where(Job.state == state)
        count = count.where(Job.state == state)
    jobs = session.scalars(stmt.order_by(Job.id.desc()).limit(limit).offset(offset)).all()
    return list(jobs), session.scalar(count) or 0


def change_job_state(
    session: Session, job: Job, new: JobState, now: datetime, message: str | None = None
) -> None:
    """Move ``job`` to ``new`` if the lifecycle allows it and nobody moved it first.

    Raises ``InvalidTransition`` for a change the table forbids, ``StaleState``
    when the row's state is no longer the one ``job`` was read with.
    """
    old = job.state
    check_transition(JOB_TRANSITIONS, old, new)
    values: dict[str, Any] = {"state": new, "updated_at": now}
    if message is not None:
        values["message"] = message
    if new is JobState.RUNNING and job.started_at is None:
        values["started_at"] = now
    if new.is_terminal():
        values["finished_at"] = now
    result = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.state == old)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise StaleState(f"job {job.id} is no longer {old}")
    for key, value in values.items():
        setattr(job, key, value)
    logger.info("job=%s state %s -> %s", job.id, old, new)


def count_membership_change(session: Session, job_id: int) -> int:
    """Add one to the job's membership changes atomically; return the new count."""
    count = session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(membership_changes=Job.membership_changes + 1)
        .returning(Job.membership_changes)
        .execution_options(synchronize_session=False)
    ).scalar_one()
    job = session.get(Job, job_id)
    if job is not None:
        job.membership_changes = count
        session.flush()
    return int(count)


def cancel_job(session: Session, job_id: int, now: datetime) -> Job:
    """Cancel a job; cancelling a job that already ended changes nothing."""
    job = get_job(session, job_id, for_update=True)
    if job.state.is_terminal():
        return job
    change_job_state(session, job, JobState.CANCELLED, now, message="cancelled by user")
    from service.attempts import end_attempt, running_attempt  # avoid an import cycle

    attempt = running_attempt(session, job.id)
    if attempt is not None:
        end_attempt(session, attempt, "STOPPED", now, "job cancelled")
    add_event(session, job.id, "cancelled", "job cancelled; its nodes stop its processes", now)
    return job


def add_event(
    session: Session,
    job_id: int,
    kind: str,
    message: str,
    now: datetime,
    *,
    attempt_id: int | None = None,
    node_id: int | None = None,
    data: dict[str, Any] | None = None,
) -> None:
    session.add(
        JobEvent(
            job_id=job_id,
            attempt_id=attempt_id,
            node_id=node_id,
            time=now,
            kind=kind,
            message=message,
            data=data or {},
        )
    )
    logger.info("job=%s attempt=%s event %s: %s", job_id, attempt_id, kind, message)


Row = TypeVar("Row", JobEvent, Metric, LogEntry)


def _page_after(
    session: Session, model: type[Row], job_id: int, after_id: int, limit: int, *filters: Any
) -> list[Row]:
    """A job's rows of ``model`` with ids above ``after_id``, oldest first (for polling)."""
    get_job(session, job_id)
    stmt = (
        select(model)
        .where(model.job_id == job_id, model.id > after_id, *filters)
        .order_by(model.id)
        .limit(limit)
    )
    return list(session.scalars(stmt))


def job_events(session: Session, job_id: int, after_id: int, limit: int) -> list[JobEvent]:
    return _page_after(session, JobEvent, job_id, after_id, limit)


def job_metrics(session: Session, job_id: int, after_id: int, limit: int) -> list[Metric]:
    return _page_after(session, Metric, job_id, after_id, limit)


def job_logs(
    session: Session,
    job_id: int,
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
    return _page_after(session, LogEntry, job_id, after_id, limit, *filters)


def job_snapshots(session: Session, job_id: int) -> list[Snapshot]:
    get_job(session, job_id)
    stmt = select(Snapshot).where(Snapshot.job_id == job_id).order_by(Snapshot.step)
    return list(session.scalars(stmt))
