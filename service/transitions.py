"""Compare-and-set of a lifecycle state: the one way a job, attempt, member or node changes state.

The change must be in the lifecycle's table (``service.states``), and it is
written only if the row is still in the state it was read in, so a writer that
read a row before someone else changed it loses instead of overwriting the
newer state.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from sqlalchemy import ClauseElement, ColumnElement, Update, bindparam, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import instance_state, set_committed_value

from service.errors import StaleState
from service.models import Attempt, AttemptMember, Job, Node
from service.states import (
    ATTEMPT_TRANSITIONS,
    JOB_TRANSITIONS,
    MEMBER_TRANSITIONS,
    NODE_TRANSITIONS,
    check_transition,
)

Stateful = Job | Attempt | AttemptMember | Node

_TABLES: Mapping[type[Stateful], dict[Any, frozenset[Any]]] = {
    Job: JOB_TRANSITIONS,
    Attempt: ATTEMPT_TRANSITIONS,
    AttemptMember: MEMBER_TRANSITIONS,
    Node: NODE_TRANSITIONS,
}


def transition(
    session: Session,
    row: Stateful,
    new: StrEnum,
    *,
    also_where: Iterable[ColumnElement[bool]] = (),
    **values: Any,
) -> bool:
    """Move ``row`` from the state it was read in to ``new``, writing ``values`` with it.

    Raises ``InvalidTransition`` when the row's lifecycle table does not allow
    the change (checked before anything is written). Returns False, changing
    nothing, when the row in the database is no longer in that state or does
    not meet every condition of ``also_where``; True when it was written, and
    then ``row`` holds the new state and ``values``. The caller decides whether
    a lost race is an error.
    """
    model = type(row)
    current = row.state
    if type(new) is not type(current):
        raise TypeError(f"{model.__name__} has a {type(current).__name__}, not a {new!r}")
    check_transition(_TABLES[model], current, new)
    also = tuple(also_where)
    if also or any(_is_sql(v) for v in values.values()):
        stmt = (
            update(model)
            .where(model.id == row.id, model.state == current, *also)
            .values(state=new, **values)
            .execution_options(synchronize_session=False)
        )
        result = session.execute(stmt)
    else:
        params = {_ID: row.id, _FROM: current, **_named({"state": new, **values})}
        result = session.execute(_update_of(model, ("state", *values), True), params)
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return False
    # The database holds these values now; the row learns them without writing them again.
    for key, value in {"state": new, **values}.items():
        set_committed_value(row, key, value)
    return True


def write(session: Session, row: Stateful, **values: Any) -> None:
    """Write ``values`` (plain values, not SQL) to ``row``'s columns now, in one UPDATE by
    its id, and let ``row`` hold them as written: what setting its attributes and a flush
    do, without the flush's bookkeeping. As a flush, it leaves out a value ``row`` already
    holds as loaded, and sends nothing if that leaves none; ``StaleState`` if the row is gone.
    Not for a lifecycle state (``transition``)."""
    if "state" in values:
        raise ValueError("a state changes by transition(), which checks it")
    loaded = instance_state(row).dict
    changed = {k: v for k, v in values.items() if k not in loaded or loaded[k] != v}
    if not changed:
        return
    params = {_ID: row.id, **_named(changed)}
    result = session.execute(_update_of(type(row), tuple(changed), False), params)
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise StaleState(f"{type(row).__name__} {row.id} is gone")  # as a flush would fail
    for key, value in changed.items():
        set_committed_value(row, key, value)


# The bound parameters of ``_update_of``'s statements: the row's id, the state it was read
# in, and each column's new value (a name of its own: a column's name is SQLAlchemy's).
_ID, _FROM = "row_id", "from_state"


def _is_sql(value: Any) -> bool:
    """Whether ``value`` is SQL (an expression, or a mapped attribute such as ``Job.x``)
    rather than a value to send beside the statement."""
    return isinstance(value, ClauseElement) or hasattr(value, "__clause_element__")


def _named(values: dict[str, Any]) -> dict[str, Any]:
    return {f"new_{key}": value for key, value in values.items()}


@functools.cache
def _update_of(model: type[Stateful], columns: tuple[str, ...], checks_state: bool) -> Update:
    """An UPDATE of ``model``'s row by id that sets ``columns`` (and, ``checks_state``,
    only while its state is still the one read), built once for each such shape: building
    a statement costs more than running it."""
    table = model.__table__.c
    where = [table.id == bindparam(_ID)]
    if checks_state:
        where.append(table.state == bindparam(_FROM, type_=table.state.type))
    sets = {c: bindparam(f"new_{c}", type_=table[c].type) for c in columns}
    return update(model).where(*where).values(sets).execution_options(synchronize_session=False)


def transition_all(
    session: Session, rows: Sequence[Stateful], new: StrEnum, **values: Any
) -> set[int]:
    """``transition`` for many rows of one table at once: one statement per state they
    were read in, whatever their number. ``values`` may be SQL expressions over the row
    (``Job.attempt_count + 1``); in the rows written, the state and ``values`` are
    expired, to be read again when next used. Returns the ids of the rows written."""
    if not rows:
        return set()
    model = type(rows[0])
    by_state: dict[StrEnum, list[Stateful]] = {}
    for row in rows:
        if type(row) is not model or type(new) is not type(row.state):
            raise TypeError(f"{type(row).__name__} {row.id} cannot move to {new!r} with {model}")
        check_transition(_TABLES[model], row.state, new)
        by_state.setdefault(row.state, []).append(row)
    written: set[int] = set()
    for current, alike in by_state.items():
        ids = [row.id for row in alike]
        result = session.execute(
            update(model)
            .where(model.id.in_(ids), model.state == current)
            .values(state=new, **values)
            .returning(model.id)
            .execution_options(synchronize_session=False)
        )
        written.update(result.scalars())
    for row in rows:
        if row.id in written:
            session.expire(row, ["state", *values])
    return written
