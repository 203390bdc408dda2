"""Warm worker starts, the launcher's side: a zygote per launcher, and forked workers
that torch's elastic agent handles as the processes it would have started.

The launcher starts one zygote (``worker.zygote``) as soon as it knows the job's
user and variables, before the rendezvous, so the zygote's imports overlap the
rendezvous. The zygote runs as the job's user with the job's environment (never
as root with it): it is a worker that has not been told its rank yet. Every
worker of every restart in this launcher is then a fork of it, which skips
Python's and torch's start. ``install`` puts it at the one place where torch
starts a worker (``SubprocessHandler._popen``); monitoring, restarts, exit codes,
hang detection and per-rank logs go on through torch's own code, which sees a
``ForkedProcess`` with the part of ``subprocess.Popen`` it uses.

A worker is started cold, as before, with a ``cold_start`` event saying why,
when the zygote cannot give a sound one: it is not ready within ``READY_WAIT_S``
or gave up, the worker's command is not the bootstrap's, or the worker's
environment differs from the zygote's in a variable that only takes effect when
an interpreter starts (anything outside ``PER_WORKER_*``). A zygote that dies is
replaced, up to ``MAX_LOSSES`` times per launcher; one that dies before it is ready
(its imports failed: another would fail alike) is not.

The launcher trusts nothing the zygote says, since the job's code may have run
in it (a planted module, ``LD_PRELOAD``). The zygote sends a pidfd of each child;
the launcher signals workers only through it, and only after checking that it
names a live child of the zygote that runs as the job's user (``verified_pid``).
Orphans of a zygote that died re-parent to the launcher (a subreaper), which
reaps them through their pidfds: no exit status is lost.
"""

from __future__ import annotations

import array
import contextlib
import functools
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from worker import procs
from worker.zygote import BOOTSTRAP, MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)

READY_WAIT_S = 120.0  # a cold worker would import as long: waiting costs nothing more
FORK_REPLY_S = 30.0
MAX_LOSSES = 3
_HOOK_MARK = "_relaunch_warm_hook"

# What torch's elastic agent sets per worker, and what is read only when used (not
# when an interpreter or a library starts): a worker may differ from its zygote here.
PER_WORKER_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",  # read when CUDA initialises, never in the zygote
        "OMP_NUM_THREADS",  # set in the child (worker.zygote)
        "MKL_NUM_THREADS",
    }
)
PER_WORKER_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "NCCL_")


def cold_start_reason(
    args: Sequence[str], worker_env: Mapping[str, str], zygote_env: Mapping[str, str]
) -> str | None:
    """Why this worker must start cold rather than as a fork of the zygote; None if
    a fork gives the process ``args`` with ``worker_env`` would have been."""
    if list(args[:4]) != [sys.executable, "-u", *BOOTSTRAP]:
        return "its command is not relaunch's bootstrap under this interpreter"
    for name in sorted(set(worker_env) | set(zygote_env)):
        if worker_env.get(name) == zygote_env.get(name):
            continue
        if name in PER_WORKER_VARIABLES or name.startswith(PER_WORKER_PREFIXES):
            continue
        return f"its environment's {name} differs from the zygote's (read at start-up)"
    return None


def pidfd_pid(pidfd: int) -> int | None:
    """The pid a pidfd names; None once that process has exited."""
    for line in Path(f"/proc/self/fdinfo/{pidfd}").read_text().splitlines():
        if line.startswith("Pid:"):
            pid = int(line.split()[1])
            return pid if pid > 0 else None
    return None


def _status_field(pid: int, name: str) -> list[str]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return line.split()[1:]
    return []


def verified_pid(pidfd: int, parent: int, uid: int | None) -> int:
    """The pid of the process ``pidfd`` names, checked to be a live child of ``parent``
    running as ``uid`` (when given); ``PermissionError`` otherwise.

    The pid is read again after the checks: a process alive at both reads cannot
    have had its pid reused in between."""
    pid = pidfd_pid(pidfd)
    if pid is None:
        raise PermissionError("the zygote's pidfd names no live process")
    try:
        ppid = _status_field(pid, "PPid")
        uids = _status_field(pid, "Uid")
    except FileNotFoundError:
        raise PermissionError(f"process {pid} is gone") from None
    if ppid != [str(parent)]:
        raise PermissionError(f"process {pid} is not a child of the zygote {parent}")
    if uid is not None and (not uids or any(int(u) != uid for u in uids)):
        raise PermissionError(f"process {pid} runs as uids {uids}, not the job's {uid}")
    if pidfd_pid(pidfd) != pid:
        raise PermissionError(f"process {pid} ended while it was checked")
    return pid


