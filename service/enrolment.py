"""Enrolment: who may register a node.

A registering agent shows one of two credentials:

- the controller's shared enrolment token (``RELAUNCH_ENROLMENT_TOKEN``), if the
  controller has one: every node may register with it, under any name;
- a per-node enrolment token (``rle_...``) an admin made: it admits a
  registration while it is not revoked and not expired; a single-use one admits
  one registration only (consumed by compare-and-set, so of two registrations
  racing with it exactly one wins); one bound to a node name admits that name
  only.

Per-node tokens are the production way: each can be limited, expires, and is
revoked alone. Like every token here, only the sha256 of its text is kept.

Either credential only admits a registration; registering under the name of a
node that is ALIVE also needs that node's own token (``service.nodes``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from pydantic import SecretStr
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service import auth
from service.errors import Forbidden, NotFound, Unauthenticated
from service.models import EnrolmentToken, Node, User

logger = logging.getLogger(__name__)

ENROLMENT_TOKEN_PREFIX = "rle_"
WRONG = "the enrolment token is wrong"


@dataclass(frozen=True)
class Refusal:
    """Why a per-node token does not admit this registration; ``forbidden`` is a 403
    (a valid token for another name), otherwise a 401."""

    message: str
    forbidden: bool = False


def refusal(
    row: EnrolmentToken, name: str, now: datetime, *, retry: bool = False
) -> Refusal | None:
    """Whether ``row`` admits registering ``name`` at ``now``: None if it does. A
    ``retry`` of the registration that used a single-use token is admitted again.

    The order matters only for the message: a revoked token says so even if it
    has also expired.
    """
    if row.revoked_at is not None:
        return Refusal(
            f"this enrolment token was revoked at {row.revoked_at:%Y-%m-%d %H:%M:%S} UTC"
        )
    if row.expires_at <= now:
        return Refusal(f"this enrolment token expired at {row.expires_at:%Y-%m-%d %H:%M:%S} UTC")
    if row.single_use and row.used_at is not None and not retry:
        return Refusal("this enrolment token was already used; it admits one registration")
    if row.node_name is not None and row.node_name != name:
        return Refusal(f"this enrolment token does not admit the name {name!r}", forbidden=True)
    return None


def admit(
    session: Session,
    token: str,
    name: str,
    shared: SecretStr | None,
    now: datetime,
    registration_key: str | None = None,
) -> EnrolmentToken | None:
    """Check the credential of a registration of ``name``; the per-node token that
    admitted it, or None for the shared token.

    A single-use token is marked used here, in the registration's transaction:
    if the registration fails afterwards, the use is rolled back with it. A used
    one admits again a retry that carries the ``registration_key`` of the node's
    last registration while that key is unspent (``service.nodes``): the try that
    used the token registered the node, but its answer was lost.
    Raises ``Unauthenticated`` (401) for an unknown, revoked, expired or used
    token, ``Forbidden`` (403) for a token bound to another name.
    """
    if shared is not None and auth.same_secret(token, shared.get_secret_value()):
        return None
    row = _find(session, token)
    if row is None:
        if shared is None:
            raise Unauthenticated(
                f"{WRONG}: this controller has no shared enrolment token "
                "(RELAUNCH_ENROLMENT_TOKEN), so a node needs one an admin made "
                "(relaunch nodes token create)"
            )
        raise Unauthenticated(WRONG)
    retry = row.single_use and row.used_at is not None and _retries(session, name, registration_key)
    why = refusal(row, name, now, retry=retry)
    if why is None and not retry and not _use(session, row, now):
        # Another try of the same registration may have used it and committed meanwhile
        # (a retry sent while the first try still ran): the row was read again, and so is
        # the node.
        retry = row.single_use and _retries(session, name, registration_key)
        why = refusal(row, name, now, retry=retry)
        if why is None and not retry:
            why = Refusal("this enrolment token was just used or revoked")
    if why is not None:
        logger.warning("enrolment token %s refused for name=%s: %s", row.id, name, why.message)
        raise (Forbidden if why.forbidden else Unauthenticated)(why.message)
    again = " again: a retry by registration key" if retry else ""
    logger.info("enrolment token %s admits name=%s%s", row.id, name, again)
    return row


def _retries(session: Session, name: str, registration_key: str | None) -> bool:
    """Whether ``registration_key`` is the unspent key of the last registration of the
    node ``name``."""
    if registration_key is None:
        return False
    stmt = select(Node.registration_key_hash).where(Node.name == name)
    return auth.hashes_to(registration_key, session.scalars(stmt).one_or_none())


def _find(session: Session, token: str) -> EnrolmentToken | None:
    if not token.startswith(ENROLMENT_TOKEN_PREFIX):
        return None
    stmt = select(EnrolmentToken).where(EnrolmentToken.token_hash == auth.token_hash(token))
    return session.scalars(stmt).one_or_none()


def _use(session: Session, row: EnrolmentToken, now: datetime) -> bool:
    """Record a use; for a single-use token only if no one used or revoked it since it
    was read (compare-and-set). False if that lost: the row is read afresh."""
    stmt = update(EnrolmentToken).where(EnrolmentToken.id == row.id).values(used_at=now)
    if row.single_use:
        stmt = stmt.where(
            EnrolmentToken.used_at.is_(None),
            EnrolmentToken.revoked_at.is_(None),
            EnrolmentToken.expires_at > now,
        )
    done = session.execute(stmt.execution_options(synchronize_session=False)).rowcount == 1  # type: ignore[attr-defined]
    session.refresh(row)
    return done


def create(
    session: Session,
    creator: User,
    now: datetime,
    *,
    expires_in: timedelta,
    node_name: str | None = None,
    single_use: bool = True,
) -> tuple[EnrolmentToken, str]:
    """A new per-node token's row and its text, which is returned once and kept nowhere."""
    if expires_in <= timedelta(0):
        raise ValueError("an enrolment token must expire in the future")
    secret = auth.new_token(ENROLMENT_TOKEN_PREFIX)
    row = EnrolmentToken(
        token_hash=auth.token_hash(secret),
        node_name=node_name,
        single_use=single_use,
        expires_at=now + expires_in,
        created_at=now,
        created_by=creator.id,
    )
    session.add(row)
    session.flush()
    logger.info(
        "enrolment token %s created by user=%s name=%s single_use=%s expires_at=%s",
        row.id,
        creator.id,
        node_name,
        single_use,
        row.expires_at,
    )
    return row, secret


def list_tokens(session: Session) -> list[EnrolmentToken]:
    return list(session.scalars(select(EnrolmentToken).order_by(EnrolmentToken.id)))


def revoke(session: Session, token_id: int, now: datetime) -> EnrolmentToken:
    """Revoke a per-node token: it admits no registration from now on. Revoking it
    again changes nothing. Nodes it admitted keep their node tokens."""
    row = session.get(EnrolmentToken, token_id, with_for_update=True)
    if row is None:
        raise NotFound(f"enrolment token {token_id} does not exist")
    if row.revoked_at is None:
        row.revoked_at = now
        logger.info("enrolment token %s revoked", token_id)
    return row
