"""What nodes report about their attempts: logs, runtime events, and how they ended.

A report counts only if the node is an active member of a running attempt
(fencing): a node that was paused or cut off and comes back cannot write into
an attempt that has since been replaced. Its final exit report is still
recorded, so the timeline says its processes are gone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, and_, bindparam, insert, select, update
from sqlalchemy.orm import Session

from contract.events import (
    UNCHARGED_CAUSES,
    ColdStarted,
    EventData,
    HangDetected,
    LauncherExited,
    RendezvousComplete,
    SnapshotFailed,
    SnapshotSaved,
    SnapshotSkipped,
    TrainingFinished,
    TrainingProgress,
    TrainingStarted,
    WorkerFailed,
    ZygoteChanged,
)
from contract.protocol import AttemptExit, AttemptReport, StopReason
from service import auth
from service.attempts import active_members, drop_member, end_attempt, end_member
from service.errors import Fenced
from service.job_events import (
    add_event,
    last_event_id,
    last_membership_change,
    last_round_event,
)
from service.jobs import change_job_state, get_job
from service.models import (
    Attempt,
    AttemptMember,
    Job,
    LogEntry,
    Metric,
    Node,
    Snapshot,
    table_of,
)
from service.states import AttemptState, JobState, MemberState
from service.transitions import write

logger = logging.getLogger(__name__)


class NotTheNodesToken(Exception):
    """A report that does not carry its node's token (or names no node): nothing was
    written. The route checks the call again as every node route's is (401, 403)."""


def handle_report(
    session: Session, node_id: int, report: AttemptReport, now: datetime, token: str | None
) -> bool:
    """Apply ``report``, sent with ``token``, which must be node ``node_id``'s token
    (``NotTheNodesToken``): checked in this transaction, in which the node's row is read
    anyway, rather than in one of its own before it. Whether its events were applied
    (False: only the late exit of an attempt that is over for the node was recorded).
    ``Fenced`` if the node may not report on the attempt."""
    if _progress_only(report) and _apply_progress(session, node_id, report, token):
        return True
    node, attempt, member = _reporter(session, node_id, report.attempt_id, report.member_id)
    if node is None or not auth.hashes_to(token, node.token_hash):
        raise NotTheNodesToken
    if attempt is None or member is None:
        raise Fenced(f"node {node_id} is not a member of attempt {report.attempt_id}")
    live = attempt.state is AttemptState.RUNNING and member.state is MemberState.ACTIVE
    if not live:
        if report.exit is not None:
            _record_stale_exit(session, member, report.exit, now)
            return False
        cancelled = attempt.job.state is JobState.CANCELLED
        reason = StopReason.CANCELLED if cancelled else StopReason.FENCED
        raise Fenced(f"attempt {attempt.id} is over for node {node.name}; stop it", reason)
    job = get_job(session, attempt.job_id, for_update=True)
    _store_logs(session, job.id, attempt.id, node.id, report)
    changed = _MembersChanged(session, attempt.id)
    round_ = _Round()
    for event in report.events:
        applied = _Applied(session, job, attempt, node, member, event.time, now, changed, round_)
        _apply_event(event.data, applied)
    if report.exit is not None:
        _apply_exit(session, job, member, report.exit, now)
    return True


def _progress_only(report: AttemptReport) -> bool:
    """Whether ``report`` only says how far training is (log lines, progress without a
    worker's start): what a training job reports all through its run, and nothing in it
    changes the state of its job, attempt or membership."""
    return report.exit is None and all(
        isinstance(e.data, TrainingProgress) and e.data.startup is None for e in report.events
    )


