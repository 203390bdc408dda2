"""The snapshot fence: each job's count of snapshot writers, and the workers' credential.

Every rank 0 takes the next writer token of its job when it starts (``take``) and
reads the newest (``current``) before each snapshot commit; one that is not the
newest was replaced and must not commit (``worker.runtime.fence``). Workers
prove which job they belong to with a worker token: a secret issued per
attempt membership, sent to the node in its ``Assignment`` and kept here only as
a sha256. It is valid while the membership is ACTIVE, and only for its own job.
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service import auth
from service.errors import Forbidden, StaleState, Unauthenticated
from service.models import Attempt, AttemptMember, SnapshotWriter
from service.states import MemberState

logger = logging.getLogger(__name__)

WORKER_TOKEN_PREFIX = "rlw_"


def issue_worker_token(session: Session, member_id: int) -> str:
    """A new secret for the workers of membership ``member_id``; it replaces the one
    issued before."""
    token = auth.new_token(WORKER_TOKEN_PREFIX)
    session.execute(
        update(AttemptMember)
        .where(AttemptMember.id == member_id)
        .values(worker_token_hash=auth.token_hash(token))
        .execution_options(synchronize_session=False)
    )
    return token


def check_worker(session: Session, token: str, job_id: int) -> None:
    """``Unauthenticated`` unless ``token`` is the worker token of an ACTIVE membership;
    ``Forbidden`` if that membership is of another job than ``job_id``."""
    owner = session.scalar(
        select(Attempt.job_id)
        .join(AttemptMember, AttemptMember.attempt_id == Attempt.id)
        .where(
            AttemptMember.worker_token_hash == auth.token_hash(token),
            AttemptMember.state == MemberState.ACTIVE,
        )
    )
    if owner is None:
        raise Unauthenticated("the worker token is unknown, or its attempt is over on its node")
    if owner != job_id:
        raise Forbidden(f"this worker token is not one of job {job_id}")


def take(session: Session, job_id: int) -> int:
    """The job's next writer token (1, 2, ...)."""
    for _ in range(2):
        token = session.scalar(
            update(SnapshotWriter)
            .where(SnapshotWriter.job_id == job_id)
            .values(token=SnapshotWriter.token + 1)
            .returning(SnapshotWriter.token)
            .execution_options(synchronize_session=False)
        )
        if token is not None:
            break
        try:
            with session.begin_nested():
                session.add(SnapshotWriter(job_id=job_id, token=1))
            token = 1
            break
        except IntegrityError:
            continue  # another rank 0 took the first one
    else:
        raise StaleState(f"the snapshot writer of job {job_id} kept changing")
    logger.info("job=%s snapshot writer token %s taken", job_id, token)
    return int(token)


def current(session: Session, job_id: int) -> int:
    """The job's newest writer token; 0 if none was taken."""
    token = session.scalar(select(SnapshotWriter.token).where(SnapshotWriter.job_id == job_id))
    return int(token or 0)


def forget_job(session: Session, job_id: int) -> None:
    """The job has ended: its writer count goes."""
    session.execute(delete(SnapshotWriter).where(SnapshotWriter.job_id == job_id))
