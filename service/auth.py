"""Who is calling: users with API tokens, nodes with their own tokens.

A token is random text shown once, when it is made; the database keeps only
its sha256. Tokens are 32 random bytes, so a fast hash is enough: there is no
password to guess. The prefix says what a token is for (``rlu_`` a user,
``rln_`` a node), so one found in a log or a shell history is recognisable,
but the prefix grants nothing: a user token is looked up only among user
tokens and a node token only among nodes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NoReturn

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, make_transient_to_detached, sessionmaker

from service.errors import Conflict, Forbidden, NotFound, Unauthenticated
from service.models import ApiToken, Node, Role, User

logger = logging.getLogger(__name__)

USER_TOKEN_PREFIX = "rlu_"
NODE_TOKEN_PREFIX = "rln_"
FIRST_ADMIN = "admin"


def new_token(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def hashes_to(secret: str | None, kept: str | None) -> bool:
    """Whether ``secret`` is the one whose hash (``token_hash``) was ``kept``, compared in
    time that does not depend on where they differ; False if either is missing."""
    if secret is None or kept is None:
        return False
    return hmac.compare_digest(token_hash(secret), kept)


def same_secret(given: str, expected: str) -> bool:
    """Compare two secrets in time that does not depend on where they differ."""
    return hmac.compare_digest(token_hash(given), token_hash(expected))


def create_user(
    session: Session,
    name: str,
    role: Role,
    now: datetime,
    *,
    max_active_jobs: int | None = None,
    max_nodes: int | None = None,
) -> tuple[User, ApiToken, str]:
    """A new user, its first token's row and that token's text, which is returned once and
    kept nowhere."""
    if session.scalars(select(User).where(User.name == name)).one_or_none() is not None:
        raise Conflict(f"user {name!r} already exists; pick another name")
    user = User(
        name=name,
        role=role,
        max_active_jobs=max_active_jobs,
        max_nodes=max_nodes,
        created_at=now,
    )
    session.add(user)
    session.flush()
    row, token = create_token(session, user, "initial", now)
    logger.info("user=%s created name=%s role=%s", user.id, name, role)
    return user, row, token


def create_token(session: Session, user: User, label: str, now: datetime) -> tuple[ApiToken, str]:
    token = new_token(USER_TOKEN_PREFIX)
    row = ApiToken(user_id=user.id, label=label, token_hash=token_hash(token), created_at=now)
    session.add(row)
    session.flush()
    logger.info("user=%s token %s created label=%s", user.id, row.id, label)
    return row, token


def revoke_token(session: Session, token_id: int, now: datetime) -> ApiToken:
    """Revoke a token; revoking it again changes nothing. The last live token of all
    admins is kept: without it nobody could make users or tokens again."""
    row = session.get(ApiToken, token_id)
    if row is None:
        raise NotFound(f"token {token_id} does not exist")
    if row.revoked_at is not None:
        return row
    if row.user.role is Role.ADMIN:
        admin_tokens = session.scalars(
            select(ApiToken.id)
            .join(User, User.id == ApiToken.user_id)
            .where(User.role == Role.ADMIN, ApiToken.revoked_at.is_(None))
            .with_for_update()
        ).all()
        if list(admin_tokens) == [token_id]:
            raise Conflict(
                f"token {token_id} is the last live admin token; make another first "
                "(relaunch users token ID)"
            )
    row.revoked_at = now
    logger.info("user=%s token %s revoked", row.user_id, token_id)
    return row


def get_user(session: Session, user_id: int) -> User:
    user = session.get(User, user_id)
    if user is None:
        raise NotFound(f"user {user_id} does not exist")
    return user


def list_users(session: Session, limit: int, offset: int) -> tuple[list[User], int]:
    users = session.scalars(select(User).order_by(User.id).limit(limit).offset(offset)).all()
    return list(users), session.scalar(select(func.count()).select_from(User)) or 0


def user_tokens(session: Session, user_id: int) -> list[ApiToken]:
    get_user(session, user_id)
    stmt = select(ApiToken).where(ApiToken.user_id == user_id).order_by(ApiToken.id)
    return list(session.scalars(stmt))


def user_for_token(session: Session, token: str) -> User | None:
    """The user whose live token this is, or None."""
    if not token.startswith(USER_TOKEN_PREFIX):
        return None
    stmt = (
        select(User)
        .join(ApiToken, ApiToken.user_id == User.id)
        .where(ApiToken.token_hash == token_hash(token), ApiToken.revoked_at.is_(None))
    )
    return session.scalars(stmt).one_or_none()


@dataclass(frozen=True)
class _Checked:
    """What a credential check found: the user's columns, and until when they may be used."""

    user: dict[str, object]
    checked_at: datetime
    until: datetime