def _apply_progress(
    session: Session, node_id: int, report: AttemptReport, token: str | None
) -> bool:
    """Apply a ``_progress_only`` report with plain statements: one read of the columns its
    fencing checks, then the job's last step and loss, its metrics and its log lines. The
    general path reads the node, attempt, membership and job as ORM rows, and holds the
    job's row locked (``SELECT ... FOR UPDATE``) through all of that Python until its
    commit, so that a job's reports queued behind each other. Here the job's UPDATE
    takes the weaker lock that an UPDATE takes, which lets others' inserts that refer to
    the job go on, and holds it only for the inserts that follow. It comes first, as the
    general path's lock does, so that the rows this transaction locks are locked in the
    same order as before: the inserts' foreign-key checks lock the attempt's and the
    node's rows for share, and taking those before the job's could deadlock with a
    transaction that locks the job and then a node. False, having written nothing, if
    the node may not report on the attempt: the general path says why (``Fenced``)."""
    params = {"node_id": node_id, "attempt_id": report.attempt_id}
    if report.member_id is None:
        row = session.execute(_FENCING_NEWEST, params).first()
    else:
        row = session.execute(_FENCING, {**params, "member_id": report.member_id}).first()
    if row is None or not auth.hashes_to(token, row.token_hash):
        raise NotTheNodesToken
    live = row.attempt_state is AttemptState.RUNNING and row.member_state is MemberState.ACTIVE
    if not live:
        return False
    # every event, as _progress_only found (the test narrows their type)
    progress = [(e.time, e.data) for e in report.events if isinstance(e.data, TrainingProgress)]
    if progress:
        last = progress[-1][1]
        step = {"job_id": row.job_id, "step": last.step, "loss": last.loss}
        session.execute(_SET_PROGRESS, step)
        metrics = [_metric_row(row.job_id, report.attempt_id, t, data) for t, data in progress]
        session.execute(_INSERT_METRIC, metrics)
    _store_logs(session, row.job_id, report.attempt_id, node_id, report)
    return True


def _reporter(
    session: Session, node_id: int, attempt_id: int, member_id: int | None
) -> tuple[Node | None, Attempt | None, AttemptMember | None]:
    """The node, the attempt it reports on, and its membership ``member_id`` of that attempt
    (None: its newest), each None if there is none, in one statement: a report used to
    read them in three round trips before it took its job's lock."""
    params = {"node_id": node_id, "attempt_id": attempt_id}
    if member_id is None:
        row = session.execute(_REPORTER_NEWEST, params).first()
    else:
        row = session.execute(_REPORTER, {**params, "member_id": member_id}).first()
    if row is None:
        return None, None, None
    node, attempt, member = row
    return node, attempt, member


_NODES, _ATTEMPTS, _MEMBERS = table_of(Node).c, table_of(Attempt).c, table_of(AttemptMember).c


def _reporter_statement(*what: Any, named_member: bool) -> Select[Any]:
    """``what`` of the node, the attempt it reports on and its membership of that attempt
    (with ``named_member``, the one named; else its newest), in one statement."""
    membership = and_(_MEMBERS.attempt_id == _ATTEMPTS.id, _MEMBERS.node_id == _NODES.id)
    if named_member:
        membership = and_(membership, _MEMBERS.id == bindparam("member_id"))
    return (
        select(*what)
        .select_from(table_of(Node))
        .outerjoin(table_of(Attempt), _ATTEMPTS.id == bindparam("attempt_id"))
        .outerjoin(table_of(AttemptMember), membership)
        .where(_NODES.id == bindparam("node_id"))
        .order_by(_MEMBERS.id.desc())
        .limit(1)
    )


