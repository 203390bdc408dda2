"""Each job's workers run as a user of their own: real launchers, real workers, as root.

The test process plays the node agent (it holds the ``Attempt``s); each job's
code checks from the inside what it can and cannot reach, and writes what it
found in its working directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from contract import job_users
from contract.protocol import Assignment, AttemptExit, Entrypoint, RendezvousConfig
from tests.helpers import wait_for
from tests.worker.helpers import LiveController, placed
from worker import sandbox
from worker.attempt import Attempt
from worker.sandbox import JobUser
from worker.settings import AgentSettings

REPO = Path(__file__).resolve().parents[2]
BASE = 200000

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs jobs as their own users: root")

# The job's program: what it can reach, written to result.json; it waits for "go" to end.
_CHECK = textwrap.dedent(
    """
    import getpass, json, os, tempfile, time

    def denied(path, list_dir=False):
        try:
            os.listdir(path) if list_dir else open(path, "rb").read()
        except PermissionError:
            return True
        return False

    env = os.environ
    fd, scratch = tempfile.mkstemp()
    os.close(fd)
    with open("written-by-the-job", "w") as f:  # the working dir is its snapshot dir
        f.write("x")
    result = {
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "secret": env.get("JOB_SECRET"), "scratch": scratch, "tmpdir": env.get("TMPDIR"),
        "user": getpass.getuser(), "logname": env.get("LOGNAME"),
        "agent_environ": denied(f"/proc/{env['AGENT_PID']}/environ"),
        "launcher_environ": denied(f"/proc/{os.getppid()}/environ"),
        "init_environ": denied("/proc/1/environ"),
        "other_job_environ": denied(f"/proc/{env['OTHER_PID']}/environ"),
        "agent_dir_listed": denied(env["RELAUNCH_NODE_AGENT_DIR"], list_dir=True),
        "other_job_dir_listed": denied(env["OTHER_JOB_DIR"], list_dir=True),
    }
    with open("result.tmp", "w") as f:
        json.dump(result, f)
    os.rename("result.tmp", "result.json")
    while not os.path.exists("go"):
        time.sleep(0.05)
    """
)

# Planted in the working directory, first on the job's PYTHONPATH: whoever imports it
# leaves a file saying as which uid. The bootstrap then runs the job's script itself.
_PLANTED_INIT = "import os\nopen(f'imported-by-{os.getpid()}', 'w').write(str(os.getuid()))\n"
_PLANTED_BOOTSTRAP = "import runpy, sys\nrunpy.run_path(sys.argv[1], run_name='__main__')\n"


@dataclass(frozen=True)
class Rendezvous:
    """A one-node job placed at a real controller, whose rendezvous an attempt here uses."""

    controller_url: str
    rdzv_id: str
    node_token: str


@pytest.fixture
def rendezvous(live_controller: LiveController) -> Rendezvous:
    rdzv_id, [token] = placed(live_controller, [f"n-{uuid.uuid4().hex[:6]}"], "1")
    return Rendezvous(live_controller.url, rdzv_id, token)


def _settings(tmp_path: Path, controller_url: str = "http://c:1") -> AgentSettings:
    return AgentSettings(
        enrolment_token="t",
        controller_url=controller_url,
        name=f"sandbox-{uuid.uuid4().hex[:8]}",
        work_dir=tmp_path / "agent",
        stop_grace_s=2,
        job_uid_base=BASE,
    )


def _assignment(
    job_id: int, snapshot_dir: Path, script: str, rdzv: Rendezvous, **fields: Any
) -> Assignment:
    return Assignment(
        attempt_id=job_id,
        job_id=job_id,
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=1,
        restart={"max_restarts": 0},
        rendezvous=RendezvousConfig(
            rdzv_id=rdzv.rdzv_id,
            last_call_timeout_s=1,
            join_timeout_s=60,
            keep_alive_interval_s=1,
            keep_alive_max_attempt=3,
        ),
        entrypoint=Entrypoint(script=script),
        snapshot_dir=str(snapshot_dir),
        **fields,
    )


def _ended(attempt: Attempt, timeout_s: float = 120) -> AttemptExit:
    def ended() -> bool:
        attempt.refresh()
        return attempt.poll()

    wait_for("the attempt to end", ended, timeout_s)
    assert attempt.exit is not None
    return attempt.exit


def _run_to_end(
    tmp_path: Path, rendezvous: Rendezvous, assignment: Assignment
) -> tuple[Attempt, AttemptExit]:
    """Start an attempt of ``assignment`` and wait for its end; it is stopped either way."""
    attempt = Attempt(
        assignment,
        _settings(tmp_path, rendezvous.controller_url),
        node_token=rendezvous.node_token,
    )
    try:
        attempt.start()
        return attempt, _ended(attempt)
    finally:
        attempt.stop("test over")
        attempt.wait_stopped()


def _logs(attempt: Attempt) -> str:
    pending = attempt.next_report(max_logs=10000, max_events=10000)
    return "" if pending is None else "\n".join(line.line for line in pending.report.logs)


def test_a_jobs_worker_runs_as_its_own_user_and_reaches_nothing_else(
    tmp_path: Path, rendezvous: Rendezvous
) -> None:
    settings = _settings(tmp_path, rendezvous.controller_url)
    sandbox.root_dir(settings.work_dir)  # as the agent makes it at start
    snapshots = tmp_path / "snapshots"
    other_dir = sandbox.private_dir(snapshots / "job-99", JobUser(uid=BASE + 99, gid=BASE + 99))
    other_job = subprocess.Popen(
        ["sleep", "120"], env={"OTHER_SECRET": "x"}, user=BASE + 99, group=BASE + 99
    )
    workdir = snapshots / "job-7"  # the job's snapshot dir is its working dir
    (workdir / "worker").mkdir(parents=True)
    (workdir / "check.py").write_text(_CHECK)
    for name in ("__init__.py", "launch.py"):
        (workdir / "worker" / name).write_text(_PLANTED_INIT)
    (workdir / "worker" / "bootstrap.py").write_text(_PLANTED_INIT + _PLANTED_BOOTSTRAP)
    env = {
        "JOB_SECRET": "s3cr3t",
        "AGENT_PID": str(os.getpid()),
        "OTHER_PID": str(other_job.pid),
        "OTHER_JOB_DIR": str(other_dir),
        "PYTHONPATH": str(workdir),
        "LD_PRELOAD": "/nonexistent/libevil.so",
    }
    attempt = Attempt(
        _assignment(7, workdir, "check.py", rendezvous, env=env),
        settings,
        node_token=rendezvous.node_token,
    )
    try:
        attempt.start()
        found_or_ended = lambda: (workdir / "result.json").exists() or attempt.poll()  # noqa: E731
        wait_for("the job's findings", found_or_ended, 120)
        assert attempt.exit is None, _logs(attempt)
        # While it runs: the launcher (root) holds none of the job's variables, nor its file.
        launcher_env = Path(f"/proc/{attempt.launcher_pid}/environ").read_bytes()
        assert b"s3cr3t" not in launcher_env and b"LD_PRELOAD" not in launcher_env
        assert not (attempt.dir / "job-env.json").exists()
        (workdir / "go").touch()
        end = _ended(attempt)
    finally:
        attempt.stop("test over")
        attempt.wait_stopped()
        other_job.kill()
        other_job.wait()
    assert end.outcome == "succeeded", _logs(attempt)
    found = json.loads((workdir / "result.json").read_text())
    assert (found["uid"], found["gid"], found["groups"]) == (BASE + 7, BASE + 7, [])
    assert found["secret"] == "s3cr3t"
    assert found["tmpdir"] == str(attempt.dir / "tmp")
    # a name of its own: the uid has no passwd entry, and torch 2.11's import of
    # torch._dynamo fails where getpass.getuser() finds none
    assert found["user"] == found["logname"] == f"relaunch-{BASE + 7}"
    assert Path(found["scratch"]).parent == attempt.dir / "tmp"
    for what in (
        "agent_environ",
        "launcher_environ",
        "init_environ",
        "other_job_environ",
        "agent_dir_listed",
        "other_job_dir_listed",
    ):
        assert found[what] is True, what
    assert (workdir / "written-by-the-job").stat().st_uid == BASE + 7
    assert workdir.stat().st_uid == BASE + 7 and workdir.stat().st_mode & 0o777 == 0o700
    assert settings.work_dir.stat().st_mode & 0o777 == 0o711
    logs = list((attempt.dir / "torchelastic").glob("**/std*.log"))
    assert logs and {log.stat().st_mode & 0o777 for log in logs} == {0o600}
    # The planted package ran, as the job's user only: never in the launcher (root).
    imported = {p.name: p.read_text() for p in workdir.glob("imported-by-*")}
    assert imported
    assert set(imported.values()) == {str(BASE + 7)}, imported


def test_a_start_up_error_still_reaches_the_launcher_through_the_error_file(
    tmp_path: Path, rendezvous: Rendezvous
) -> None:
    workdir = tmp_path / "snapshots" / "job-8"
    workdir.mkdir(parents=True)
    (workdir / "broken.py").write_text("import no_such_module_here\n")
    attempt, end = _run_to_end(
        tmp_path, rendezvous, _assignment(8, workdir, "broken.py", rendezvous)
    )
    # Only the error file tells a start-up error (fatal) from a crash (restarted).
    assert (end.outcome, end.fatal) == ("failed", True), _logs(attempt)
    assert "ModuleNotFoundError" in (end.message or "")


def test_a_working_dir_the_jobs_user_cannot_enter_fails_the_attempt_as_fatal(
    tmp_path: Path, rendezvous: Rendezvous
) -> None:
    closed = tmp_path / "closed"
    (closed / "inside").mkdir(parents=True)
    closed.chmod(0o700)
    (closed / "inside" / "train.py").write_text("print('never')\n")
    snapshots = tmp_path / "snapshots" / "job-9"
    _, end = _run_to_end(
        tmp_path,
        rendezvous,
        _assignment(9, snapshots, "train.py", rendezvous, working_dir=str(closed / "inside")),
    )
    assert (end.outcome, end.fatal) == ("failed", True)
    assert f"(uid {BASE + 9}) cannot enter working_dir {closed / 'inside'}" in (end.message or "")


def test_an_agent_that_is_not_root_refuses_user_isolation(tmp_path: Path) -> None:
    code = (
        "from worker.agent import run_agent; from worker.settings import AgentSettings;"
        "import logging, sys; logging.basicConfig(); sys.exit(run_agent(AgentSettings()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={
            "PATH": os.environ.get("PATH", ""),
            "RELAUNCH_AGENT_ENROLMENT_TOKEN": "t",
            "RELAUNCH_AGENT_WORK_DIR": str(tmp_path / "agent"),
        },
        user=BASE + 999,
        group=BASE + 999,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1, done.stderr
    assert "run the agent as root, or set RELAUNCH_AGENT_ISOLATION=none" in errors[0]


def test_the_self_check_names_the_directory_a_jobs_user_cannot_pass(tmp_path: Path) -> None:
    assert job_users.interpreter_refusal(BASE) is None  # the tests opened the way
    assert sandbox.start_refusal("user", BASE, tmp_path / "agent") is None
    closed = tmp_path / "closed"
    (closed / "bin").mkdir(parents=True)
    closed.chmod(0o700)
    assert job_users.first_closed_dir(closed / "bin" / "python") == closed
    refusal = sandbox.start_refusal("user", BASE, closed / "agent")
    assert refusal is not None and f"lies under {closed}, which jobs' users cannot pass" in refusal


def test_an_error_file_is_copied_for_the_launcher_only_if_it_is_the_jobs_plain_file(
    tmp_path: Path,
) -> None:
    user = JobUser(uid=BASE + 5, gid=BASE + 5)
    rank_dir = tmp_path / "rank"
    own = sandbox.private_dir(rank_dir / sandbox.WORKER_ERROR_DIR, user)
    target = rank_dir / "error.json"
    secret = tmp_path / "root-only.json"
    secret.write_text('{"message": "root secret"}')
    (own / "error.json").symlink_to(secret)
    sandbox.checked_error_file(str(target), user)
    assert not target.exists()  # a link is never followed
    (own / "error.json").unlink()
    (own / "error.json").write_text('{"message": "from root"}')  # not the job's
    sandbox.checked_error_file(str(target), user)
    assert not target.exists()
    sandbox.own(own / "error.json", user, 0o600)
    sandbox.checked_error_file(str(target), user)
    assert target.read_text() == '{"message": "from root"}'


def test_a_script_the_jobs_user_cannot_read_is_named(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    script.chmod(0o600)
    box = sandbox.WorkerSandbox(
        user=JobUser(uid=BASE + 6, gid=BASE + 6),
        job_env_file=tmp_path / "env.json",
        tmp_dir=tmp_path,
        log_dir=tmp_path,
        working_dir=tmp_path,
        script="train.py",
    )
    assert sandbox.unreachable(box) == (
        f"the job's user (uid {BASE + 6}) cannot read script train.py: Permission denied"
    )
    script.chmod(0o644)
    assert sandbox.unreachable(box) is None
    script.unlink()  # a missing script is the worker's to report (EntrypointNotFound)
    assert sandbox.unreachable(box) is None
