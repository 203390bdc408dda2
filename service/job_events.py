"""A job's timeline: one ``JobEvent`` row for each thing that happened to it.

Every service module that changes a job writes here, so this module imports no
other service module but the tables.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from service.models import JobEvent

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
    logger.info("job=%s attempt_id=%s event %s: %s", job_id, attempt_id, kind, message)


def add_events(session: Session, kind: str, messages: Mapping[int, str], now: datetime) -> None:
    """One event of ``kind`` on the timeline of each job in ``messages`` (a job's id to
    its event's message), in one statement however many jobs."""
    if not messages:
        return
    rows = [
        {"job_id": job_id, "time": now, "kind": kind, "message": message, "data": {}}
        for job_id, message in messages.items()
    ]
    session.execute(insert(JobEvent), rows)
    for job_id, message in messages.items():
        logger.info("job=%s attempt_id=None event %s: %s", job_id, kind, message)


MEMBERSHIP_CHANGES = ("node_left", "node_joined")


def last_membership_change(session: Session, attempt_id: int) -> datetime | None:
    """When the attempt's members last changed (a node left or joined), as the timeline
    says; None if they never did."""
    return session.scalar(
        select(func.max(JobEvent.time)).where(
            JobEvent.attempt_id == attempt_id, JobEvent.kind.in_(MEMBERSHIP_CHANGES)
        )
    )


def last_round_event(session: Session, attempt_id: int, node_id: int) -> JobEvent | None:
    """The attempt's last ``rendezvous`` or ``first_step`` event from ``node_id``: whether
    the node's current rendezvous round already has its first step on the timeline."""
    return session.scalars(
        select(JobEvent)
        .where(
            JobEvent.attempt_id == attempt_id,
            JobEvent.node_id == node_id,
            JobEvent.kind.in_(("rendezvous", "first_step")),
        )
        .order_by(JobEvent.id.desc())
        .limit(1)
    ).first()