# Built once: building a statement costs more than running it. ``_reporter`` loads the rows;
# ``_apply_progress`` reads only the columns its fencing checks.
_REPORTER_NEWEST = _reporter_statement(Node, Attempt, AttemptMember, named_member=False)
_REPORTER = _reporter_statement(Node, Attempt, AttemptMember, named_member=True)
_FENCED_BY = (
    _NODES.token_hash,
    _ATTEMPTS.job_id,
    _ATTEMPTS.state.label("attempt_state"),
    _MEMBERS.state.label("member_state"),
)
_FENCING_NEWEST = _reporter_statement(*_FENCED_BY, named_member=False)
_FENCING = _reporter_statement(*_FENCED_BY, named_member=True)
_SET_PROGRESS = (
    update(table_of(Job))
    .where(table_of(Job).c.id == bindparam("job_id"))
    .values(last_step=bindparam("step"), last_loss=bindparam("loss"))
)
# Rows a report adds, inserted as they come rather than at the session's flush, as plain
# INSERTs (the tables', without the ORM's bulk machinery).
_INSERT_LOGS = insert(table_of(LogEntry))
_INSERT_METRIC = insert(table_of(Metric))
_INSERT_SNAPSHOT = insert(table_of(Snapshot))


def _store_logs(
    session: Session, job_id: int, attempt_id: int, node_id: int, report: AttemptReport
) -> None:
    if not report.logs:
        return
    rows = [
        {
            "job_id": job_id,
            "attempt_id": attempt_id,
            "node_id": node_id,
            "time": line.time,
            "local_rank": line.local_rank,
            "global_rank": line.global_rank,
            "stream": line.stream,
            "line": line.line,
        }
        for line in report.logs
    ]
    session.execute(_INSERT_LOGS, rows)


@dataclass
class _Round:
    """How much of a worker start the node's current rendezvous round has on the timeline
    as ``first_step``: ``NONE``, ``PARTIAL`` (moments without the first step) or
    ``COMPLETE``; None until looked up, once per report.

    The job's own code decides which progress reports carry ``startup``, so at most one
    partial and one complete ``first_step`` go on the timeline per round and node.
    """

    NONE = 0
    PARTIAL = 1
    COMPLETE = 2

    written: int | None = None

    def due(self, session: Session, attempt_id: int, node_id: int, complete: bool) -> bool:
        """Whether a ``first_step`` (``complete``: with the first step's moment) is new."""
        if self.written is None:
            last = last_round_event(session, attempt_id, node_id)
            if last is None or last.kind != "first_step":
                self.written = self.NONE
            else:
                moments = (last.data or {}).get("startup") or {}
                self.written = self.COMPLETE if moments.get("first_step_at") else self.PARTIAL
        return self.written == self.NONE or (complete and self.written == self.PARTIAL)


@dataclass
class _MembersChanged:
    """When the attempt's members last changed (``last_membership_change``), looked up once
    per report and only if one of its events goes on the timeline: most progress reports
    put none there, and saved the round trip. A report's own membership changes (an exit's)
    come after its events."""

    session: Session
    attempt_id: int

    @functools.cached_property
    def at(self) -> datetime | None:
        return last_membership_change(self.session, self.attempt_id)


@dataclass(frozen=True)
class _Applied:
    """Where an event is applied: the node's report on a running attempt of ``job``."""

    session: Session
    job: Job
    attempt: Attempt
    node: Node
    member: AttemptMember  # the node's membership of the attempt
    time: datetime  # when the node saw it
    now: datetime  # when the controller applies it
    members_changed: _MembersChanged | None = None  # the attempt's last membership change
    round_state: _Round = field(default_factory=_Round)  # the node's current rendezvous round

    @property
    def timeline_time(self) -> datetime:
        """When the event goes on the timeline: when the node saw it, but never before the
        attempt's last membership change that the timeline already holds.

        The timeline lists events in the order the controller learned them. A node's
        clock, and the heartbeat timeout after which the controller declares a node
        lost, can put a node's event (the workers' rendezvous at the smaller world
        size, their resume) seconds before the membership change that caused it; an
        event learned after the change is stamped no earlier than the change, so the
        timeline reads cause before effect in both order and time.
        """
        changed = None if self.members_changed is None else self.members_changed.at
        if changed is None:
            return self.time
        return max(self.time, changed)

    def add_event(self, kind: str, message: str, data: EventData) -> None:
        """Put ``kind`` on the job's timeline with the event's payload, at
        ``timeline_time``."""
        add_event(
            self.session,
            self.job.id,
            kind,
            message,
            self.timeline_time,
            attempt_id=self.attempt.id,
            node_id=self.node.id,
            data=data.model_dump(mode="json"),
        )

    def back_to_running(self) -> None:
        """A job that restarts runs again once its workers do."""
        if self.job.state is JobState.RESTARTING:
            change_job_state(self.session, self.job, JobState.RUNNING, self.now, message="")


