"""What a report reads of its attempt's timeline is found by the attempt's index, not by
a scan of every job's events (which cost each report with events about 25 ms at 150,000
events on PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session

from service.db import transaction
from service.job_events import last_membership_change, last_round_event
from service.nodes import zygote_memory
from tests.service.helpers import Cluster

INDEX = "ix_job_events_attempt_id_id"


def _plans(session: Session, read: Callable[[Session], Any]) -> list[str]:
    """The database's plan of each statement ``read`` sends, with the values it sent; on
    PostgreSQL with sequential scans priced out, so that a plan takes an index wherever
    one serves (tables this small are otherwise read whole)."""
    connection = session.connection()
    sent: list[tuple[str, Any]] = []

    def note(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        sent.append((statement, parameters))

    postgresql = connection.dialect.name == "postgresql"
    if postgresql:
        connection.exec_driver_sql("SET LOCAL enable_seqscan = off")
    event.listen(connection, "before_cursor_execute", note)
    try:
        read(session)
    finally:
        event.remove(connection, "before_cursor_execute", note)
    assert sent
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    plans = []
    explain = "EXPLAIN " if postgresql else "EXPLAIN QUERY PLAN "
    for statement, parameters in sent:
        cursor.execute(explain + statement, parameters)
        plans.append("\n".join(str(row) for row in cursor.fetchall()))
    return plans


@pytest.mark.parametrize(
    "read",
    [
        lambda s: last_membership_change(s, 7),
        lambda s: last_round_event(s, 7, 3),
        lambda s: zygote_memory(s, [(3, 7), (4, 8)]),
    ],
    ids=["last_membership_change", "last_round_event", "zygote_memory"],
)
def test_reads_of_an_attempt_s_timeline_use_its_index(
    api: Cluster, read: Callable[[Session], Any]
) -> None:
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        plans = _plans(session, read)
    assert all(INDEX in plan for plan in plans), plans
