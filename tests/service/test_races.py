"""Compare-and-set losers retry instead of failing or overwriting."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service.auth import user_for_token
from service.db import retry_on_stale, transaction
from service.errors import StaleState
from service.jobs import cancel_job, change_job_state, get_job
from service.models import Job
from service.reconciler import Reconciler
from service.states import JobState
from tests.helpers import FakeClock
from tests.service.helpers import Cluster


def _pending_job(api: TestClient) -> int:
    api.post("/api/v1/nodes/register", json={"name": "a", "address": "x", "slots": 1, "pid": 1})
    spec = {"name": "j", "task": {"name": "regression"}, "nnodes": "1"}
    job_id: int = api.post("/api/v1/jobs", json=spec).json()["id"]
    return job_id


def test_a_stale_state_change_is_refused_and_changes_nothing(
    api: TestClient, reconciler: Reconciler, clock: FakeClock
) -> None:
    job_id = _pending_job(api)
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        job = get_job(session, job_id)  # read as PENDING
    reconciler.run_once()  # placed by another transaction meanwhile
    with pytest.raises(StaleState), transaction(factory) as session:
        change_job_state(session, job, JobState.FAILED, clock(), message="stale writer")
    detail = api.get(f"/api/v1/jobs/{job_id}").json()
    assert (detail["state"], detail["message"]) == ("RUNNING", "")


def test_a_cancel_that_loses_to_placement_retries_and_cancels(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    job_id = _pending_job(api)
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        admin = user_for_token(session, api.user_token)
        assert admin is not None
        stale = get_job(session, job_id)  # read as PENDING ...
    reconciler.run_once()  # ... then placed before the cancel writes
    tries: list[JobState] = []

    def cancel(session: Session) -> Job:
        if not tries:  # the first try acts on what it read before the placement
            tries.append(stale.state)
            change_job_state(session, stale, JobState.CANCELLED, clock())
        tries.append(get_job(session, job_id).state)
        return cancel_job(session, job_id, admin, clock())

    job = retry_on_stale(factory, cancel)
    assert tries == [JobState.PENDING, JobState.RUNNING]
    assert job.state is JobState.CANCELLED
    detail = api.get(f"/api/v1/jobs/{job_id}").json()
    assert detail["state"] == "CANCELLED"
    assert detail["attempts"][0]["state"] == "STOPPED"
    node_id = api.get("/api/v1/nodes").json()["items"][0]["id"]
    heartbeat = api.post(f"/api/v1/nodes/{node_id}/heartbeat", json={"running": []})
    assert heartbeat.json()["assignments"] == []
