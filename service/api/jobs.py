"""Routes for jobs: submit, watch, cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from service import jobs
from service.api.deps import FactoryDep, NowDep, SessionDep
from service.db import retry_on_stale
from service.models import Attempt, Job
from service.schemas import (
    AttemptPublic,
    EventPublic,
    EventsPublic,
    JobCreate,
    JobDetail,
    JobPublic,
    JobSpec,
    JobsPublic,
    LogPublic,
    LogsPublic,
    MemberPublic,
    MetricPublic,
    MetricsPublic,
    SnapshotPublic,
    SnapshotsPublic,
)
from service.states import JobState

router = APIRouter(prefix="/jobs", tags=["jobs"])

Limit = Annotated[int, Query(ge=1, le=1000, description="At most this many items")]
AfterId = Annotated[int, Query(ge=0, description="Only items with a larger id (for polling)")]


def job_public(job: Job) -> JobPublic:
    spec = JobSpec.model_validate(job.spec)
    return JobPublic(
        id=job.id,
        name=job.name,
        state=job.state,
        spec=spec,
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        created_at=job.created_at,
        updated_at=job.updated_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        attempt_count=job.attempt_count,
        restart_count=job.restart_count,
        membership_changes=job.membership_changes,
        waiting_since=job.waiting_since,
        world_size=job.world_size,
        last_step=job.last_step,
        total_steps=job.total_steps,
        last_loss=job.last_loss,
        message=job.message,
    )


def attempt_public(attempt: Attempt) -> AttemptPublic:
    members = [
        MemberPublic(
            node_id=m.node_id,
            node_name=m.node.name,
            state=m.state,
            joined_at=m.joined_at,
            left_at=m.left_at,
            exit_code=m.exit_code,
        )
        for m in attempt.members
    ]
    return AttemptPublic(
        id=attempt.id,
        number=attempt.number,
        rdzv_id=attempt.rdzv_id,
        rdzv_endpoint=attempt.rdzv_endpoint,
        state=attempt.state,
        world_size=attempt.world_size,
        created_at=attempt.created_at,
        ended_at=attempt.ended_at,
        result=attempt.result,
        members=members,
    )


@router.post("", response_model=JobPublic, status_code=status.HTTP_201_CREATED)
def submit(body: JobCreate, session: SessionDep, now: NowDep) -> JobPublic:
    job = jobs.submit_job(session, body, now)
    return job_public(job)


@router.get("", response_model=JobsPublic)
def list_jobs(
    session: SessionDep,
    state: JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> JobsPublic:
    items, total = jobs.list_jobs(session, state, limit, offset)
    return JobsPublic(items=[job_public(j) for j in items], total=total, limit=limit, offset=offset)


@router.get("/{job_id}", response_model=JobDetail)
def get_job(job_id: int, session: SessionDep) -> JobDetail:
    job = jobs.get_job(session, job_id)
    attempts = [attempt_public(a) for a in job.attempts]
    return JobDetail(**job_public(job).model_dump(), attempts=attempts)


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel(job_id: int, factory: FactoryDep, now: NowDep) -> JobPublic:
    return retry_on_stale(factory, lambda s: job_public(jobs.cancel_job(s, job_id, now)))


@router.get("/{job_id}/events", response_model=EventsPublic)
def events(
    job_id: int, session: SessionDep, after_id: AfterId = 0, limit: Limit = 500
) -> EventsPublic:
    rows = jobs.job_events(session, job_id, after_id, limit)
    return EventsPublic(items=[EventPublic.model_validate(r) for r in rows])


@router.get("/{job_id}/metrics", response_model=MetricsPublic)
def metrics(
    job_id: int, session: SessionDep, after_id: AfterId = 0, limit: Limit = 1000
) -> MetricsPublic:
    rows = jobs.job_metrics(session, job_id, after_id, limit)
    return MetricsPublic(items=[MetricPublic.model_validate(r) for r in rows])


@router.get("/{job_id}/logs", response_model=LogsPublic)
def logs(
    job_id: int,
    session: SessionDep,
    after_id: AfterId = 0,
    limit: Limit = 1000,
    local_rank: Annotated[int | None, Query(ge=0)] = None,
    node_id: Annotated[int | None, Query(ge=0)] = None,
) -> LogsPublic:
    rows = jobs.job_logs(session, job_id, after_id, limit, local_rank, node_id)
    return LogsPublic(items=[LogPublic.model_validate(r) for r in rows])


@router.get("/{job_id}/snapshots", response_model=SnapshotsPublic)
def snapshots(job_id: int, session: SessionDep) -> SnapshotsPublic:
    rows = jobs.job_snapshots(session, job_id)
    return SnapshotsPublic(items=[SnapshotPublic.model_validate(r) for r in rows])
