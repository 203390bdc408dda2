"""Routes for jobs: submit, watch, cancel."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response, status
from sqlalchemy.orm import Session

from service import jobs, nodes
from service.anatomy import Recovery
from service.api.deps import (
    MAX_ID,
    AnswersDep,
    FactoryDep,
    IdPath,
    KeyringDep,
    NowDep,
    Offset,
    PageLimit,
    ReadFactoryDep,
    ReadSessionDep,
    SettingsDep,
    UserDep,
    WakeDep,
)
from service.db import retry_on_stale, transaction
from service.models import Attempt, Job, Role, User
from service.placement import stored_device
from service.schemas import (
    REDACTED,
    AttemptPublic,
    EventPublic,
    EventsPublic,
    JobCreate,
    JobDetail,
    JobPublic,
    JobsPublic,
    LogPublic,
    LogsPublic,
    MemberPublic,
    MetricPublic,
    MetricsPublic,
    NodesNow,
    PhasePublic,
    RecoveriesPublic,
    RecoveryPublic,
    SnapshotPublic,
    SnapshotsPublic,
)
from service.states import JobState

router = APIRouter(prefix="/jobs", tags=["jobs"])

AfterId = Annotated[
    int, Query(ge=0, le=MAX_ID, description="Only items with a larger id (for polling)")
]


def job_public(
    job: Job, last_snapshot_at: datetime | None = None, step_time_s: float | None = None
) -> JobPublic:
    spec = job.job_spec.model_copy(update={"env": dict.fromkeys(job.job_spec.env, REDACTED)})
    return JobPublic(
        id=job.id,
        name=job.name,
        owner=job.owner.name if job.owner else None,
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
        step_time_s=step_time_s,
        message=job.message,
        last_snapshot_at=last_snapshot_at,
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
            gpus=m.gpus,
        )
        for m in attempt.members
    ]
    return AttemptPublic(
        id=attempt.id,
        number=attempt.number,
        rdzv_id=attempt.rdzv_id,
        state=attempt.state,
        device=stored_device(attempt.device),
        world_size=attempt.world_size,
        created_at=attempt.created_at,
        ended_at=attempt.ended_at,
        result=attempt.result,
        members=members,
    )


IdempotencyKeyHeader = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        description="Send the same key again (after a timeout, say) to get the job the first "
        "submit made instead of a second job; the same key with another body is refused (422)",
    ),
]


@router.post(
    "",
    response_model=JobPublic,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": JobPublic, "description": "Idempotency-Key seen before: that job"},
        409: {"description": "A limit of the user's would be passed"},
    },
)
def submit(
    body: JobCreate,
    user: UserDep,
    factory: FactoryDep,
    settings: SettingsDep,
    keyring: KeyringDep,
    now: NowDep,
    wake: WakeDep,
    response: Response,
    idempotency_key: IdempotencyKeyHeader = None,
) -> JobPublic:
    limits = jobs.Limits(settings.default_max_active_jobs, settings.default_max_nodes)

    def work(session: Session) -> tuple[JobPublic, bool]:
        job, created = jobs.submit_job(session, body, user, now, limits, keyring, idempotency_key)
        return job_public(job), created

    # A submit with the same key that commits first makes this one's try stale; the
    # next try finds that job.
    public, created = retry_on_stale(factory, work)
    wake(0.0)  # placed by the next pass, after the reconciler's rest, not its interval
    if not created:
        response.status_code = status.HTTP_200_OK
    return public


@router.get("", response_model=JobsPublic)
def list_jobs(
    factory: ReadFactoryDep,
    user: UserDep,
    answers: AnswersDep,
    state: JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Offset = 0,
) -> Response:
    # An admin sees every job, so all admins share one page; a user's page is their own.
    key = ("jobs", None if user.role is Role.ADMIN else user.id, state, limit, offset)
    with transaction(factory) as session:
        answer = answers.answer(
            key,
            lambda: jobs.jobs_version(session, user, state, limit, offset),
            lambda: jobs_page(session, user, state, limit, offset),
        )
    return answer.response()


def jobs_page(session: Session, user: User, state: JobState | None, limit: int, offset: int) -> str:
    items, total = jobs.list_jobs(session, user, state, limit, offset)
    ids = [j.id for j in items]
    saved = jobs.last_snapshot_times(session, ids)
    step_times = jobs.last_step_times(session, ids)
    return JobsPublic(
        items=[job_public(j, saved.get(j.id), step_times.get(j.id)) for j in items],
        total=total,
        limit=limit,
        offset=offset,
    ).model_dump_json()


@router.get("/{job_id}", response_model=JobDetail)
def get_job(
    job_id: IdPath, factory: ReadFactoryDep, user: UserDep, answers: AnswersDep
) -> Response:
    with transaction(factory) as session:
        answer = answers.answer(
            ("job", job_id),
            # NotFound for another user's job, before any kept body is looked at.
            lambda: jobs.job_version(session, job_id, user),
            lambda: job_detail(session, job_id, user),
        )
    return answer.response()


def job_detail(session: Session, job_id: int, user: User) -> str:
    job = jobs.job_for(session, job_id, user)
    attempts = [attempt_public(a) for a in job.attempts]
    saved = jobs.last_snapshot_times(session, [job.id]).get(job.id)
    step_time = jobs.last_step_times(session, [job.id]).get(job.id)
    device = attempts[-1].device if attempts else None
    nodes_now = None
    if job.state.is_placeable():
        alive, idle = nodes.alive_and_idle(session)
        nodes_now = NodesNow(alive=alive, idle=idle)
    return JobDetail(
        **job_public(job, saved, step_time).model_dump(),
        device=device,
        attempts=attempts,
        nodes_now=nodes_now,
    ).model_dump_json()


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel(job_id: IdPath, user: UserDep, factory: FactoryDep, now: NowDep) -> JobPublic:
    return retry_on_stale(factory, lambda s: job_public(jobs.cancel_job(s, job_id, user, now)))


@router.get("/{job_id}/events", response_model=EventsPublic)
def events(
    job_id: IdPath,
    session: ReadSessionDep,
    user: UserDep,
    after_id: AfterId = 0,
    limit: PageLimit = 500,
) -> EventsPublic:
    rows = jobs.job_events(session, job_id, user, after_id, limit)
    return EventsPublic(items=[EventPublic.model_validate(r) for r in rows])


@router.get("/{job_id}/recoveries", response_model=RecoveriesPublic)
def recoveries(job_id: IdPath, session: ReadSessionDep, user: UserDep) -> RecoveriesPublic:
    """Each restart or re-form of the job, oldest first, with how long its phases took:
    detection, rendezvous, process start, imports, process group, snapshot load, first
    step. A phase the workers did not report is null, and the next one covers it."""
    found = jobs.job_recoveries(session, job_id, user)
    return RecoveriesPublic(items=[recovery_public(r) for r in found])


def recovery_public(recovery: Recovery) -> RecoveryPublic:
    return RecoveryPublic(
        cause=recovery.cause,
        moments={name: at for name, (at, _) in recovery.moments.items()},
        clocks={name: clock for name, (_, clock) in recovery.moments.items()},
        phases=[PhasePublic.model_validate(phase) for phase in recovery.phases],
        total_s=recovery.total_s,
    )


@router.get("/{job_id}/metrics", response_model=MetricsPublic)
def metrics(
    job_id: IdPath,
    session: ReadSessionDep,
    user: UserDep,
    after_id: AfterId = 0,
    limit: PageLimit = 1000,
) -> MetricsPublic:
    rows = jobs.job_metrics(session, job_id, user, after_id, limit)
    return MetricsPublic(items=[MetricPublic.model_validate(r) for r in rows])


@router.get("/{job_id}/logs", response_model=LogsPublic)
def logs(
    job_id: IdPath,
    session: ReadSessionDep,
    user: UserDep,
    after_id: AfterId = 0,
    limit: PageLimit = 1000,
    local_rank: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    node_id: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
) -> LogsPublic:
    rows = jobs.job_logs(session, job_id, user, after_id, limit, local_rank, node_id)
    return LogsPublic(items=[LogPublic.model_validate(r) for r in rows])


@router.get("/{job_id}/snapshots", response_model=SnapshotsPublic)
def snapshots(
    job_id: IdPath,
    session: ReadSessionDep,
    user: UserDep,
    limit: PageLimit = 1000,
    offset: Offset = 0,
) -> SnapshotsPublic:
    rows = jobs.job_snapshots(session, job_id, user, limit, offset)
    return SnapshotsPublic(items=[SnapshotPublic.model_validate(r) for r in rows])
