"""What every reconciler pass reads of the queue and of the memberships is found by the
partial index made for it (migration 0016), on both databases, rather than by the index
of every job or membership in that state, or a scan: with 9,000 queued jobs, the read of
the jobs that do not yet say why they wait filtered all of them on every pass."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy.orm import Session

from service.db import transaction
from service.reconciler import _gpu_indices, _held_gpus, held_now, read_queue
from tests.service.helpers import Cluster, query_plans

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("read", "index"),
    [
        (lambda s: read_queue(s, {}, unexplained=True), "ix_jobs_unexplained"),
        (lambda s: read_queue(s, {}, limit=256), "ix_jobs_queue"),
        (lambda s: read_queue(s, {}, after=(T0, 7), limit=256), "ix_jobs_queue"),
        (lambda s: s.execute(held_now()).all(), "ix_attempt_members_active"),
    ],
    ids=["new jobs", "queue head", "queue page", "active memberships"],
)
def test_a_pass_s_reads_use_their_partial_index(
    api: Cluster, read: Callable[[Session], Any], index: str
) -> None:
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        plans = query_plans(session, read)
    assert all(index in plan for plan in plans), plans


@pytest.mark.parametrize(
    ("stored", "indices"),
    [
        (None, ()),
        ("null", ()),
        ("[]", ()),
        ('[{"index": 1, "name": "b"}, {"index": 0, "name": "a"}]', (0, 1)),
    ],
)
def test_a_node_s_gpus_read_as_text_are_their_sorted_indices(
    stored: str | None, indices: tuple[int, ...]
) -> None:
    """A pass reads ``Node.gpus`` as its JSON text; SQL NULL and JSON null are no GPUs."""
    assert _gpu_indices(stored) == indices


@pytest.mark.parametrize(
    ("stored", "held"), [(None, ()), ("null", ()), ("[]", ()), ("[2, 3]", (2, 3))]
)
def test_a_membership_s_gpus_read_as_text(stored: str | None, held: tuple[int, ...]) -> None:
    assert _held_gpus(stored) == held
