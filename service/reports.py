"""What nodes report about their attempts: logs, runtime events, and how they ended.

A report counts only if the node is an active member of a running attempt
(fencing): a node that was paused or cut off and comes back cannot write into
an attempt that has since been replaced. Its final exit report is still
recorded, so the timeline says its processes are gone.
"""

from __future__ import annotations

import logging
import math
import re
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from contract.protocol import AttemptExit, AttemptReport, EventKind, RuntimeEvent, StopReason
from service.attempts import drop_member, end_attempt, end_member, find_member
from service.errors import Fenced
from service.jobs import add_event, change_job_state, get_job
from service.models import Attempt, AttemptMember, Job, LogEntry, Metric, Node, Snapshot
from service.nodes import get_node
from service.schemas import JobSpec
from service.states import AttemptState, JobState, MemberState

logger = logging.getLogger(__name__)


def handle_report(session: Session, node_id: int, report: AttemptReport, now: datetime) -> None:
    node = get_node(session, node_id)
    attempt = session.get(Attempt, report.attempt_id)
    member = find_member(session, report.attempt_id, node_id) if attempt else None
    if attempt is None or member is None:
        raise Fenced(f"node {node_id} is not a member of attempt {report.attempt_id}")
    live = attempt.state is AttemptState.RUNNING and member.state is MemberState.ACTIVE
    if not live:
        if report.exit is not None:
            _record_stale_exit(session, member, report.exit, now)
            return
        cancelled = attempt.job.state is JobState.CANCELLED
        reason = StopReason.CANCELLED if cancelled else StopReason.FENCED
        raise Fenced(f"attempt {attempt.id} is over for node {node.name}; stop it", reason)
    job = get_job(session, attempt.job_id, for_update=True)
    _store_logs(session, job, attempt, node, report)
    for event in report.events:
        _apply_event(session, job, attempt, node, event, now)
    if report.exit is not None:
        _apply_exit(session, job, member, report.exit, now)


def _store_logs(
    session: Session, job: Job, attempt: Attempt, node: Node, report: AttemptReport
) -> None:
    session.add_all(
        LogEntry(
            job_id=job.id,
            attempt_id=attempt.id,
            node_id=node.id,
            time=line.time,
            local_rank=line.local_rank,
            global_rank=line.global_rank,
            stream=line.stream,
            line=line.line,
        )
        for line in report.logs
    )


def _apply_event(
    session: Session, job: Job, attempt: Attempt, node: Node, event: RuntimeEvent, now: datetime
) -> None:
    data = event.data
    ids: dict[str, Any] = {"attempt_id": attempt.id, "node_id": node.id, "data": data}
    kind = event.kind
    if kind is EventKind.RENDEZVOUS:
        world = _int_or(data.get("world_size"), 0) or None
        attempt.world_size = job.world_size = world
        if data.get("group_rank") == 0:
            add_event(
                session,
                job.id,
                "rendezvous",
                f"rendezvous of attempt {attempt.number} complete: world size {world}, "
                f"{data.get('group_world_size')} node(s)",
                event.time,
                **ids,
            )
        if job.state is JobState.RESTARTING:
            change_job_state(session, job, JobState.RUNNING, now, message="")
    elif kind is EventKind.WORKER_FAILED:
        _apply_worker_failed(session, job, attempt, node, event, now, ids)
    elif kind is EventKind.HANG:
        add_event(
            session,
            job.id,
            "hang_detected",
            f"worker rank {data.get('global_rank')} (local rank {data.get('local_rank')} on "
            f"node {node.name}) made no progress for {data.get('idle_s')} s (hang_timeout_s "
            f"{data.get('timeout_s')}); its stack dump is in the logs, the workers restart",
            event.time,
            **ids,
        )
    elif kind is EventKind.STARTED:
        _apply_started(session, job, attempt, event, now, ids)
    elif kind is EventKind.PROGRESS:
        session.add(
            Metric(
                job_id=job.id,
                attempt_id=attempt.id,
                time=event.time,
                step=_int_or(data.get("step"), 0),
                epoch=_int_or(data.get("epoch"), 0),
                loss=_float_or_none(data.get("loss")),
                samples_per_s=_float_or_none(data.get("samples_per_s")),
                world_size=_int_or(data.get("world_size"), 0),
            )
        )
        job.last_step = _int_or(data.get("step"), 0)
        job.last_loss = _float_or_none(data.get("loss"))
    elif kind is EventKind.SNAPSHOT:
        session.add(
            Snapshot(
                job_id=job.id,
                attempt_id=attempt.id,
                step=_int_or(data.get("step"), 0),
                epoch=_int_or(data.get("epoch"), 0),
                path=str(data.get("path", ""))[:4096],
                bytes=_int_or(data.get("bytes"), 0, bits=64),
                sha256=_sha256_or_none(data.get("sha256")),
                world_size=_int_or_none(data.get("world_size")),
                created_at=event.time,
            )
        )
        add_event(
            session,
            job.id,
            "snapshot_saved",
            f"snapshot saved at step {data.get('step')}",
            event.time,
            **ids,
        )
    elif kind in _SNAPSHOT_TROUBLE:
        name, what, field = _SNAPSHOT_TROUBLE[kind]
        message = f"snapshot at step {data.get('step')} {what}: {str(data.get(field, ''))[:500]}"
        add_event(session, job.id, name, message, event.time, **ids)
    elif kind is EventKind.FINISHED:
        job.last_step = _int_or(data.get("step"), job.last_step or 0)
        add_event(
            session,
            job.id,
            "training_finished",
            f"training finished at step {data.get('step')}, loss {data.get('loss')}",
            event.time,
            **ids,
        )
    elif kind is EventKind.LAUNCHER_EXIT:
        pass  # the exit report carries the outcome


