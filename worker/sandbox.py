"""Each job's workers run as an unprivileged user of their own; nothing of the job runs as root.

With ``isolation = "user"`` (the default; the agent must run as root) the
workers of job N run as uid = gid = ``job_uid_base + N`` with no supplementary
groups. Distinct uids are what the kernel checks: a worker cannot read
``/proc/<pid>/environ`` of the agent, of a launcher, of the controller or of
another job's workers, cannot signal them, and cannot open their files.

Nothing the job chose runs as root, because the job's environment never
reaches a root process:

- the agent starts the launcher as ``python -I`` (no ``PYTHON*`` variables, no
  current directory on ``sys.path``) with the agent's own environment only; the
  job's variables go to the launcher in a 0600 file (``write_job_env``), which
  the launcher reads and deletes at start. A spare launcher (``worker.spare``) is the
  same process started earlier: before any assignment, with the agent's environment
  only, handed the launcher's arguments and environment (never the job's variables)
  in a file of root's;
- the launcher adds them to each worker's environment only, in the hook around
  torch's worker start (``install_worker_hooks``), where the worker is started
  with ``Popen(user=, group=, extra_groups=[])``: the switch happens in the
  child before ``exec``, so ``LD_PRELOAD``, ``PYTHONPATH``, a planted
  ``worker/`` package in the working directory all take effect as the job's user.

What a worker writes is the job's: its snapshot directory (0700), and in the
attempt's directory (root's, 0711: traversable, not listable) its events file,
progress directory, private TMPDIR and HOME. Torch's per-rank log directory
stays root's (the launcher reads the logs there, and must not be led by a link
the job planted); the worker's ``@record`` error file goes to a job-owned
``worker`` directory inside it, and the launcher copies it back only if it is
a plain file of the job's own (``checked_error_file``).

With ``isolation = "none"`` the same channels are used but the workers keep
the agent's user: for one trusted tenant only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict

from contract.job_users import first_closed_dir, interpreter_refusal

if TYPE_CHECKING:
    from worker.warm import WarmStarter, Zygote

logger = logging.getLogger(__name__)

MAX_JOB_UID = 2**31 - 2  # below the signed 32-bit limit that some tools assume
PROBE_TIMEOUT_S = 30.0
MAX_ERROR_FILE_BYTES = 2**20
_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
WORKER_ERROR_DIR = "worker"  # inside torch's per-rank log directory, the job's own
_HOOK_MARK = "_relaunch_sandbox_hook"


class JobUser(BaseModel):
    """The unprivileged user one job's workers run as."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uid: int
    gid: int

    @property
    def name(self) -> str:
        """The name its processes see in ``USER`` and ``LOGNAME`` (it has no passwd entry)."""
        return f"relaunch-{self.uid}"


def job_user(isolation: str, uid_base: int, job_id: int) -> JobUser | None:
    """uid = gid = ``uid_base + job_id``; None when isolation is "none".

    ``ValueError`` if the id would leave the range of valid uids."""
    if isolation == "none":
        return None
    uid = uid_base + job_id
    if job_id < 0 or uid > MAX_JOB_UID:
        raise ValueError(
            f"job {job_id} maps to uid {uid}, beyond {MAX_JOB_UID}; lower job_uid_base"
        )
    return JobUser(uid=uid, gid=uid)


def own(path: Path, user: JobUser | None, mode: int) -> None:
    """Give ``path`` (a directory or a file, never followed if a link) to ``user``, with
    ``mode``; only the mode without a user. Refuses a symbolic link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if user is not None:
            os.fchown(fd, user.uid, user.gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def private_dir(path: Path, user: JobUser | None) -> Path:
    """``path`` made if missing, the job's own, 0700."""
    path.mkdir(parents=True, exist_ok=True)
    own(path, user, 0o700)
    return path


def root_dir(path: Path, mode: int = 0o711) -> Path:
    """``path`` made if missing, with ``mode`` (default: others may pass, not list)."""
    path.mkdir(parents=True, exist_ok=True)
    own(path, None, mode)
    return path


def write_job_env(path: Path, env: Mapping[str, str]) -> None:
    """Write the job's variables to ``path``, readable by this user only (0600, new file)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(dict(env), f)


def take_job_env(path: Path) -> dict[str, str]:
    """Read the job's variables and delete the file: they then live in this process only."""
    with path.open() as f:
        data = json.load(f)
    path.unlink()
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise ValueError(f"{path} is not a JSON object of strings")
    return data


