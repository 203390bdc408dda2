"""Each attempt's rendezvous, served by the controller to the attempt's member nodes.

torch's ``DynamicRendezvousHandler`` on every node keeps its state through a
backend (get, and set with compare-and-set on a fencing token) and hands its
workers' launchers a key/value store. Both live here, in the database, scoped to
one attempt: only a node with an ACTIVE membership of the attempt while it is
RUNNING may read or write them (``member_attempt``), so no job can see or touch
another's. The state and the values are opaque bytes: the controller stores and
returns them and never interprets them (torch's state is a pickle).

Every size is bounded (``TooLarge``): a value, a key, the state, the number of
keys and their bytes per attempt. An attempt's rows are deleted when it ends
(``forget_attempt``), a job's writer count when the job ends.

A store value written by ``add`` is the decimal text of the number, as in
torch's ``TCPStore``; ``add`` on a value that is not such text is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, and_, bindparam, delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service import auth
from service.errors import Conflict, Forbidden, NotFound, StaleState, TooLarge
from service.models import Attempt, AttemptMember, Node, RendezvousKey, RendezvousState
from service.states import AttemptState, MemberState

logger = logging.getLogger(__name__)

MAX_KEY_CHARS = 512
MAX_VALUE_BYTES = 64 * 1024
MAX_STATE_BYTES = 512 * 1024
MAX_KEYS_PER_ATTEMPT = 4096
MAX_BYTES_PER_ATTEMPT = 8 * 1024 * 1024
MAX_KEYS_PER_CALL = 1024
_MAX_COUNTER_DIGITS = 20


@dataclass(frozen=True)
class StateReply:
    """What ``set_state`` found or made: the state now stored (None: there is none),
    its version, and whether this call wrote it."""

    state: bytes | None
    version: int
    written: bool


def member_attempt(
    session: Session,
    rdzv_id: str,
    token: str,
    *,
    member_id: int | None = None,
    lock: bool = False,
) -> int:
    """The id of the attempt ``rdzv_id`` if the node whose token is ``token`` may use its
    rendezvous now, checked in one statement: the token, the attempt and the membership.

    Unauthenticated (401) or Forbidden (403) for a token that is no node's, as every node
    route answers it (``auth.refuse_as_node``); ``NotFound`` for an unknown rendezvous
    id; ``Forbidden`` unless the node has an ACTIVE membership of it (a node being
    placed or joining in place has one) and the attempt is RUNNING; with ``member_id``,
    that membership must be this one (a launcher of the node's ended membership is
    refused). With ``lock`` the attempt row is share-locked until the transaction ends,
    so it cannot end (and be cleaned up) under a write. The token used to be checked in
    a transaction of its own, on a worker thread of its own, before the route's.
    """
    row = None
    if token.startswith(auth.NODE_TOKEN_PREFIX):
        params: dict[str, Any] = {"rdzv_id": rdzv_id, "token_hash": auth.token_hash(token)}
        if member_id is not None:
            params["member_id"] = member_id
        row = session.execute(_CALLER[member_id is not None, lock], params).first()
    if row is None:  # which of the two it is: the token's refusal comes first
        if auth.node_for_token(session, token) is None:
            auth.refuse_as_node(session, token)
        raise NotFound(f"no attempt has rendezvous id {rdzv_id!r}")
    node_id, attempt_id, state, member = row
    if member is None and member_id is not None:
        raise Forbidden(
            f"membership {member_id} of node {node_id} is not an active member of rendezvous "
            f"{rdzv_id!r}: it has ended"
        )
    if member is None:
        raise Forbidden(f"node {node_id} is not a member of rendezvous {rdzv_id!r}")
    if state is not AttemptState.RUNNING:
        raise Forbidden(f"rendezvous {rdzv_id!r} is over: its attempt is {state}")
    return int(attempt_id)


def _caller_statement(named_member: bool, lock: bool) -> Select[int, int, AttemptState, int]:
    """``member_attempt``'s statement: the node of the token, the attempt of the rendezvous
    id (no row if either is unknown), and the node's ACTIVE membership of it, if any
    (with ``named_member``, only the one named)."""
    membership = [
        AttemptMember.attempt_id == Attempt.id,
        AttemptMember.node_id == Node.id,
        AttemptMember.state == MemberState.ACTIVE,
    ]
    if named_member:
        membership.append(AttemptMember.id == bindparam("member_id"))
    stmt = (
        select(Node.id, Attempt.id, Attempt.state, AttemptMember.id)
        .select_from(Node)
        .join(Attempt, Attempt.rdzv_id == bindparam("rdzv_id"))
        .outerjoin(AttemptMember, and_(*membership))
        .where(Node.token_hash == bindparam("token_hash"))
        .order_by(AttemptMember.id)
        .limit(1)
    )
    return stmt.with_for_update(read=True, of=Attempt) if lock else stmt


# Built once: building a statement costs more than running it.
_CALLER = {
    (named, lock): _caller_statement(named, lock)
    for named in (False, True)
    for lock in (False, True)
}


def member_count(session: Session, attempt_id: int) -> int:
    """The attempt's ACTIVE members: the nodes its rendezvous rounds are for."""
    stmt = select(func.count()).where(
        AttemptMember.attempt_id == attempt_id, AttemptMember.state == MemberState.ACTIVE
    )
    return int(session.scalar(stmt) or 0)