@functools.singledispatch
def _apply_event(data: EventData, at: _Applied) -> None:
    """Apply one runtime event, by the type of its payload (one handler per kind)."""
    raise TypeError(f"no handler for a {type(data).__name__} event")


@_apply_event.register
def _rendezvous(data: RendezvousComplete, at: _Applied) -> None:
    """Record a completed rendezvous round (once, from the node of group rank 0).

    A round that shrank the world while the controller still counts more active
    members than the round has nodes went ahead without a node the controller has not
    yet found gone (its heartbeat has not timed out). The timeline then says so first,
    so the cause comes before the smaller rendezvous it explains; the node's own
    ``node_left`` follows when the controller marks it.
    """
    seen = last_event_id(at.session, at.job.id, at.attempt.id) or 0
    write(at.session, at.member, round_reported_after=seen)
    world = data.world_size or None
    before = at.attempt.world_size
    write(at.session, at.attempt, world_size=world)
    write(at.session, at.job, world_size=world)
    if data.group_rank == 0:
        at.round_state.written = _Round.NONE
        members = len(active_members(at.session, at.attempt.id))
        nodes = data.group_world_size
        if world and before and world < before and nodes is not None and nodes < members:
            at.add_event(
                "node_missing",
                f"the workers of attempt {at.attempt.number} re-formed without "
                f"{members - nodes} of its {members} node(s): a node stopped answering in the "
                "rendezvous; the controller drops it when its heartbeat times out",
                data,
            )
        at.add_event(
            "rendezvous",
            f"rendezvous of attempt {at.attempt.number} complete: world size {world}, "
            f"{data.group_world_size} node(s)",
            data,
        )
    at.back_to_running()


@_apply_event.register
def _worker_failed(data: WorkerFailed, at: _Applied) -> None:
    """Count a worker failure against the job's one restart budget, or fail the job.

    Failures that arrive while the job is already RESTARTING belong to the same
    incident and are not counted again. A worker whose collective broke because
    a peer went away ("peer_lost") is not counted at all: the peer reports its
    own failure if it lives, and a peer that died with its node is a membership
    change; nor is a worker its node agent ended because the controller dropped a
    member of the attempt ("membership_change").
    """
    job, cause = at.job, data.cause
    at.add_event(
        "worker_failed",
        f"worker rank {data.global_rank} (local rank {data.local_rank} on "
        f"node {at.node.name}) {_exit_text(data)} [{cause.replace('_', ' ')}]",
        data,
    )
    if not job.state.is_active():
        return
    if data.fatal:
        _fail_job(
            at.session, job, at.attempt, at.now, f"{cause.replace('_', ' ')}: {_exit_text(data)}"
        )
        return
    if job.state is not JobState.RUNNING or cause in UNCHARGED_CAUSES:
        return
    if _of_an_ended_round(at):
        return
    delay = _restart_or_fail(
        at.session,
        job,
        at.attempt,
        at.now,
        cause=cause,
        spent=lambda failures, most: (
            f"restart budget spent: {failures} worker failures, max_restarts {most}; "
            f"the last: {_exit_text(data)}"
        ),
        restarting=f"restarting the workers after a {cause.replace('_', ' ')}",
        time=at.timeline_time,
        node_id=at.node.id,
    )
    if delay is None:
        return
    change_job_state(
        at.session, job, JobState.RESTARTING, at.now, message=f"worker failed ({cause})"
    )


