"""Attempts (one launch of a job = one rendezvous id) and their member nodes."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, bindparam, select, update
from sqlalchemy.orm import Session

from contract.protocol import Assignment, Entrypoint, RendezvousConfig
from contract.tasks import TASKS, task_args
from service import rendezvous
from service.errors import StaleState
from service.job_events import add_event
from service.models import Attempt, AttemptMember, Job, Node, inline, json_text
from service.placement import stored_device
from service.secrets import Keyring, open_env
from service.settings import ControllerSettings
from service.spec import JobSpec
from service.states import AttemptState, MemberState
from service.transitions import transition

logger = logging.getLogger(__name__)


def rdzv_id_for(job_id: int, number: int) -> str:
    return f"relaunch-job{job_id}-attempt{number}"


def snapshot_dir_for(settings: ControllerSettings, job_id: int) -> str:
    """Every attempt of a job resumes from the same directory under the fixed root
    (a path or a URL); a client never names it."""
    return f"{settings.snapshots.rstrip('/')}/job-{job_id}"


def running_attempt(session: Session, job_id: int) -> Attempt | None:
    stmt = select(Attempt).where(Attempt.job_id == job_id, Attempt.state == AttemptState.RUNNING)
    return session.scalars(stmt).one_or_none()


def add_member(
    session: Session, attempt: Attempt, node: Node, now: datetime, gpus: Sequence[int] = ()
) -> AttemptMember:
    """``node`` joins ``attempt``, holding ``gpus`` (its GPU indices; on "cuda" only)."""
    member = AttemptMember(
        attempt_id=attempt.id,
        node_id=node.id,
        state=MemberState.ACTIVE,
        joined_at=now,
        gpus=list(gpus),
    )
    session.add(member)
    session.flush()
    return member


def active_holds(gpus_as_text: bool = False) -> Select[int, int, str, Any, int | None]:
    """Every ACTIVE membership, as what it holds: its node, its attempt, the attempt's
    device, the GPUs it holds (a list, or with ``gpus_as_text`` its JSON text), and the
    owner of its job. An attempt that SUCCEEDED keeps its members ACTIVE until their
    launchers report, and until then they hold it."""
    return (
        select(
            AttemptMember.node_id,
            AttemptMember.attempt_id,
            Attempt.device,
            json_text(AttemptMember.gpus) if gpus_as_text else AttemptMember.gpus,
            Job.owner_id,
        )
        .join(Attempt, Attempt.id == AttemptMember.attempt_id)
        .join(Job, Job.id == Attempt.job_id)
        .where(AttemptMember.state == inline(MemberState.ACTIVE))  # ix_attempt_members_active
    )


def active_members(session: Session, attempt_id: int) -> list[AttemptMember]:
    return list(session.scalars(_ACTIVE_MEMBERS, {"attempt_id": attempt_id}))


# Built once: building a statement costs more than running it.
_ACTIVE_MEMBERS = select(AttemptMember).where(
    AttemptMember.attempt_id == bindparam("attempt_id"), AttemptMember.state == MemberState.ACTIVE
)


def end_member(
    session: Session,
    member: AttemptMember,
    new: MemberState,
    now: datetime,
    exit_code: int | None = None,
) -> bool:
    """ACTIVE → LEFT/EXITED/FINISHED with compare-and-set; False if it had already ended."""
    if member.state is not MemberState.ACTIVE:
        return False
    return transition(session, member, new, left_at=now, exit_code=exit_code)


def end_attempt(
    session: Session, attempt: Attempt, new: AttemptState | str, now: datetime, result: str
) -> None:
    """End a running attempt. Unless it SUCCEEDED, every membership still active in it
    ends as LEFT; after a success the other members stay ACTIVE until their own
    launchers report (``MemberState``)."""
    new = AttemptState(new)
    if not transition(session, attempt, new, ended_at=now, result=result):
        raise StaleState(f"attempt {attempt.id} is no longer running")
    rendezvous.forget_attempt(session, attempt.id)
    if new is not AttemptState.SUCCEEDED:
        for member in active_members(session, attempt.id):
            end_member(session, member, MemberState.LEFT, now)
    logger.info(
        "job=%s attempt=%s attempt_id=%s ended %s: %s",
        attempt.job_id,
        attempt.number,
        attempt.id,
        new,
        result,
    )


def count_membership_change(session: Session, job_id: int) -> int:
    """Add one to the job's membership changes atomically; return the new count."""
    count = session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(membership_changes=Job.membership_changes + 1)
        .returning(Job.membership_changes)
        .execution_options(synchronize_session=False)
    ).scalar_one()
    job = session.get(Job, job_id)
    if job is not None:
        job.membership_changes = count
        session.flush()
    return int(count)


