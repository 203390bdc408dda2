"""What a report reads of its attempt's timeline is found by the attempt's index, not by
a scan of every job's events (which cost each report with events about 25 ms at 150,000
events on PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.orm import Session

from service.db import transaction
from service.job_events import last_membership_change, last_round_event
from service.nodes import zygote_memory
from tests.service.helpers import Cluster, query_plans

INDEX = "ix_job_events_attempt_id_id"


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
        plans = query_plans(session, read)
    assert all(INDEX in plan for plan in plans), plans