def job_env_overlay(
    worker_env: Mapping[str, str], launcher_env: Mapping[str, str]
) -> dict[str, str]:
    """What the job's variables change: entries of ``worker_env`` that ``launcher_env``
    (the same environment built without the job's variables) lacks or holds otherwise.

    A variable the agent sets wins over the job's in both, so it is never in here."""
    return {k: v for k, v in worker_env.items() if launcher_env.get(k) != v}


def merge_worker_env(
    torch_env: Mapping[str, str], overlay: Mapping[str, str], launcher_environ: Mapping[str, str]
) -> dict[str, str]:
    """A worker's environment: torch's (the launcher's plus its per-worker variables) with
    the job's overlay, which wins over what the launcher inherited but never over what
    torch set for this worker (RANK, MASTER_PORT, TORCHELASTIC_ERROR_FILE, ...)."""
    env = dict(torch_env)
    for key, value in overlay.items():
        set_by_torch = key in torch_env and launcher_environ.get(key) != torch_env[key]
        if not set_by_torch:
            env[key] = value
    return env


class WorkerSandbox(BaseModel):
    """What the launcher needs to start its workers as the job's user (one JSON argument).

    ``user`` None: the workers keep the launcher's user ("none" isolation)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: JobUser | None
    job_env_file: Path
    tmp_dir: Path
    log_dir: Path  # torchrun's --log-dir: torch's per-rank directories lie under it
    working_dir: Path
    script: str | None = None

    def popen_kwargs(self) -> dict[str, Any]:
        if self.user is None:
            return {}
        return {"user": self.user.uid, "group": self.user.gid, "extra_groups": []}


# Run as the job's user by ``unreachable``: exits 3 with the reason if the user cannot
# enter the working directory or read the script. Started with -I -S and no job env.
_PROBE = """
import os, sys
wd, script = sys.argv[1], sys.argv[2]
try:
    os.chdir(wd)
except OSError as exc:
    print(f"cannot enter working_dir {wd}: {exc.strerror}"); sys.exit(3)
if script:
    try:
        open(script, "rb").close()
    except FileNotFoundError:
        pass
    except OSError as exc:
        print(f"cannot read script {script}: {exc.strerror}"); sys.exit(3)
"""


def unreachable(sandbox: WorkerSandbox) -> str | None:
    """Why the job's user cannot use its working directory or script; None if it can.

    Checked by a process of that user, so the kernel's own rules (modes, ACLs,
    mounts) decide. A missing script is left to the worker (a fatal start-up error)."""
    if sandbox.user is None:
        return None
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-I",
                "-S",
                "-c",
                _PROBE,
                str(sandbox.working_dir),
                sandbox.script or "",
            ],
            env={},
            cwd="/",
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
            **sandbox.popen_kwargs(),
        )
    except subprocess.TimeoutExpired:
        return (
            f"the job's user (uid {sandbox.user.uid}) could not reach working_dir "
            f"{sandbox.working_dir} within {PROBE_TIMEOUT_S:.0f} s"
        )
    if result.returncode == 0:
        return None
    why = result.stdout.strip() or result.stderr.strip()[-500:] or f"exit {result.returncode}"
    return f"the job's user (uid {sandbox.user.uid}) {why}"


CREDENTIAL_ENV = ("RELAUNCH_AGENT_ENROLMENT_TOKEN", "RELAUNCH_ENROLMENT_TOKEN", "RELAUNCH_TOKEN")


def forget_credentials(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Drop the credentials from this process's environment once settings hold them.

    Children then never inherit them; ``/proc/<pid>/environ`` still shows the
    environment the process started with, which is why a token file is safer."""
    for name in CREDENTIAL_ENV:
        environ.pop(name, None)


def start_refusal(isolation: str, uid_base: int, work_dir: Path) -> str | None:
    """Why the agent must not start with this isolation; None if it may.

    "none" is allowed with a warning; "user" needs root, a work dir that jobs' users
    can reach (their events file, progress and TMPDIR are in it), and an interpreter
    that they can run."""
    if isolation == "none":
        logger.warning(
            "isolation 'none': every job runs as this agent's user (uid %d) and can read "
            "the agent's and other jobs' processes and files; for one trusted tenant only",
            os.geteuid(),
        )
        return None
    if os.geteuid() != 0:
        return (
            f"isolation 'user' runs each job as its own uid and needs root, but the agent "
            f"runs as uid {os.geteuid()}: run the agent as root, or set "
            "RELAUNCH_AGENT_ISOLATION=none to run every job as the agent's user "
            "(only for one trusted tenant)"
        )
    blocked = first_closed_dir(work_dir.absolute())
    if blocked is not None:
        return (
            f"the work dir {work_dir} lies under {blocked}, which jobs' users cannot pass: "
            f"choose another work dir (RELAUNCH_AGENT_WORK_DIR) or chmod o+x {blocked}"
        )
    return interpreter_refusal(uid_base)