def _of_an_ended_round(at: _Applied) -> bool:
    """Whether this failure is of a round that the attempt's last counted restart already
    ended: its node has reported no completed rendezvous round since that restart.

    A node reports its own events in order, and its workers of a new round start only
    after its rendezvous for that round; so a failure it reports before its next round
    is of the round the restart ended. Two nodes that each found a worker of the same
    round hung (the frozen rank, and its peer waiting for it in a collective) then cost
    one restart, even when the second node's reports come after the first node's
    restart has formed a new round and the job runs again.

    Different nodes' reports arrive on their own schedules, so two races remain, each
    worth one restart at most: a node whose report of the new round arrives before the
    failure that caused the restart has its next failure taken as part of it; and a
    node whose old round and failure arrive together after the restart is counted
    again, as before this rule."""
    last_restart = last_event_id(at.session, at.job.id, at.attempt.id, "restarting")
    if last_restart is None:
        return False
    seen = at.member.round_reported_after
    return seen is None or seen < last_restart


def _hang_timeout_text(data: HangDetected) -> str:
    if data.derivation:
        return f"{data.rule or 'fixed'}: {data.derivation}"
    return f"{data.timeout_s} s"


@_apply_event.register
def _hang(data: HangDetected, at: _Applied) -> None:
    worker = f"worker rank {data.global_rank} (local rank {data.local_rank} on node {at.node.name})"
    if data.rule == "teardown":
        what = (
            f"was stuck in its teardown: it {data.derivation}; its stack dump is in the logs, "
            "and it is ended as finished, without a restart"
        )
    else:
        what = (
            f"made no progress for {data.idle_s} s (hang timeout {_hang_timeout_text(data)}); "
            "its stack dump is in the logs, "
            + (
                "and another node's workers had all finished: it is ended, without a "
                "restart, and its node finishes"
                if data.peers_finished
                else "the workers restart"
            )
        )
    at.add_event("hang_detected", f"{worker} {what}", data)


@_apply_event.register
def _launcher_exit(data: LauncherExited, at: _Applied) -> None:
    pass  # the exit report carries the outcome


@_apply_event.register
def _zygote(data: ZygoteChanged, at: _Applied) -> None:
    if data.state == "ready":
        size = "" if data.rss_bytes is None else f", {data.rss_bytes / 2**20:.0f} MiB"
        took = "" if data.import_s is None else f" after {data.import_s:.1f} s"
        message = f"node {at.node.name}: warm zygote ready{took}{size}; workers start as its forks"
        if data.spare:
            message += " (the node's spare, loaded before the job was placed)"
        elif data.spare_passed_over:
            message += f" (the node's spare could not be this job's: {data.spare_passed_over})"
    else:
        message = f"node {at.node.name}: warm zygote {data.state}: {data.message}"
    at.add_event("zygote", message, data)


@_apply_event.register
def _cold_start(data: ColdStarted, at: _Applied) -> None:
    at.add_event(
        "cold_start",
        f"node {at.node.name}: local rank {data.local_rank} started cold: {data.reason}",
        data,
    )


@_apply_event.register
def _started(data: TrainingStarted, at: _Applied) -> None:
    write(at.session, at.attempt, started_count=at.attempt.started_count + 1)
    if data.total_steps is not None:
        write(at.session, at.job, total_steps=data.total_steps)
    if data.resumed_from_step is not None:
        at.add_event(
            "resumed",
            f"training resumed from snapshot at step {data.resumed_from_step} "
            f"(world size {data.world_size})",
            data,
        )
    else:
        at.add_event(
            "training_started",
            f"training started from scratch (world size {data.world_size})",
            data,
        )
    at.back_to_running()


