"""A job's timeline: one ``JobEvent`` row for each thing that happened to it.

Every service module that changes a job writes here, so this module imports no
other service module but the tables.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, func, insert, literal, select
from sqlalchemy.orm import Session

from service.models import Job, JobEvent, table_of

logger = logging.getLogger(__name__)


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
    """Put ``kind`` on job ``job_id``'s timeline, inserted now rather than at the session's
    next flush: event ids follow the order of the calls, with ``add_events``' too."""
    row = {
        "job_id": job_id,
        "attempt_id": attempt_id,
        "node_id": node_id,
        "time": now,
        "kind": kind,
        "message": message,
        "data": data or {},
    }
    session.execute(_INSERT_EVENT, row)
    logger.info("job=%s attempt_id=%s event %s: %s", job_id, attempt_id, kind, message)


def add_events(session: Session, events: Sequence[dict[str, Any]], now: datetime) -> None:
    """Events of ``add_event``'s keys (``job_id``, ``kind``, ``message`` and optionally
    ``attempt_id``, ``node_id``, ``data``), all at ``now``, inserted in one statement."""
    if not events:
        return
    rows = [{"attempt_id": None, "node_id": None, "data": {}, **e, "time": now} for e in events]
    session.execute(insert(JobEvent), rows)
    for e in rows:
        job_id, attempt_id, kind, message = e["job_id"], e["attempt_id"], e["kind"], e["message"]
        logger.info("job=%s attempt_id=%s event %s: %s", job_id, attempt_id, kind, message)


def add_events_alike(
    session: Session, job_ids: Sequence[int], kind: str, message: str, now: datetime
) -> None:
    """The same event on the timeline of each job in ``job_ids``: one statement however
    many jobs (``job_ids`` go into it as its parameters)."""
    if not job_ids:
        return
    rows = select(
        Job.id,
        literal(now, JobEvent.time.type),
        literal(kind, JobEvent.kind.type),
        literal(message, JobEvent.message.type),
        literal({}, JobEvent.data.type),
    ).where(Job.id.in_(job_ids))
    columns = ["job_id", "time", "kind", "message", "data"]
    session.execute(insert(JobEvent).from_select(columns, rows))
    for job_id in job_ids:
        logger.info("job=%s attempt_id=None event %s: %s", job_id, kind, message)


MEMBERSHIP_CHANGES = ("node_left", "node_joined")


def last_membership_change(session: Session, attempt_id: int) -> datetime | None:
    """When the attempt's members last changed (a node left or joined), as the timeline
    says; None if they never did."""
    return session.scalar(_LAST_MEMBERSHIP_CHANGE, {"attempt_id": attempt_id})


def last_event_id(
    session: Session, job_id: int, attempt_id: int, kind: str | None = None
) -> int | None:
    """The id of the attempt's newest timeline event (of ``kind``, if given); ids follow
    the order in which the controller recorded them. None if there is none."""
    params = {"job_id": job_id, "attempt_id": attempt_id}
    if kind is None:
        return session.scalar(_LAST_EVENT_ID, params)
    return session.scalar(_LAST_EVENT_ID_OF_KIND, {**params, "kind": kind})


def last_round_event(session: Session, attempt_id: int, node_id: int) -> JobEvent | None:
    """The attempt's last ``rendezvous`` or ``first_step`` event from ``node_id``: whether
    the node's current rendezvous round already has its first step on the timeline."""
    params = {"attempt_id": attempt_id, "node_id": node_id}
    return session.scalars(_LAST_ROUND_EVENT, params).first()


# Built once: building a statement costs more than running it.
_INSERT_EVENT = insert(table_of(JobEvent))
_LAST_MEMBERSHIP_CHANGE = select(func.max(JobEvent.time)).where(
    JobEvent.attempt_id == bindparam("attempt_id"), JobEvent.kind.in_(MEMBERSHIP_CHANGES)
)
_LAST_EVENT_ID = select(func.max(JobEvent.id)).where(
    JobEvent.job_id == bindparam("job_id"), JobEvent.attempt_id == bindparam("attempt_id")
)  # ix_job_events_job_id_id
_LAST_EVENT_ID_OF_KIND = _LAST_EVENT_ID.where(JobEvent.kind == bindparam("kind"))
_LAST_ROUND_EVENT = (
    select(JobEvent)
    .where(
        JobEvent.attempt_id == bindparam("attempt_id"),
        JobEvent.node_id == bindparam("node_id"),
        JobEvent.kind.in_(("rendezvous", "first_step")),
    )
    .order_by(JobEvent.id.desc())
    .limit(1)
)
