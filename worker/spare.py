"""The spare launcher: a launcher interpreter started before any assignment, so that an
attempt's start does not wait for Python and torch's elastic agent to load.

Usage (the node agent starts it; see ``SpareLauncher``)::

    python -I -u -m worker.spare --parent-pid P --ready-fd R

It is started as a launcher is (root, ``python -I -u``, the agent's environment less
its settings and credentials: ``worker.attempt.spare_env``), in a root-owned directory
of the agent's. It imports what the launcher imports, torch's elastic agent and the
rendezvous backend included, writes one byte on ``--ready-fd`` and waits for one line
on stdin: the path of a hand-off file. Nothing of a job's runs in it until then, and
nothing of a job's reaches it but that file, which holds what a new launcher would have
got (``Handoff``: its arguments, its environment, its working directory; never the
job's own variables, which travel to the workers as before, nor the node's token, which
the launcher reads from its own file). The file is the agent's: root's, 0600, in the
attempt's root-owned directory; the spare refuses any other, reads it and deletes it.
It then becomes that launcher: the environment replaced, the working directory
entered, stdin on ``/dev/null``, then ``worker.launch.main`` with the arguments. Its
stdout and stderr are the pipes the agent made when it started the spare, read by the
attempt from the hand-off on. EOF on stdin (the agent is gone, or gave it up) ends it.

Beside it runs a spare zygote (``worker.warm.SpareZygote``), started first, which
imports torch as a job's zygote does; the spare says it has loaded once both have (or
after ``ZYGOTE_WAIT_S``). Handed an attempt, the launcher offers it to the attempt's
warm starts, which hand it the job (``worker.zygote.adopt``) where it can be that job's.

A spare serves one attempt and is never handed back: the agent starts another.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from contract.prctl import set_parent_death_signal
from worker import procs
from worker.warm import SpareZygote

logger = logging.getLogger(__name__)

MAX_HANDOFF_BYTES = 4 << 20
HANDOFF_FILE = "launch.json"  # in the attempt's directory
# In a spare's initial environment (with the agent's work dir, ``AGENT_DIR_ENV``): what a
# later life of the agent finds and ends (``procs.find_by_env``).
SPARE_ENV = "RELAUNCH_NODE_SPARE"
# In a spare's initial environment, its own: the processes that keep a spare's (its
# zygote, and the workers forked from it) are found by it once it serves an attempt.
SPARE_ID_ENV = "RELAUNCH_NODE_SPARE_ID"
# After a hand-off the next spare waits this long, so that its imports do not take the
# CPU from the attempt that just started (its zygote and workers import the same): on a
# loaded 2-core node a spare started 5 s after the hand-off delayed the new workers.
RESPAWN_AFTER_HANDOFF_S = 30.0
# A spare that died before it was used is replaced no sooner than this.
RESPAWN_AFTER_DEATH_S = 10.0
# A new agent registers once its spare has loaded, or after this long without it.
REGISTER_WAIT_FOR_SPARE_S = 30.0
# A spare loads at this much lower a priority than its agent's, so that on a node that
# trains it takes what the workers leave; the agent gives it the agent's own at hand-off.
SPARE_NICE = 10
# In the spare's directory: the spare zygote's HOME and TMPDIR (``home``) and its
# working directory (``cwd``).
ZYGOTE_DIR = "zygote"
# A spare says it has loaded once its zygote has too, or after this long without it.
ZYGOTE_WAIT_S = 120.0


class Handoff(BaseModel):
    """What makes a spare the launcher of one attempt: ``python -I -u -m worker.launch
    ARGV`` with ``env`` in ``cwd``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    argv: list[str]
    env: dict[str, str]
    cwd: str