@_apply_event.register
def _progress(data: TrainingProgress, at: _Applied) -> None:
    at.session.execute(_INSERT_METRIC, _metric_row(at.job.id, at.attempt.id, at.time, data))
    write(at.session, at.job, last_step=data.step, last_loss=data.loss)
    complete = data.startup is not None and data.startup.first_step_at is not None
    # the first report of a worker process; see ``_Round`` for why not every one
    if data.startup is not None and at.round_state.due(
        at.session, at.attempt.id, at.node.id, complete
    ):
        at.round_state.written = _Round.COMPLETE if complete else _Round.PARTIAL
        at.add_event(
            "first_step",
            f"rank 0's new worker process reports its first steps (step {data.step}, "
            f"world size {data.world_size})",
            data,
        )


def _metric_row(
    job_id: int, attempt_id: int, time: datetime, data: TrainingProgress
) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "attempt_id": attempt_id,
        "time": time,
        "step": data.step,
        "epoch": data.epoch,
        "loss": data.loss,
        "samples_per_s": data.samples_per_s,
        "world_size": data.world_size,
        "named": dict(data.metrics) or None,
    }


@_apply_event.register
def _snapshot_saved(data: SnapshotSaved, at: _Applied) -> None:
    snapshot = {
        "job_id": at.job.id,
        "attempt_id": at.attempt.id,
        "step": data.step,
        "epoch": data.epoch,
        "path": data.path,
        "bytes": data.bytes,
        "sha256": data.sha256,
        "world_size": data.world_size,
        "created_at": at.time,
    }
    at.session.execute(_INSERT_SNAPSHOT, snapshot)
    at.add_event("snapshot_saved", f"snapshot saved at step {data.step}", data)


@_apply_event.register
def _snapshot_failed(data: SnapshotFailed, at: _Applied) -> None:
    at.add_event(
        "snapshot_failed",
        f"snapshot at step {data.step} failed, training goes on: {data.error[:500]}",
        data,
    )


@_apply_event.register
def _snapshot_skipped(data: SnapshotSkipped, at: _Applied) -> None:
    at.add_event(
        "snapshot_skipped",
        f"snapshot at step {data.step} skipped on resume: {data.reason[:500]}",
        data,
    )


@_apply_event.register
def _finished(data: TrainingFinished, at: _Applied) -> None:
    write(
        at.session, at.job, last_step=data.step if data.step is not None else at.job.last_step or 0
    )
    at.add_event(
        "training_finished", f"training finished at step {data.step}, loss {data.loss}", data
    )


def _restart_or_fail(
    session: Session,
    job: Job,
    attempt: Attempt,
    now: datetime,
    *,
    cause: str,
    spent: Callable[[int, int], str],
    restarting: str,
    time: datetime,
    node_id: int | None = None,
) -> float | None:
    """Count a failure (``cause``) against the job's one restart budget.

    Within ``max_restarts``: records the "restarting" event (``restarting`` says
    what restarts; "(restart N of M, after D s back-off)" follows) and returns the
    back-off before the restart; the caller moves the job on. Past it: fails the
    attempt and the job with ``spent(failures, max_restarts)`` and returns None.
    Either way the failure is counted in ``job.restart_count``.
    """
    spec = job.job_spec
    job.restart_count += 1
    if job.restart_count > spec.max_restarts:
        _fail_job(session, job, attempt, now, spent(job.restart_count, spec.max_restarts))
        return None
    delay = spec.restart_policy().delay_s(job.restart_count)
    add_event(
        session,
        job.id,
        "restarting",
        f"{restarting} (restart {job.restart_count} of {spec.max_restarts}"
        + (f", after {delay:g} s back-off)" if delay else ")"),
        time,
        attempt_id=attempt.id,
        node_id=node_id,
        data={"cause": cause, "restart": job.restart_count, "backoff_s": delay},
    )
    return delay


def _fail_job(session: Session, job: Job, attempt: Attempt, now: datetime, why: str) -> None:
    """End the attempt and the job; the nodes stop the attempt's processes."""
    if attempt.state is AttemptState.RUNNING:
        end_attempt(session, attempt, AttemptState.FAILED, now, why[:2000])
    change_job_state(session, job, JobState.FAILED, now, message=why[:2000])
    add_event(session, job.id, "failed", f"job failed: {why}", now, attempt_id=attempt.id)