def drop_member(
    session: Session, member: AttemptMember, now: datetime, why: str, exit_code: int | None = None
) -> None:
    """End a node's part in a running attempt; the others re-form without it."""
    if end_member(session, member, MemberState.LEFT, now, exit_code):
        attempt = member.attempt
        changes = count_membership_change(session, attempt.job_id)
        add_event(
            session,
            attempt.job_id,
            "node_left",
            f"node {member.node.name} left attempt {attempt.number}: {why}; the workers re-form "
            f"at the smaller world size (membership change {changes}, not counted as a restart)",
            now,
            attempt_id=attempt.id,
            node_id=member.node_id,
            data={"cause": "node_left"},
        )


def entrypoint_for(spec: JobSpec) -> Entrypoint:
    if spec.task is not None:
        info = TASKS[spec.task.name]
        return Entrypoint(module=info.module, args=task_args(spec.task.name, spec.task.params))
    assert spec.script is not None  # JobSpec guarantees exactly one
    return Entrypoint(module=spec.script.module, script=spec.script.path, args=spec.script.args)


@dataclass(frozen=True)
class Membership:
    """A node's ACTIVE membership of a RUNNING attempt as stored: every value its
    ``Assignment`` depends on besides the job's spec (which never changes after submit)
    and the worker token. Two equal ones give equal assignments."""

    member_id: int
    attempt_id: int
    job_id: int
    attempt_number: int
    rdzv_id: str
    device: str | None
    gpus: tuple[int, ...]
    restart_count: int
    # How many memberships of the attempt have ended as LEFT: the members it lost. It only
    # grows while the attempt runs (a member that comes back gets a new row), so a node
    # that sees it move knows that a member its workers may wait on is gone.
    generation: int
    active_members: int
    memberships: int


def assignment_for(
    held: Membership,
    spec: JobSpec,
    stored_spec: dict[str, Any],
    settings: ControllerSettings,
    keyring: Keyring,
) -> Assignment:
    """What a member node runs for ``held``: ``spec`` (the job's, parsed) with the env of
    its ``stored_spec`` (``Job.spec``) in the clear (only nodes are sent it), the
    attempt's membership generation, so the members re-form at once when one of them is
    dropped, and its device with the GPUs the node's membership holds. No worker token:
    the heartbeat adds one to an assignment the node does not run yet."""
    hang_timeout_s, hang_adaptive = spec.hang_timeout()
    return Assignment(
        attempt_id=held.attempt_id,
        job_id=held.job_id,
        attempt_number=held.attempt_number,
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        nproc_per_node=spec.nproc_per_node,
        restart=spec.restart_policy(restarts_before=held.restart_count),
        hang_timeout_s=hang_timeout_s,
        hang_timeout_adaptive=hang_adaptive,
        collective_timeout_s=spec.collective_timeout_s,
        rendezvous=RendezvousConfig(
            rdzv_id=held.rdzv_id,
            last_call_timeout_s=settings.rdzv_last_call_timeout_s,
            join_timeout_s=settings.rdzv_join_timeout_s,
            keep_alive_interval_s=settings.rdzv_keep_alive_interval_s,
            keep_alive_max_attempt=settings.rdzv_keep_alive_max_attempt,
        ),
        entrypoint=entrypoint_for(spec),
        env=open_env(keyring, stored_spec),
        snapshot_dir=snapshot_dir_for(settings, held.job_id),
        working_dir=spec.working_dir,
        snapshot_every_steps=spec.snapshot.every_steps,
        snapshot_every_epochs=spec.snapshot.every_epochs,
        snapshot_keep=spec.snapshot.keep,
        snapshot_async=spec.snapshot.background,
        member_id=held.member_id,
        membership_generation=held.generation,
        active_members=held.active_members,
        memberships=held.memberships,
        device=stored_device(held.device),
        gpus=list(held.gpus),
    )