def _apply_worker_failed(
    session: Session,
    job: Job,
    attempt: Attempt,
    node: Node,
    event: RuntimeEvent,
    now: datetime,
    ids: dict[str, Any],
) -> None:
    """Count a worker failure against the job's one restart budget, or fail the job.

    Failures that arrive while the job is already RESTARTING belong to the same
    incident and are not counted again. A worker whose collective broke because
    a peer went away ("peer_lost") is not counted at all: the peer reports its
    own failure if it lives, and a peer that died with its node is a membership
    change.
    """
    data = event.data
    cause = str(data.get("cause") or "crash")
    add_event(
        session,
        job.id,
        "worker_failed",
        f"worker rank {data.get('global_rank')} (local rank {data.get('local_rank')} on "
        f"node {node.name}) {_exit_text(data)} [{cause.replace('_', ' ')}]",
        event.time,
        **ids,
    )
    if not job.state.is_active():
        return
    if data.get("fatal"):
        _fail_job(session, job, attempt, now, f"{cause.replace('_', ' ')}: {_exit_text(data)}")
        return
    if job.state is not JobState.RUNNING or cause == "peer_lost":
        return
    spec = JobSpec.model_validate(job.spec)
    job.restart_count += 1
    if job.restart_count > spec.max_restarts:
        _fail_job(
            session,
            job,
            attempt,
            now,
            f"restart budget spent: {job.restart_count} worker failures, max_restarts "
            f"{spec.max_restarts}; the last: {_exit_text(data)}",
        )
        return
    change_job_state(session, job, JobState.RESTARTING, now, message=f"worker failed ({cause})")
    delay = spec.restart_policy().delay_s(job.restart_count)
    add_event(
        session,
        job.id,
        "restarting",
        f"restarting the workers after a {cause.replace('_', ' ')} (restart "
        f"{job.restart_count} of {spec.max_restarts}"
        + (f", after {delay:g} s back-off)" if delay else ")"),
        event.time,
        **{**ids, "data": {"cause": cause, "restart": job.restart_count, "backoff_s": delay}},
    )


def _fail_job(session: Session, job: Job, attempt: Attempt, now: datetime, why: str) -> None:
    """End the attempt and the job; the nodes stop the attempt's processes."""
    if attempt.state is AttemptState.RUNNING:
        end_attempt(session, attempt, AttemptState.FAILED, now, why[:2000])
    change_job_state(session, job, JobState.FAILED, now, message=why[:2000])
    add_event(session, job.id, "failed", f"job failed: {why}", now, attempt_id=attempt.id)


def _apply_started(
    session: Session,
    job: Job,
    attempt: Attempt,
    event: RuntimeEvent,
    now: datetime,
    ids: dict[str, Any],
) -> None:
    data = event.data
    attempt.started_count += 1
    world = data.get("world_size")
    if data.get("total_steps") is not None:
        job.total_steps = _int_or_none(data["total_steps"])
    resumed = data.get("resumed_from_step")
    if resumed is not None:
        message = f"training resumed from snapshot at step {resumed} (world size {world})"
        kind = "resumed"
    else:
        message = f"training started from scratch (world size {world})"
        kind = "training_started"
    add_event(session, job.id, kind, message, event.time, **ids)
    if job.state is JobState.RESTARTING:
        change_job_state(session, job, JobState.RUNNING, now, message="")