def _apply_exit(
    session: Session, job: Job, member: AttemptMember, exit: AttemptExit, now: datetime
) -> None:
    attempt, node = member.attempt, member.node
    if exit.outcome == "stopped" and attempt.state is AttemptState.RUNNING:
        # The node's agent stopped its part of a live attempt (it is shutting down):
        # a membership change, and the other nodes re-form without it.
        drop_member(session, member, now, "its agent stopped it", exit.exit_code)
    else:
        end_member(session, member, _member_state_after(exit), now, exit.exit_code)
    ids: dict[str, Any] = {"attempt_id": attempt.id, "node_id": node.id}
    if exit.outcome == "succeeded":
        _record_finished(session, job.id, node, attempt, now)
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
    elif exit.outcome == "closed":
        # It came as the others were ending: no failure of its own, nothing lost, and the
        # others' reports say how the attempt ends. It is free again.
        add_event(
            session,
            job.id,
            "node_late",
            f"node {node.name} came to attempt {attempt.number} after its rendezvous had "
            "closed (another node's part had ended); it did not train and is free again",
            now,
            **ids,
        )
    else:
        _record_stopped(session, job.id, node, attempt, exit, now)


def _launcher_failed(
    session: Session, job: Job, attempt: Attempt, exit: AttemptExit, why: str, now: datetime
) -> None:
    """A node's launcher gave up. Fatal: the job fails. Otherwise the controller re-forms
    the job itself (a new attempt, after the back-off), which costs one restart."""
    if exit.fatal:
        _fail_job(session, job, attempt, now, why)
        return
    delay = _restart_or_fail(
        session,
        job,
        attempt,
        now,
        cause="launcher_failed",
        spent=lambda failures, most: why,
        restarting=f"the launcher of attempt {attempt.number} failed; the job is placed "
        "again as a new attempt",
        time=now,
    )
    if delay is None:
        return
    end_attempt(session, attempt, AttemptState.FAILED, now, why[:2000])
    change_job_state(session, job, JobState.WAITING, now, message="relaunching")
    job.waiting_since, job.not_before = now, now + timedelta(seconds=delay)


def _member_state_after(exit: AttemptExit) -> MemberState:
    """How a member that is still ACTIVE ends when its launcher reports ``exit``."""
    if exit.outcome == "succeeded":
        return MemberState.FINISHED
    return MemberState.LEFT if exit.outcome == "stopped" else MemberState.EXITED


def _record_finished(
    session: Session, job_id: int, node: Node, attempt: Attempt, now: datetime
) -> None:
    add_event(
        session,
        job_id,
        "node_finished",
        f"node {node.name} finished",
        now,
        attempt_id=attempt.id,
        node_id=node.id,
    )


def _record_stale_exit(
    session: Session, member: AttemptMember, exit: AttemptExit, now: datetime
) -> None:
    """The exit of a member of an attempt that has ended (or of a member already gone).

    A member still ACTIVE in an attempt that SUCCEEDED ends as its launcher did
    (FINISHED, EXITED or LEFT), and a success puts "node X finished" on the
    timeline. Any other late exit releases the member (LEFT). Whatever did not
    succeed says what it left running.
    """
    attempt = member.attempt
    if member.state is MemberState.ACTIVE and attempt.state is AttemptState.SUCCEEDED:
        end_member(session, member, _member_state_after(exit), now, exit.exit_code)
        if exit.outcome == "succeeded":
            _record_finished(session, attempt.job_id, member.node, attempt, now)
            return
    else:
        end_member(session, member, MemberState.LEFT, now, exit.exit_code)
    _record_stopped(session, attempt.job_id, member.node, attempt, exit, now)


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


def _exit_text(data: WorkerFailed) -> str:
    code = f"exited with code {data.exitcode}"
    message = data.message[:500]
    return code if not message or message.startswith(code) else f"{code}: {message}"