def read_handoff(path: Path) -> Handoff:
    """The hand-off in ``path``, which is then deleted; ``ValueError`` unless it is a plain
    file of this process's user (root's), readable by that user only."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a plain file")
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise ValueError(f"{path} is not this user's alone (uid {info.st_uid})")
        data = os.read(fd, MAX_HANDOFF_BYTES + 1)
    finally:
        os.close(fd)
    path.unlink()
    if len(data) > MAX_HANDOFF_BYTES:
        raise ValueError(f"{path} is over {MAX_HANDOFF_BYTES} bytes")
    return Handoff.model_validate_json(data)


def preload() -> None:
    """What ``worker.launch`` imports, at once or later (``install_event_hooks``,
    ``run_torchrun``, the rendezvous backend, the sandbox's hooks): paid before any job."""
    import torch.distributed.elastic.agent.server.local_elastic_agent
    import torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler
    import torch.distributed.run  # noqa: F401

    import worker.launch
    import worker.rendezvous
    import worker.warm  # noqa: F401


def become(handoff: Handoff) -> None:
    """Take the launcher's environment, working directory and stdin."""
    os.environ.clear()
    os.environ.update(handoff.env)
    os.chdir(handoff.cwd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker.spare")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parse(sys.argv[1:] if argv is None else argv)
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != ns.parent_pid:
        return 1
    priority = os.getpriority(os.PRIO_PROCESS, 0)
    if os.geteuid() == 0:  # only root can take a lower priority back
        os.nice(SPARE_NICE)  # the zygote inherits it; the agent takes both back at hand-off
    zygote = _start_zygote()  # first: its imports are the longer
    preload()
    if zygote is not None:
        _wait_loaded(zygote)
    with contextlib.suppress(BrokenPipeError):  # handed off before it loaded: no one asks
        os.write(ns.ready_fd, b"1")
    os.close(ns.ready_fd)
    line = sys.stdin.buffer.readline(4096)
    if not line.strip():
        return 0  # the agent gave this spare up (its zygote reads EOF and ends)
    try:
        handoff = read_handoff(Path(line.decode().strip()))
        become(handoff)
    except (OSError, ValueError) as exc:
        print(f"relaunch spare launcher: bad hand-off: {exc}", file=sys.stderr)
        return 1
    from worker import launch, warm

    # As the agent set it at the hand-off, unless that came before the nice() above or the
    # zygote was started after it.
    if os.geteuid() == 0:
        for pid in (0, *(() if zygote is None else (zygote.proc.pid,))):
            with contextlib.suppress(ProcessLookupError):
                if os.getpriority(os.PRIO_PROCESS, pid) == priority + SPARE_NICE:
                    os.setpriority(os.PRIO_PROCESS, pid, priority)
    if zygote is not None:
        warm.offer_spare(zygote)
    return launch.main(handoff.argv)


def _start_zygote() -> SpareZygote | None:
    """A spare zygote beside this spare launcher: this one's environment, with HOME and
    TMPDIR in a directory of root's alone (what its imports make there, torch's compile
    cache directory, no job can have planted a link in), and a working directory of its
    own, empty, which the paths its imports derive from it are rebased from once it is
    adopted (``worker.zygote.adopt``)."""
    try:
        home, cwd = (_own_dir(Path.cwd() / ZYGOTE_DIR / name) for name in ("home", "cwd"))
        env = {**os.environ, "HOME": str(home), "TMPDIR": str(home)}
        return SpareZygote(env, cwd)
    except OSError as exc:
        print(f"relaunch spare launcher: no spare zygote: {exc}", file=sys.stderr)
        return None


def _own_dir(path: Path) -> Path:
    """``path`` (and its parent), made if missing: directories of this user's alone, 0700;
    ``OSError`` if one is a link or another's."""
    for directory in (path.parent, path):
        directory.mkdir(mode=0o700, exist_ok=True)
        info = directory.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise OSError(f"{directory} is not a directory of this user's")
        directory.chmod(0o700)
    return path


def _wait_loaded(zygote: SpareZygote) -> None:
    """Until the spare zygote has loaded, a hand-off comes, or ``ZYGOTE_WAIT_S``."""
    deadline = time.monotonic() + ZYGOTE_WAIT_S
    poller = select.poll()
    poller.register(zygote.sock.fileno(), select.POLLIN)
    poller.register(sys.stdin.fileno(), select.POLLIN)
    while time.monotonic() < deadline:
        ready = {fd for fd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000)}
        if sys.stdin.fileno() in ready:
            return  # the attempt comes first; the launcher takes the zygote as it is
        if zygote.sock.fileno() in ready:
            zygote.wait_loaded(0)
            return


@dataclass
class SpareLauncher:
    """The agent's side of one spare: its process, its pipes, whether it has loaded."""

    proc: subprocess.Popen[bytes]
    started_at: float
    _ready_fd: int
    marker: dict[str, str]  # in the environment of it and of what it starts
    ready_after_s: float | None = None
    logged: bool = False  # the agent has said it loaded

    @classmethod
    def start(cls, env: Mapping[str, str], cwd: Path) -> SpareLauncher:
        """Start a spare with ``env`` (the agent's, less what no launcher gets) in ``cwd``.

        Call it from a thread that outlives the spare and the attempt it serves: the
        spare's parent-death signal fires when the thread that started it ends."""
        marker = {SPARE_ID_ENV: secrets.token_hex(8)}
        env = {**env, **marker}
        ready_read, ready_write = os.pipe2(os.O_CLOEXEC)
        command = [
            # -I: no PYTHON* variables, no working directory on sys.path.
            sys.executable, "-I", "-u", "-m", "worker.spare",
            "--parent-pid", str(os.getpid()),
            "--ready-fd", str(ready_write),
        ]  # fmt: skip
        try:
            proc = subprocess.Popen(
                command,
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(ready_write,),
                start_new_session=True,  # a terminal's Ctrl-C reaches the agent only
            )
        except BaseException:
            os.close(ready_read)
            raise
        finally:
            os.close(ready_write)
        os.set_blocking(ready_read, False)
        return cls(proc=proc, started_at=time.monotonic(), _ready_fd=ready_read, marker=marker)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        """Whether it has loaded what a launcher loads (checked without waiting)."""
        if self.ready_after_s is None and self._ready_fd >= 0:
            try:
                got = os.read(self._ready_fd, 1)
            except BlockingIOError:
                return False
            if got == b"1":
                self.ready_after_s = time.monotonic() - self.started_at
            self._close_ready()
        return self.ready_after_s is not None

    def rss_bytes(self) -> int | None:
        return procs.rss_bytes(self.proc.pid)

    def hand_off(self, handoff: Handoff, path: Path) -> subprocess.Popen[bytes]:
        """Make this spare the launcher ``handoff`` describes; its ``Popen`` from then on.

        ``path`` is where the hand-off is written (root's, 0600, new); only its path goes
        down the pipe, which never fills. ``OSError`` if the spare is gone. A spare that
        is still loading reads it once it has loaded: that is still sooner than a new
        launcher, which would load the same from the start."""
        self.ready()
        self._close_ready()
        self._raise_priority()
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(handoff.model_dump_json())
        stdin = self.proc.stdin
        if stdin is None:
            raise OSError("the spare has no stdin")
        try:
            stdin.write(str(path).encode() + b"\n")
            stdin.close()
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            raise
        self.proc.stdin = None
        return self.proc

    def _raise_priority(self) -> None:
        """Give the spare and its zygote this process's priority: from the hand-off on,
        they are an attempt's launcher and zygote, which a new launcher would be at."""
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        for proc in [self.proc.pid, *(p.pid for p in procs.descendants(self.proc.pid))]:
            try:  # a priority is each thread's own
                threads = [int(t) for t in os.listdir(f"/proc/{proc}/task")]
            except OSError:
                continue
            for thread in threads:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.setpriority(os.PRIO_PROCESS, thread, mine)

    def stop(self) -> None:
        """End the spare (it runs nothing of anyone's) and reap it."""
        self._close_ready()
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            logger.error("spare launcher pid %d survives SIGKILL", self.proc.pid)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    def _close_ready(self) -> None:
        if self._ready_fd >= 0:
            os.close(self._ready_fd)
            self._ready_fd = -1


if __name__ == "__main__":
    from worker.ending import run_then_exit

    run_then_exit(main)