def checked_error_file(torch_path: str, user: JobUser) -> None:
    """Copy the worker's error file into torch's ``torch_path`` if it is a plain file of the
    job's own, not bigger than ``MAX_ERROR_FILE_BYTES``; else leave torch none to read.

    The worker wrote it in ``<rank dir>/worker/``, a directory it owns; a link, a
    FIFO or another user's file there is never opened for torch (which reads as root)."""
    target = Path(torch_path)
    source = target.parent / WORKER_ERROR_DIR / target.name
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return
    except OSError as exc:
        logger.warning("worker error file %s not read: %s", source, exc)
        return
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != user.uid:
            logger.warning("worker error file %s is not a plain file of uid %d", source, user.uid)
            return
        data = f.read(MAX_ERROR_FILE_BYTES + 1)
    if len(data) > MAX_ERROR_FILE_BYTES:
        logger.warning("worker error file %s is over %d bytes", source, MAX_ERROR_FILE_BYTES)
        return
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)


class WarmHooks(Protocol):
    """Who hears of the warm zygote (``worker.warm``) and of workers started cold."""

    def on_zygote(self, state: str, message: str, zygote: Zygote | None) -> None: ...

    def on_cold(self, local_rank: int, reason: str) -> None: ...


def enter(sandbox: WorkerSandbox, warm: WarmHooks | None = None) -> str | None:
    """In the launcher, before torch starts: take the job's variables, check that the job's
    user can reach its working directory and script, start the warm zygote (with
    ``warm``) and hook the workers' start.

    Returns why the job cannot run here (a fatal failure: no restart can help)."""
    overlay = take_job_env(sandbox.job_env_file)
    refusal = unreachable(sandbox)
    if refusal is not None:
        return refusal
    starter = None
    if warm is not None:
        from worker import warm as warm_starts

        installed = _Installed(sandbox, dict(overlay))
        try:
            starter = warm_starts.WarmStarter(
                env=_prepare(installed, dict(os.environ)),
                uid=None if sandbox.user is None else sandbox.user.uid,
                popen_kwargs=sandbox.popen_kwargs(),
                on_event=warm.on_zygote,
            )
            warm_starts.install_close_hook()
        except Exception as exc:  # a warm start must never cost the job its start
            logger.exception("cannot start the warm zygote; workers start cold")
            if starter is not None:
                starter.stop()
            warm.on_zygote("unavailable", f"cannot start the zygote: {exc}", None)
            starter = None
    install_worker_hooks(sandbox, overlay, starter, None if warm is None else warm.on_cold)
    return None


def check_runs_as(proc: subprocess.Popen[Any], user: JobUser) -> None:
    """Kill ``proc`` and raise ``RuntimeError`` unless every uid of it is ``user``'s: the
    hook fails closed should torch ever start its workers some other way.

    ``Popen`` returns once the child has exec'd, so its credentials are final."""
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
    except FileNotFoundError:
        return  # already gone
    uids = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), [])
    if not uids or any(int(uid) != user.uid for uid in uids):
        proc.kill()
        raise RuntimeError(f"worker pid {proc.pid} runs as uids {uids}, not {user.uid}; killed")


# A worker's own variables, kept in ``WORKERS_FILE`` by pid: a worker forked from the
# zygote shows its zygote's environment in /proc/PID/environ, not these.
RECORDED_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
)
WORKERS_FILE = "workers.json"  # in the attempt's directory, beside events.jsonl


@dataclass
class _Installed:
    sandbox: WorkerSandbox
    overlay: dict[str, str]
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def record(self, pid: int, env: Mapping[str, str], forked: bool) -> None:
        """Add a started worker to the attempt's ``workers.json`` (pid -> its rank and the
        rest of ``RECORDED_VARIABLES``, and whether it was forked): which process is which
        rank, for the people and tools that look. Root's file, 0600: another job's user
        must not learn where this job's store listens (``MASTER_PORT``)."""
        entry: dict[str, Any] = {k: env[k] for k in RECORDED_VARIABLES if k in env}
        entry["forked"] = forked
        self.workers[str(pid)] = entry
        path = self.sandbox.log_dir.parent / WORKERS_FILE
        try:
            tmp = path.with_suffix(".tmp")
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(json.dumps(self.workers))
            tmp.replace(path)
        except OSError as exc:
            logger.warning("cannot record worker %d in %s: %s", pid, path, exc)