# Past this many cached credentials the oldest half is dropped: a caller who sends many
# valid tokens cannot grow the cache without bound (an unknown token is never cached).
MAX_CACHED_CREDENTIALS = 10_000


class CredentialCache:
    """The users of recently checked API tokens, each kept for ``ttl_s`` seconds.

    A token revoked on another controller (or straight in the database) still works
    here until its entry is ``ttl_s`` old, and no longer; one revoked through this
    controller stops at once (``forget``), also for a check that read the token before
    the revoke and stores its answer after it (``remember`` with ``since``). The user's
    other columns (role, limits) are cached alike: a change made in the database shows
    within ``ttl_s``. A clock that went back ends every entry
    checked after its new time. ``ttl_s`` 0 checks every request against the
    database. Only users are cached: an unknown or revoked token, or a node's, is
    looked up every time. Entries are keyed by the token's sha256, never its text.
    """

    def __init__(self, ttl_s: float) -> None:
        if ttl_s < 0:
            raise ValueError(f"a credential cache lasts 0 seconds or more, not {ttl_s}")
        self.ttl = timedelta(seconds=ttl_s)
        self._entries: dict[str, _Checked] = {}
        self._forgotten = 0
        self._lock = threading.Lock()

    @property
    def forgotten(self) -> int:
        """How many tokens were forgotten so far: read before a check, and given to
        ``remember`` after it."""
        return self._forgotten

    def user(self, token: str, now: datetime) -> User | None:
        """The user whose token this is, if checked in the last ``ttl_s`` seconds; a
        detached copy of its own for each caller."""
        if not self.ttl:
            return None
        entry = self._entries.get(token_hash(token))
        if entry is None or not entry.checked_at <= now < entry.until:
            return None
        user = User(**entry.user)
        make_transient_to_detached(user)
        return user

    def remember(self, token: str, user: User, now: datetime, since: int) -> None:
        """Keep ``user`` as the owner of ``token``, checked at ``now``, unless a token was
        forgotten after the check began (``since``, ``forgotten`` as read before it): the
        check may have seen that token live just before its revoke was committed."""
        if not self.ttl:
            return
        columns = {c.key: getattr(user, c.key) for c in User.__mapper__.column_attrs}
        with self._lock:
            if self._forgotten != since:
                return
            if len(self._entries) >= MAX_CACHED_CREDENTIALS:
                for key in list(self._entries)[: MAX_CACHED_CREDENTIALS // 2]:
                    del self._entries[key]
            self._entries[token_hash(token)] = _Checked(columns, now, now + self.ttl)

    def forget(self, hashed: str) -> None:
        """Drop the entry of the token whose sha256 is ``hashed`` (it was revoked)."""
        with self._lock:
            self._forgotten += 1
            self._entries.pop(hashed, None)


def node_for_token(session: Session, token: str) -> Node | None:
    if not token.startswith(NODE_TOKEN_PREFIX):
        return None
    return session.scalars(select(Node).where(Node.token_hash == token_hash(token))).one_or_none()


def refuse_as_node(session: Session, token: str) -> NoReturn:
    """Refuse a call made with ``token`` where a node's token was needed and it is none:
    Forbidden for a user's token, Unauthenticated for any other."""
    if user_for_token(session, token) is not None:
        raise Forbidden("a user's token cannot act as a node")
    raise Unauthenticated("the node token is unknown; register again")


def issue_node_token(session: Session, node: Node) -> str:
    """A new token for ``node``; the one it held before stops working."""
    token = new_token(NODE_TOKEN_PREFIX)
    node.token_hash = token_hash(token)
    return token


def bootstrap_admin(factory: sessionmaker[Session], now: datetime) -> str | None:
    """Make the first admin if there is no user at all; return its token, or None.

    Two controllers starting at once on one database both try; the unique
    user name lets exactly one succeed.
    """
    try:
        with factory() as session, session.begin():
            if session.scalar(select(func.count()).select_from(User)):
                return None
            return create_user(session, FIRST_ADMIN, Role.ADMIN, now)[2]
    except (IntegrityError, Conflict):
        return None