def _apply_exit(
    session: Session, job: Job, member: AttemptMember, exit: AttemptExit, now: datetime
) -> None:
    attempt, node = member.attempt, member.node
    if exit.outcome == "stopped" and attempt.state is AttemptState.RUNNING:
        # The node's agent stopped its part of a live attempt (it is shutting down):
        # a membership change, and the other nodes re-form without it.
        drop_member(session, member, now, "its agent stopped it", exit.exit_code)
    else:
        new_member_state = MemberState.LEFT if exit.outcome == "stopped" else MemberState.EXITED
        end_member(session, member, new_member_state, now, exit.exit_code)
    ids: dict[str, Any] = {"attempt_id": attempt.id, "node_id": node.id}
    if exit.outcome == "succeeded":
        add_event(session, job.id, "node_finished", f"node {node.name} finished", now, **ids)
        if attempt.state is AttemptState.RUNNING:
            end_attempt(session, attempt, AttemptState.SUCCEEDED, now, "workers succeeded")
        if job.state.is_active():
            change_job_state(session, job, JobState.SUCCEEDED, now, message="succeeded")
            add_event(session, job.id, "succeeded", "job succeeded", now, **ids)
    elif exit.outcome == "failed":
        why = exit.message or f"launcher exited with code {exit.exit_code}"
        add_event(session, job.id, "node_failed", f"node {node.name} failed: {why}", now, **ids)
        if job.state.is_active():
            _launcher_failed(session, job, attempt, exit, why, now)
        elif attempt.state is AttemptState.RUNNING:
            end_attempt(session, attempt, AttemptState.FAILED, now, why)
    else:
        _record_stopped(session, job.id, node, attempt, exit, now)


def _launcher_failed(
    session: Session, job: Job, attempt: Attempt, exit: AttemptExit, why: str, now: datetime
) -> None:
    """A node's launcher gave up. Fatal: the job fails. Otherwise the controller re-forms
    the job itself (a new attempt, after the back-off), which costs one restart."""
    spec = JobSpec.model_validate(job.spec)
    if exit.fatal or job.restart_count + 1 > spec.max_restarts:
        _fail_job(session, job, attempt, now, why)
        return
    end_attempt(session, attempt, AttemptState.FAILED, now, why[:2000])
    job.restart_count += 1
    delay = spec.restart_policy().delay_s(job.restart_count)
    change_job_state(session, job, JobState.WAITING, now, message="relaunching")
    job.waiting_since, job.not_before = now, now + timedelta(seconds=delay)
    add_event(
        session,
        job.id,
        "restarting",
        f"the launcher of attempt {attempt.number} failed; the job is placed again as a new "
        f"attempt (restart {job.restart_count} of {spec.max_restarts}"
        + (f", after {delay:g} s back-off)" if delay else ")"),
        now,
        attempt_id=attempt.id,
        data={"cause": "launcher_failed", "restart": job.restart_count, "backoff_s": delay},
    )


def _record_stale_exit(
    session: Session, member: AttemptMember, exit: AttemptExit, now: datetime
) -> None:
    end_member(session, member, MemberState.LEFT, now, exit.exit_code)
    _record_stopped(session, member.attempt.job_id, member.node, member.attempt, exit, now)


def _record_stopped(
    session: Session, job_id: int, node: Node, attempt: Attempt, exit: AttemptExit, now: datetime
) -> None:
    left = "nothing left running" if exit.clean else "SOME PROCESSES SURVIVED"
    if attempt.state is AttemptState.SUCCEEDED:
        left = f"released after the job succeeded, {left}"
    add_event(
        session,
        job_id,
        "node_stopped",
        f"node {node.name} stopped attempt {attempt.number}: {left}",
        now,
        attempt_id=attempt.id,
        node_id=node.id,
        data={"clean": exit.clean, "outcome": exit.outcome},
    )


# Runtime events about a snapshot that was not written or not used:
# (timeline kind, what happened, the data field that says why).
_SNAPSHOT_TROUBLE = {
    EventKind.SNAPSHOT_FAILED: ("snapshot_failed", "failed, training goes on", "error"),
    EventKind.SNAPSHOT_SKIPPED: ("snapshot_skipped", "skipped on resume", "reason"),
}


def _int_or(value: Any, default: int, bits: int = 32) -> int:
    number = _int_or_none(value, bits)
    return default if number is None else number


def _int_or_none(value: Any, bits: int = 32) -> int | None:
    """A number for a column of ``bits`` bits, or None for what is not one (or does not
    fit)."""
    try:
        number = None if value is None else int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    bound = 2 ** (bits - 1)
    return number if number is None or -bound <= number < bound else None


def _sha256_or_none(value: Any) -> str | None:
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value):
        return value
    return None


def _float_or_none(value: Any) -> float | None:
    """A finite number, or None (NaN and infinities are not valid JSON to send back)."""
    try:
        number = None if value is None else float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number is None or math.isfinite(number) else None


def _exit_text(data: dict[str, Any]) -> str:
    code = f"exited with code {data.get('exitcode')}"
    message = str(data.get("message") or "")[:500]
    return code if not message or message.startswith(code) else f"{code}: {message}"
