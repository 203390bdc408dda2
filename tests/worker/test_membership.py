"""A node ends its workers when the controller drops a member of their attempt, and the
launcher calls those ends a membership change: no restart is spent, not even torch's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from contract.events import RendezvousComplete
from tests.worker.helpers import unstarted_attempt
from worker import procs
from worker.attempt import Attempt
from worker.runtime.events import EventWriter
from worker.settings import AgentSettings

REPO = Path(__file__).resolve().parents[2]

# Each worker stands for one stuck in a collective with a peer that froze: it never
# returns by itself. Its next incarnation (after the re-form) finishes at once.
_STUCK_ONCE = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    mine = Path(sys.argv[1]) / f"rank{os.environ['LOCAL_RANK']}"
    if mine.exists():
        sys.exit(0)
    mine.touch()
    time.sleep(600)
    """
)


# A stand-in launcher with one worker child; both sleep until killed.
_SLEEPER = "import time; time.sleep(600)"
_LAUNCHER_WITH_A_WORKER = [
    sys.executable, "-c",
    f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {_SLEEPER!r}]);"
    " time.sleep(600)",
]  # fmt: skip


def _settings(tmp_path: Path) -> AgentSettings:
    return AgentSettings(
        enrolment_token="t", controller_url="http://c:1", name="node-a", work_dir=tmp_path / "a"
    )


def _wait_for(condition: Any, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


def _run_as_launcher(attempt: Attempt, argv: list[str], out: Path) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the attempt's launcher process (what ``Attempt.start`` would run
    through the controller's rendezvous; here torch's standalone one)."""
    with out.open("wb") as sink:
        popen = subprocess.Popen(
            argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=sink, stderr=sink
        )
    attempt._popen = popen
    return popen


def test_a_dropped_member_ends_the_workers_and_they_re_form_without_a_restart(
    tmp_path: Path,
) -> None:
    """torch's --max-restarts 0 and the workers still come back: a membership change is
    no failure, for relaunch's budget nor for torch's."""
    attempt = unstarted_attempt(tmp_path, _settings(tmp_path))
    program, marks = tmp_path / "train.py", tmp_path / "marks"
    program.write_text(_STUCK_ONCE)
    marks.mkdir()
    argv = [
        sys.executable, "-m", "worker.launch", "--events-file", str(attempt.events_path),
        "--parent-pid", str(os.getpid()), "--membership-file", str(attempt.membership_path),
        "--", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
        "--monitor-interval", "0.2", "--tee", "3", "--log-dir", str(tmp_path / "logs"),
        str(program), str(marks),
    ]  # fmt: skip
    launcher = _run_as_launcher(attempt, argv, tmp_path / "launcher.out")
    try:
        _wait_for(lambda: len(list(marks.iterdir())) == 2, "both workers to start")
        # The controller dropped a member; the reply carries no member count (an older
        # controller), so the node cannot tell its workers formed without it: it re-forms.
        told = attempt.assignment.model_copy(update={"membership_generation": 1})
        killer = attempt.follow_membership(told)
        assert killer is not None
        killer.join(30)
        assert launcher.wait(120) == 0, (tmp_path / "launcher.out").read_text()
    finally:
        procs.kill_tree(launcher.pid, 1.0)
    events = [json.loads(line) for line in attempt.events_path.read_text().splitlines()]
    failed = [e["data"] for e in events if e["kind"] == "worker_failed"]
    assert failed and {(f["cause"], f["fatal"]) for f in failed} == {("membership_change", False)}
    rounds = [e["data"]["restart_count"] for e in events if e["kind"] == "rendezvous"]
    assert rounds == [0, 0]
    assert not attempt.membership_path.exists()
    # The same generation again is old news: nothing more is ended.
    assert attempt.follow_membership(told) is None


def test_workers_that_already_formed_without_the_lost_member_are_left_alone(
    tmp_path: Path,
) -> None:
    attempt = unstarted_attempt(tmp_path, _settings(tmp_path))
    launcher = _run_as_launcher(attempt, _LAUNCHER_WITH_A_WORKER, tmp_path / "launcher.out")
    try:
        _wait_for(lambda: procs.descendants(launcher.pid), "the worker to start")
        [worker] = procs.descendants(launcher.pid)
        # Their last rendezvous (torch found the peer gone first) had 2 nodes; 2 remain.
        writer = EventWriter(attempt.events_path)
        writer.emit(
            RendezvousComplete(world_size=2, group_rank=0, group_world_size=2, restart_count=0)
        )
        writer.close()
        told = attempt.assignment.model_copy(
            update={"membership_generation": 1, "active_members": 2, "memberships": 3}
        )
        assert attempt.follow_membership(told) is None
        assert worker.is_running() and not attempt.membership_path.exists()
        # Another member goes: 1 node remains, fewer than the workers formed with.
        told = told.model_copy(update={"membership_generation": 2, "active_members": 1})
        killer = attempt.follow_membership(told)
        assert killer is not None
        killer.join(30)
        assert attempt.membership_path.read_text() == "2\n"
        assert not procs.is_alive(worker)
        assert launcher.poll() is None  # the launcher itself goes on
    finally:
        procs.kill_tree(launcher.pid, 1.0)
        launcher.wait(10)


def test_a_spare_that_joined_since_the_workers_formed_does_not_hide_the_lost_member(
    tmp_path: Path,
) -> None:
    """Three nodes formed; one is cut off and a spare joins in the same pass: still
    three members, but the workers wait on the cut one, so they must re-form."""
    attempt = unstarted_attempt(tmp_path, _settings(tmp_path))
    launcher = _run_as_launcher(attempt, _LAUNCHER_WITH_A_WORKER, tmp_path / "launcher.out")
    try:
        _wait_for(lambda: procs.descendants(launcher.pid), "the worker to start")
        [worker] = procs.descendants(launcher.pid)
        formed = attempt.assignment.model_copy(update={"active_members": 3, "memberships": 3})
        assert attempt.follow_membership(formed) is None
        writer = EventWriter(attempt.events_path)
        writer.emit(
            RendezvousComplete(world_size=3, group_rank=0, group_world_size=3, restart_count=0)
        )
        writer.close()
        time.sleep(0.01)  # the spare's join is seen after the round formed
        told = formed.model_copy(
            update={"membership_generation": 1, "active_members": 3, "memberships": 4}
        )
        killer = attempt.follow_membership(told)
        assert killer is not None
        killer.join(30)
        assert attempt.membership_path.read_text() == "1\n"
        assert not procs.is_alive(worker)
    finally:
        procs.kill_tree(launcher.pid, 1.0)
        launcher.wait(10)