class ForkedProcess:
    """A worker forked by the zygote, with the part of ``subprocess.Popen`` that torch's
    elastic agent uses: ``pid``, ``args``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``. Signals go through the pidfd only."""

    def __init__(self, pid: int, pidfd: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._pidfd: int | None = pidfd
        self._done = threading.Condition()
        self._orphaned = False

    def exited(self, returncode: int) -> None:
        """The zygote reaped it (reader thread)."""
        with self._done:
            if self.returncode is None:
                self.returncode = returncode
            self._close_pidfd()
            self._done.notify_all()

    def orphan(self) -> None:
        """Its zygote is gone: it is this launcher's child now (a subreaper)."""
        with self._done:
            self._orphaned = True
            self._done.notify_all()

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _reap_orphan(self, timeout: float) -> None:
        """Take the exit status of an orphaned worker once it has one (waiting up to
        ``timeout`` for it); only its parent, this launcher by now, can."""
        pidfd = self._pidfd
        if pidfd is None or not select.select([pidfd], [], [], max(0.0, timeout))[0]:
            return
        with self._done:
            if self._pidfd is None or self.returncode is not None:
                return
            try:
                result = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
            except ChildProcessError:  # not ours yet: the kernel is re-parenting it
                return
            if result is None:
                return
            code = result.si_status
            self.returncode = code if result.si_code == os.CLD_EXITED else -code
            self._close_pidfd()
            self._done.notify_all()

    def poll(self) -> int | None:
        if self.returncode is None and self._orphaned:
            self._reap_orphan(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._done:
                if self.returncode is not None:
                    return self.returncode
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                step = 0.1 if left is None else min(left, 0.1)
                if not self._orphaned:
                    self._done.wait(step)
                    continue
            self._reap_orphan(step)

    def send_signal(self, sig: int) -> None:
        with self._done:
            if self.returncode is None and self._pidfd is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, sig)

    def signal_group(self, sig: int) -> None:
        """Signal the worker's session, as torch does (``killpg``), while it lives: a
        live process keeps its pid, so its group cannot be another's."""
        with self._done:
            alive = self._pidfd is not None and pidfd_pid(self._pidfd) == self.pid
            if self.returncode is None and alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ColdStart(Exception):
    """The worker cannot be forked; the message says why."""


@dataclass
class _Pending:
    ready: threading.Event
    pid: int | None = None
    pidfd: int | None = None
    refusal: str | None = None


class Zygote:
    """One zygote process and the thread that reads what it says."""

    def __init__(
        self,
        *,
        env: Mapping[str, str],
        cwd: str,
        uid: int | None,
        popen_kwargs: Mapping[str, Any],
        on_change: Callable[[Zygote, str, str], None],
    ) -> None:
        self.env = dict(env)
        self.cwd = cwd
        self.uid = uid
        self.pid: int | None = None
        self.import_s: float | None = None
        self.ready = threading.Event()
        self.gone = threading.Event()
        self._on_change = on_change
        self._lock = threading.Lock()  # one request at a time
        self._next_id = 0
        self._pending: dict[int, _Pending] = {}
        self._workers: dict[int, ForkedProcess] = {}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        try:
            command = [sys.executable, "-u", "-m", "worker.zygote"]
            command += ["--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid())]
            self._proc = subprocess.Popen(
                command,
                env=self.env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                **popen_kwargs,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def rss_bytes(self) -> int | None:
        try:
            pages = int(Path(f"/proc/{self._proc.pid}/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return pages * os.sysconf("SC_PAGE_SIZE")

    def _read(self) -> None:
        try:
            while True:
                fds = array.array("i")
                payload, ancillary, _, _ = self._sock.recvmsg(
                    MAX_MESSAGE_BYTES, socket.CMSG_SPACE(fds.itemsize)
                )
                for level, kind, data in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
                if not payload:
                    break
                self._dispatch(json.loads(payload), list(fds))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("zygote %s: %s; giving it up", self.pid, exc)
        finally:
            self._lost()

    def _dispatch(self, message: dict[str, Any], fds: list[int]) -> None:
        if "ready" in message or "exited" in message:
            for fd in fds:
                os.close(fd)
        if "ready" in message:
            self.pid = self._proc.pid
            self.import_s = float(message.get("import_s") or 0.0)
            self.ready.set()
            self._on_change(self, "ready", f"warm zygote pid {self.pid} ready")
        elif "forked" in message or "refused" in message:
            key = int(message.get("forked", message.get("refused", -1)))
            pending = self._pending.get(key)
            if pending is None:
                for fd in fds:
                    os.close(fd)
                raise ValueError(f"a reply to no request ({key})")
            if "forked" in message and len(fds) == 1:
                pending.pidfd = fds[0]
            else:
                for fd in fds:
                    os.close(fd)
                pending.refusal = str(message.get("reason") or "no pidfd with the reply")[:300]
            pending.ready.set()
        elif "exited" in message:
            worker = self._workers.pop(int(message["exited"]), None)
            if worker is not None:
                worker.exited(int(message["returncode"]))

    def _lost(self) -> None:
        self.gone.set()
        self.ready.set()  # wake whoever waits for it
        for pending in list(self._pending.values()):
            pending.refusal = pending.refusal or "the zygote is gone"
            pending.ready.set()
        for worker in list(self._workers.values()):
            worker.orphan()
        self._workers.clear()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._on_change(self, "lost", "")

    def usable(self, timeout: float) -> str | None:
        """None once the zygote is ready; else why it is not."""
        if not self.ready.wait(timeout):
            return f"the zygote was not ready within {timeout:.0f} s"
        if self.gone.is_set():
            return "the zygote is gone"
        return None

    def fork(
        self, args: Sequence[str], env: Mapping[str, str], stdout: IO[Any] | None,
        stderr: IO[Any] | None,
    ) -> ForkedProcess:  # fmt: skip
        """Fork one worker; ``ColdStart`` if the zygote cannot or will not."""
        outputs = [f for f in (stdout, stderr) if f is not None]
        with self._lock:
            if self.gone.is_set():
                raise ColdStart("the zygote is gone")
            self._next_id += 1
            key = self._next_id
            pending = _Pending(threading.Event())
            self._pending[key] = pending
            message = {
                "fork": key,
                "argv": list(args[2:]),
                "env": dict(env),
                "cwd": os.getcwd(),
                "new_session": True,
                "stdout": stdout is not None,
                "stderr": stderr is not None,
            }
            payload = json.dumps(message).encode()
            if len(payload) > MAX_MESSAGE_BYTES:
                del self._pending[key]
                raise ColdStart("the worker's environment is too large for one request")
            try:
                fds = array.array("i", [f.fileno() for f in outputs])
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if outputs else []
                self._sock.sendmsg([payload], ancillary)
            except OSError as exc:
                del self._pending[key]
                raise ColdStart(f"cannot reach the zygote: {exc}") from exc
            if not pending.ready.wait(FORK_REPLY_S):
                del self._pending[key]
                self.stop()
                raise ColdStart(f"the zygote did not answer within {FORK_REPLY_S:.0f} s")
            del self._pending[key]
            if pending.refusal is not None or pending.pidfd is None:
                raise ColdStart(f"the zygote refused: {pending.refusal}")
            try:
                pid = verified_pid(pending.pidfd, self._proc.pid, self.uid)
            except (PermissionError, OSError, ValueError) as exc:
                os.close(pending.pidfd)
                self.stop()  # it lied, or its child died at once: trust it no more
                raise ColdStart(f"the zygote's child failed its check: {exc}") from exc
            worker = ForkedProcess(pid, pending.pidfd, args)
            self._workers[pid] = worker
            return worker

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5)


class WarmStarter:
    """The launcher's zygote, replaced when it dies. ``on_event(state, message, zygote)``
    hears of it: ``ready``, ``lost`` (another is started) and ``unavailable``."""

    def __init__(
        self,
        *,
        env: Mapping[str, str],
        cwd: str,
        uid: int | None,
        popen_kwargs: Mapping[str, Any],
        on_event: Callable[[str, str, Zygote | None], None],
    ) -> None:
        self._env = dict(env)
        self._cwd = cwd
        self._uid = uid
        self._popen_kwargs = dict(popen_kwargs)
        self._on_event = on_event
        self._losses = 0
        self._lock = threading.RLock()
        self._stopping = False
        self.zygote: Zygote | None = None
        self.given_up: str | None = None
        procs.become_subreaper()  # a dead zygote's workers become ours, to reap
        self._start()

    def _start(self) -> None:
        try:
            self.zygote = Zygote(
                env=self._env, cwd=self._cwd, uid=self._uid,
                popen_kwargs=self._popen_kwargs, on_change=self._changed,
            )  # fmt: skip
        except OSError as exc:
            self.zygote = None
            self.given_up = f"cannot start the zygote: {exc}"
            self._on_event("unavailable", self.given_up, None)

    def _changed(self, zygote: Zygote, state: str, message: str) -> None:
        if state == "ready":
            self._on_event("ready", message, zygote)
            return
        with self._lock:
            if self._stopping or zygote is not self.zygote:
                return
            self._losses += 1
            with contextlib.suppress(subprocess.TimeoutExpired):
                zygote._proc.wait(5)
            what = f"the zygote (pid {zygote._proc.pid}) is gone (exit {zygote._proc.poll()})"
            if zygote.pid is None:  # it never got ready: another would fail the same way
                self.given_up = f"{what} before it was ready (its stderr is in the logs)"
                self.zygote = None
                self._on_event("unavailable", self.given_up, zygote)
                return
            if self._losses > MAX_LOSSES:
                self.given_up = f"{what}, {self._losses} times: workers start cold from now"
                self.zygote = None
                self._on_event("unavailable", self.given_up, zygote)
                return
            self._on_event("lost", f"{what}; starting another", zygote)
            self._start()

    def fork(
        self, args: Sequence[str], env: Mapping[str, str], stdout: IO[Any] | None,
        stderr: IO[Any] | None,
    ) -> ForkedProcess:  # fmt: skip
        """One worker forked from the zygote; ``ColdStart`` with the reason if not."""
        zygote = self.zygote
        if zygote is None:
            raise ColdStart(self.given_up or "no zygote")
        reason = zygote.usable(READY_WAIT_S) or cold_start_reason(args, env, zygote.env)
        if reason is not None:
            raise ColdStart(reason)
        return zygote.fork(args, env, stdout, stderr)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            zygote = self.zygote
        if zygote is not None:
            zygote.stop()


def install_close_hook() -> None:
    """Have torch end a forked worker through its pidfd (this process only).

    Seam (torch 2.11 to 2.13, ``torch/distributed/elastic/multiprocessing/``):
    ``SubprocessHandler.close(death_sig)`` signals the worker's process group with
    ``os.killpg(self.proc.pid, sig)`` and closes ``self._stdout``/``self._stderr``.
    For a ``ForkedProcess`` the group is signalled only while the pidfd shows the
    worker alive (``ForkedProcess.signal_group``). Workers are started in
    ``worker.sandbox.install_worker_hooks``, which calls ``WarmStarter.fork``."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handler_module,
    )

    handler = handler_module.SubprocessHandler
    original_close = handler.close
    if getattr(original_close, _HOOK_MARK, False):
        raise RuntimeError("warm start hooks are already installed in this process")

    @functools.wraps(original_close)
    def _close(self: Any, death_sig: signal.Signals | None = None) -> None:
        proc = self.proc
        if not isinstance(proc, ForkedProcess):
            original_close(self, death_sig)
            return
        proc.signal_group(death_sig or signal.SIGTERM)
        for output in (self._stdout, self._stderr):
            if output is not None:
                output.close()

    setattr(_close, _HOOK_MARK, True)
    handler.close = _close  # type: ignore[method-assign]
