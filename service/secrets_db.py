"""The database's side of env encryption: the check at start, and key rotation."""

from __future__ import annotations

import logging

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from service.db import transaction
from service.models import Job
from service.secrets import Keyring, SecretsKeyError, is_sealed, open_env, resealed
from service.states import TERMINAL_JOB_STATES

logger = logging.getLogger(__name__)

# At start, besides every unfinished job: the newest jobs with env values, this many.
CHECK_NEWEST = 100
BATCH = 200


def check_database(factory: sessionmaker[Session], keyring: Keyring) -> None:
    """Refuse to start when the keys cannot open what the database holds.

    Checked: every unfinished job (its nodes will be sent its env) and the newest
    ``CHECK_NEWEST`` jobs that have env values. A key file this start made is removed
    again on failure, so the right key can be put in its place. Raises
    ``SecretsKeyError``."""
    try:
        with transaction(factory) as session:
            unfinished = select(Job.spec).where(Job.state.not_in(TERMINAL_JOB_STATES))
            for stored in session.scalars(unfinished):
                open_env(keyring, stored)
            _check_newest(session, keyring)
    except SecretsKeyError as exc:
        if keyring.made_file is not None:
            keyring.made_file.unlink(missing_ok=True)
            raise SecretsKeyError(
                f"{exc}. No key file was there, so this start made one; it does not open "
                "what the database holds, and was removed again"
            ) from None
        raise


def _check_newest(session: Session, keyring: Keyring) -> None:
    opened = 0
    before = None
    while opened < CHECK_NEWEST:
        query = select(Job.id, Job.spec).order_by(Job.id.desc()).limit(BATCH)
        if before is not None:
            query = query.where(Job.id < before)
        rows = session.execute(query).all()
        for _, stored in rows:
            if is_sealed(stored) and stored.get("env"):
                open_env(keyring, stored)
                opened += 1
        if len(rows) < BATCH:
            return
        before = rows[-1][0]


def rotate(factory: sessionmaker[Session], keyring: Keyring) -> int:
    """Encrypt every stored env again with the first key (plaintext rows too); the
    number of jobs rewritten. Safe beside running controllers that hold the same keys:
    a spec is never written after submit but here, and each batch is one transaction.
    Raises ``SecretsKeyError`` (with nothing of that batch written) if a value opens
    with no key."""
    rewritten = 0
    after = 0
    while True:
        with transaction(factory) as session:
            rows = session.execute(
                select(Job.id, Job.spec).where(Job.id > after).order_by(Job.id).limit(BATCH)
            ).all()
            for job_id, stored in rows:
                if is_sealed(stored) and not stored.get("env"):
                    continue  # nothing to encrypt
                session.execute(
                    update(Job).where(Job.id == job_id).values(spec=resealed(keyring, stored))
                )
                rewritten += 1
        if len(rows) < BATCH:
            return rewritten
        after = rows[-1][0]