def _prepare(installed: _Installed, torch_env: Mapping[str, str]) -> dict[str, str]:
    """One worker's environment, and the job-owned directory its error file goes to."""
    sandbox = installed.sandbox
    env = merge_worker_env(torch_env, installed.overlay, os.environ)
    private = {"TMPDIR": str(sandbox.tmp_dir)}
    if sandbox.user is not None:  # root's HOME and name are no place of the job's user
        private["HOME"] = str(sandbox.tmp_dir)
        # The job's uid has no passwd entry, so getpass.getuser() finds a name only here;
        # torch 2.11 calls it when torch._dynamo (which DDP imports) is first imported.
        private["USER"] = private["LOGNAME"] = sandbox.user.name
    for key, value in private.items():
        if key not in installed.overlay:
            env[key] = value
    error_file = env.get(_ERROR_FILE_ENV)
    if sandbox.user is not None and error_file:
        rank_dir = Path(error_file).parent
        if rank_dir.is_relative_to(sandbox.log_dir):
            # torch made them 0700 (mkdtemp): let the worker pass, not list.
            parts = rank_dir.relative_to(sandbox.log_dir).parts
            for depth in range(len(parts) + 1):
                own(sandbox.log_dir.joinpath(*parts[:depth]), None, 0o711)
        own_dir = private_dir(rank_dir / WORKER_ERROR_DIR, sandbox.user)
        env[_ERROR_FILE_ENV] = str(own_dir / Path(error_file).name)
    return env


def install_worker_hooks(
    sandbox: WorkerSandbox,
    overlay: Mapping[str, str],
    starter: WarmStarter | None = None,
    on_cold: Callable[[int, str], None] | None = None,
) -> None:
    """Start torch's workers as the job's user with the job's variables (this process only):
    forked from ``starter``'s zygote where it can (``worker.warm``), else as torch would,
    telling ``on_cold`` why.

    Seams (torch 2.13, ``torch/distributed/elastic/multiprocessing/``):
    ``SubprocessHandler._popen(args, env)`` (subprocess_handler/subprocess_handler.py)
    starts one worker with ``Popen(args=, env=, stdout=, stderr=, start_new_session=)``,
    its output going to files ``__init__`` opened (``self._stdout``/``self._stderr``);
    the wrapper makes those 0600, hands ``_popen`` the worker's environment and, through
    the module's ``Popen`` name, adds ``user``/``group``/``extra_groups`` to what torch
    passes; then it checks the worker's uids (``check_runs_as``).
    ``ProcessFailure.__post_init__`` (errors/__init__.py) reads a failed worker's
    error file; the wrapper first copies the job's file there (``checked_error_file``).
    """
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handler_module,
    )

    handler = handler_module.SubprocessHandler
    original_popen = handler._popen
    original_post_init = ProcessFailure.__post_init__
    if getattr(original_popen, _HOOK_MARK, False):
        raise RuntimeError("worker hooks are already installed in this process")
    installed = _Installed(sandbox, dict(overlay))
    # The module's own name for Popen: torch's call keeps every argument it passes.
    handler_module.Popen = functools.partial(  # type: ignore[misc,assignment]
        subprocess.Popen, **sandbox.popen_kwargs()
    )

    @functools.wraps(original_popen)
    def _popen(self: Any, args: tuple[str, ...], env: dict[str, str]) -> Any:
        for log in (self._stdout, self._stderr):  # torch opened them as root, 0644
            if log is not None:
                os.fchmod(log.fileno(), 0o600)
        worker_env = _prepare(installed, env)
        proc: Any = None
        if starter is not None:
            from worker.warm import ColdStart

            try:
                proc = starter.fork(args, worker_env, self._stdout, self._stderr)
            except ColdStart as exc:
                if on_cold is not None:
                    on_cold(self.local_rank_id, str(exc))
        forked = proc is not None
        if proc is None:
            proc = original_popen(self, args, worker_env)
        if sandbox.user is not None:
            check_runs_as(proc, sandbox.user)
        installed.record(proc.pid, worker_env, forked)
        return proc

    @functools.wraps(original_post_init)
    def _post_init(self: Any) -> None:
        if sandbox.user is not None and os.path.isabs(self.error_file):
            checked_error_file(self.error_file, sandbox.user)
        original_post_init(self)

    setattr(_popen, _HOOK_MARK, True)
    handler._popen = _popen  # type: ignore[method-assign]
    ProcessFailure.__post_init__ = _post_init  # type: ignore[method-assign]
