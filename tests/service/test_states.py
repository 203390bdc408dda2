from __future__ import annotations

import pytest

from service.states import (
    ATTEMPT_TRANSITIONS,
    JOB_TRANSITIONS,
    MEMBER_TRANSITIONS,
    NODE_TRANSITIONS,
    AttemptState,
    InvalidTransition,
    JobState,
    MemberState,
    NodeState,
    check_transition,
)


@pytest.mark.parametrize(
    "table", [JOB_TRANSITIONS, ATTEMPT_TRANSITIONS, MEMBER_TRANSITIONS, NODE_TRANSITIONS]
)
def test_every_state_has_a_row(table: dict) -> None:  # type: ignore[type-arg]
    enum = type(next(iter(table)))
    assert set(table) == set(enum)


def test_terminal_job_states_have_no_way_out() -> None:
    for state in JobState:
        assert (not JOB_TRANSITIONS[state]) == state.is_terminal()


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (JobState.PENDING, JobState.RUNNING),
        (JobState.RUNNING, JobState.RESTARTING),
        (JobState.RESTARTING, JobState.RUNNING),
        (JobState.RUNNING, JobState.WAITING),
        (JobState.WAITING, JobState.RUNNING),
        (JobState.WAITING, JobState.FAILED),
        (JobState.RUNNING, JobState.SUCCEEDED),
        (JobState.PENDING, JobState.CANCELLED),
    ],
)
def test_allowed_job_transitions(old: JobState, new: JobState) -> None:
    check_transition(JOB_TRANSITIONS, old, new)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (JobState.SUCCEEDED, JobState.RUNNING),
        (JobState.CANCELLED, JobState.PENDING),
        (JobState.FAILED, JobState.RESTARTING),
        (JobState.PENDING, JobState.SUCCEEDED),
        (JobState.PENDING, JobState.RESTARTING),
        (JobState.RUNNING, JobState.PENDING),
        (JobState.WAITING, JobState.SUCCEEDED),
    ],
)
def test_forbidden_job_transitions(old: JobState, new: JobState) -> None:
    with pytest.raises(InvalidTransition, match=f"from {old} to {new}"):
        check_transition(JOB_TRANSITIONS, old, new)


def test_attempts_end_once() -> None:
    check_transition(ATTEMPT_TRANSITIONS, AttemptState.RUNNING, AttemptState.STOPPED)
    with pytest.raises(InvalidTransition):
        check_transition(ATTEMPT_TRANSITIONS, AttemptState.STOPPED, AttemptState.SUCCEEDED)


def test_members_end_once_as_what_happened_to_them() -> None:
    for end in (MemberState.FINISHED, MemberState.EXITED, MemberState.LEFT):
        check_transition(MEMBER_TRANSITIONS, MemberState.ACTIVE, end)
        assert MEMBER_TRANSITIONS[end] == frozenset()


def test_a_node_that_left_comes_back_alive_but_is_never_lost() -> None:
    check_transition(NODE_TRANSITIONS, NodeState.ALIVE, NodeState.LEFT)
    check_transition(NODE_TRANSITIONS, NodeState.LEFT, NodeState.ALIVE)
    with pytest.raises(InvalidTransition):
        check_transition(NODE_TRANSITIONS, NodeState.LEFT, NodeState.LOST)
