"""Lifecycles of jobs, attempts and nodes: one enum and one transition table each.

Every change of state goes through ``service.transitions.transition``: it
checks the change with ``check_transition`` and writes it with compare-and-set
on the row's current state, so a stale writer cannot overwrite a newer state.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

S = TypeVar("S", bound=StrEnum)


class JobState(StrEnum):
    """A job's lifecycle.

    ::

        PENDING ──place──▶ RUNNING ──worker failed──▶ RESTARTING
                            ▲  │  ▲                        │
                            │  │  └──── rendezvous again ──┘
                    place   │  ▼ fewer than MIN nodes left, or the launcher failed
                            WAITING ──deadline passed──▶ FAILED
        RUNNING / RESTARTING ──▶ SUCCEEDED | FAILED (fatal error, restart budget spent)
        any non-terminal ──cancel──▶ CANCELLED

    WAITING: the job has run, its attempt ended without a result, and it
    waits (until ``wait_for_nodes_s`` runs out) to be placed again; it resumes
    from its newest snapshot.
    """

    PENDING = "PENDING"
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    def is_terminal(self) -> bool:
        return self in TERMINAL_JOB_STATES

    def is_active(self) -> bool:
        """Placed on nodes: an attempt of the job is running."""
        return self in (JobState.RUNNING, JobState.RESTARTING)

    def is_placed(self) -> bool:
        """Open, and placed at least once: it has had an attempt (not PENDING)."""
        return self in (JobState.WAITING, JobState.RUNNING, JobState.RESTARTING)

    def is_placeable(self) -> bool:
        """Not on nodes, and wants to be."""
        return self in (JobState.PENDING, JobState.WAITING)


TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.WAITING: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.RUNNING: frozenset(
        {
            JobState.RESTARTING,
            JobState.WAITING,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
        }
    ),
    JobState.RESTARTING: frozenset(
        {
            JobState.RUNNING,
            JobState.WAITING,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
        }
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class AttemptState(StrEnum):
    """One launch of a job: one c10d rendezvous id and its member nodes.

    ::

        RUNNING ──▶ SUCCEEDED | FAILED | STOPPED
    """

    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    def is_terminal(self) -> bool:
        return self is not AttemptState.RUNNING


ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.RUNNING: frozenset(
        {AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.STOPPED}
    ),
    AttemptState.SUCCEEDED: frozenset(),
    AttemptState.FAILED: frozenset(),
    AttemptState.STOPPED: frozenset(),
}


class MemberState(StrEnum):
    """A node's part in an attempt.

    ::

        ACTIVE ──its launcher succeeded──▶ FINISHED
               ──its launcher failed──▶ EXITED
               ──node lost, agent stopped it, or the attempt ended without it──▶ LEFT

    A member ends only by what happened to it. An attempt that fails or stops
    releases its still-active members (LEFT); an attempt that SUCCEEDED leaves
    them ACTIVE, since the other nodes' launchers are finishing too: each
    becomes FINISHED when its own success arrives, even after the attempt has
    ended, or LEFT if its agent stopped it first or the node is gone.
    """

    ACTIVE = "ACTIVE"
    LEFT = "LEFT"
    EXITED = "EXITED"
    FINISHED = "FINISHED"


MEMBER_TRANSITIONS: dict[MemberState, frozenset[MemberState]] = {
    MemberState.ACTIVE: frozenset({MemberState.LEFT, MemberState.EXITED, MemberState.FINISHED}),
    MemberState.LEFT: frozenset(),
    MemberState.EXITED: frozenset(),
    MemberState.FINISHED: frozenset(),
}


class NodeState(StrEnum):
    """A node agent as the controller sees it.

    ::

        ALIVE ──heartbeat timeout──▶ LOST ──heartbeat or registers again──▶ ALIVE
        ALIVE ──its agent says it stops (POST /nodes/{id}/leave)──▶ LEFT
        LEFT ──registers again (or a late heartbeat)──▶ ALIVE

    LOST is a node that went silent; LEFT one that said goodbye. Neither is
    placed on; both end their memberships of running attempts.
    """

    ALIVE = "ALIVE"
    LOST = "LOST"
    LEFT = "LEFT"


NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    NodeState.ALIVE: frozenset({NodeState.LOST, NodeState.LEFT}),
    NodeState.LOST: frozenset({NodeState.ALIVE}),
    NodeState.LEFT: frozenset({NodeState.ALIVE}),
}


class InvalidTransition(ValueError):
    """A state change that the lifecycle table does not allow."""


def check_transition(table: dict[S, frozenset[S]], current: S, new: S) -> None:
    """Raise ``InvalidTransition`` unless ``current -> new`` is in ``table``."""
    if new not in table[current]:
        raise InvalidTransition(f"{type(current).__name__} cannot go from {current} to {new}")