def state_version(session: Session, attempt_id: int) -> int:
    """The version of the attempt's rendezvous state; 0 before the first write."""
    stmt = select(RendezvousState.version).where(RendezvousState.attempt_id == attempt_id)
    return int(session.scalar(stmt) or 0)


def get_state(session: Session, attempt_id: int) -> tuple[bytes, int] | None:
    row = session.get(RendezvousState, attempt_id, populate_existing=True)
    return None if row is None else (row.state, row.version)


def set_state(session: Session, attempt_id: int, state: bytes, version: int | None) -> StateReply:
    """Write ``state`` if the stored version is ``version`` (``None``: only if there is
    no state yet); either way answer with what is stored now (torch's
    ``RendezvousBackend.set_state``). Versions start at 1 and grow by one per write."""
    if len(state) > MAX_STATE_BYTES:
        raise TooLarge(f"the rendezvous state is {len(state)} bytes, over {MAX_STATE_BYTES}")
    if version is None:
        try:
            with session.begin_nested():
                session.add(RendezvousState(attempt_id=attempt_id, state=state, version=1))
            return StateReply(state, 1, True)
        except IntegrityError:
            pass  # another node wrote the first state
    else:
        result = session.execute(
            update(RendezvousState)
            .where(RendezvousState.attempt_id == attempt_id, RendezvousState.version == version)
            .values(state=state, version=version + 1)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount == 1:  # type: ignore[attr-defined]
            return StateReply(state, version + 1, True)
    current = get_state(session, attempt_id)
    if current is None:
        return StateReply(None, 0, False)
    return StateReply(current[0], current[1], False)


def values_of(session: Session, attempt_id: int, keys: list[str]) -> dict[str, bytes]:
    """The stored values of those of ``keys`` that exist."""
    _check_keys(keys)
    rows = session.execute(
        select(RendezvousKey.key, RendezvousKey.value).where(
            RendezvousKey.attempt_id == attempt_id, RendezvousKey.key.in_(set(keys))
        )
    )
    return {key: bytes(value) for key, value in rows}


def set_values(session: Session, attempt_id: int, items: dict[str, bytes]) -> None:
    """Set every key of ``items``, within the attempt's bounds."""
    _check_keys(list(items))
    for key, value in items.items():
        _put(session, attempt_id, key, value)


def add(session: Session, attempt_id: int, key: str, amount: int) -> int:
    """Add ``amount`` to the counter at ``key`` (0 if absent); the new count."""
    _check_keys([key])
    for _ in range(2):
        current = _locked_value(session, attempt_id, key)
        if current is None:
            if _insert(session, attempt_id, key, str(amount).encode()):
                return amount
            continue  # a concurrent writer made the key first: count on from its value
        try:
            if len(current) > _MAX_COUNTER_DIGITS:
                raise ValueError
            count = int(current.decode("ascii")) + amount
        except (UnicodeDecodeError, ValueError):
            raise Conflict(f"key {key!r} does not hold a counter") from None
        _put(session, attempt_id, key, str(count).encode())
        return count
    raise StaleState(f"key {key!r} kept changing")


def compare_set(
    session: Session, attempt_id: int, key: str, expected: bytes, desired: bytes
) -> bytes:
    """torch's ``TCPStore.compare_set``: set ``desired`` if the value is ``expected`` (an
    absent key matches only an empty ``expected``); answer with the value now stored,
    or ``expected`` for an absent key that was not set."""
    _check_keys([key])
    for _ in range(2):
        current = _locked_value(session, attempt_id, key)
        if current is None:
            if expected:
                return expected
            if _insert(session, attempt_id, key, desired):
                return desired
            continue
        if current == expected:
            _put(session, attempt_id, key, desired)
            return desired
        return current
    raise StaleState(f"key {key!r} kept changing")


def delete_key(session: Session, attempt_id: int, key: str) -> bool:
    _check_keys([key])
    result = session.execute(
        delete(RendezvousKey).where(
            RendezvousKey.attempt_id == attempt_id, RendezvousKey.key == key
        )
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def num_keys(session: Session, attempt_id: int) -> int:
    count = session.scalar(
        select(func.count())
        .select_from(RendezvousKey)
        .where(RendezvousKey.attempt_id == attempt_id)
    )
    return int(count or 0)


def forget_attempt(session: Session, attempt_id: int) -> None:
    """Delete the attempt's rendezvous state and keys (its rendezvous is over)."""
    session.execute(delete(RendezvousKey).where(RendezvousKey.attempt_id == attempt_id))
    session.execute(delete(RendezvousState).where(RendezvousState.attempt_id == attempt_id))
    logger.info("attempt_id=%s rendezvous data deleted", attempt_id)


def _check_keys(keys: list[str]) -> None:
    if len(keys) > MAX_KEYS_PER_CALL:
        raise TooLarge(f"{len(keys)} keys in one call, over {MAX_KEYS_PER_CALL}")
    for key in keys:
        if not key or len(key) > MAX_KEY_CHARS:
            raise TooLarge(f"a key must have 1 to {MAX_KEY_CHARS} characters, not {len(key)}")


def _locked_value(session: Session, attempt_id: int, key: str) -> bytes | None:
    value = session.scalar(
        select(RendezvousKey.value)
        .where(RendezvousKey.attempt_id == attempt_id, RendezvousKey.key == key)
        .with_for_update()
    )
    return None if value is None else bytes(value)


def _put(session: Session, attempt_id: int, key: str, value: bytes) -> None:
    """Insert or replace one key (the last write wins)."""
    _check_room(session, attempt_id, key, value)
    for _ in range(2):
        changed = session.execute(
            update(RendezvousKey)
            .where(RendezvousKey.attempt_id == attempt_id, RendezvousKey.key == key)
            .values(value=value)
            .execution_options(synchronize_session=False)
        )
        if changed.rowcount == 1 or _insert(session, attempt_id, key, value):  # type: ignore[attr-defined]
            return
    raise StaleState(f"key {key!r} kept changing")


def _insert(session: Session, attempt_id: int, key: str, value: bytes) -> bool:
    """Make the key; False if it exists already."""
    _check_room(session, attempt_id, key, value)
    try:
        with session.begin_nested():
            session.add(RendezvousKey(attempt_id=attempt_id, key=key, value=value))
    except IntegrityError:
        return False
    return True


def _check_room(session: Session, attempt_id: int, key: str, value: bytes) -> None:
    """``TooLarge`` if ``value`` at ``key`` would pass the attempt's bounds."""
    if len(value) > MAX_VALUE_BYTES:
        raise TooLarge(f"the value of {key!r} is {len(value)} bytes, over {MAX_VALUE_BYTES}")
    count, size = session.execute(
        select(func.count(), func.coalesce(func.sum(func.length(RendezvousKey.value)), 0)).where(
            RendezvousKey.attempt_id == attempt_id, RendezvousKey.key != key
        )
    ).one()
    if count >= MAX_KEYS_PER_ATTEMPT:
        raise TooLarge(f"the rendezvous holds {count} keys; at most {MAX_KEYS_PER_ATTEMPT}")
    if size + len(value) > MAX_BYTES_PER_ATTEMPT:
        raise TooLarge(f"the rendezvous would hold over {MAX_BYTES_PER_ATTEMPT} bytes of values")
