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
the launcher believes it only after checking that it names a live child of the
zygote that runs as the job's user (``verified_pid``), and signals the worker only
through it, hang detection included (``forked``). Every received descriptor is
closed unless kept, requests never block, and a message the protocol does not
allow gives the zygote up. Workers of a zygote that died go on; the agent (a
subreaper) reaps them, so the launcher learns only that they ended
(``LOST_STATUS``).
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
from worker.zygote import (
    BOOTSTRAP,
    MAX_MESSAGE_BYTES,
    PER_WORKER_PREFIXES,
    PER_WORKER_VARIABLES,
    RECOMPUTED_VARIABLES,
    THREAD_COUNT_VARIABLES,
)

logger = logging.getLogger(__name__)

READY_WAIT_S = 120.0  # a cold worker would import as long: waiting costs nothing more
FORK_REPLY_S = 30.0
MAX_LOSSES = 3
_HOOK_MARK = "_relaunch_warm_hook"

# What acts when an interpreter, or a library it loads, starts, and is read by C code
# (the loader, libc, libgomp, OpenBLAS, CUDA) or by Python before any import: a job whose
# environment sets one otherwise than a spare zygote's (loaded before the job) has a
# zygote started for it instead, as before. What Python code read during the spare's
# imports the spare itself compares (``worker.zygote.import_read_refusal``); the
# Python-level prefixes here (TORCH, NPY_, ...) also cover what torch reads only on
# builds other than this one.
START_PREFIXES = (
    "PYTHON", "LD_", "MALLOC_", "GLIBC_", "LC_", "TORCH", "PYTORCH", "TRITON", "CUDA",
    "NVIDIA", "CUBLAS", "CUDNN", "KINETO", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_",
    "GOTO", "NPY_", "NUMPY_", "SYMPY_", "XDG_", "SSL_", "OPENSSL_",
    # Read as the interpreter and relaunch's own modules load, before the spare records:
    "SETUPTOOLS_", "PSUTIL_", "PYDANTIC_",
)  # fmt: skip
START_NAMES = frozenset({"LANG", "LANGUAGE", "TZ", "TERMINFO"})


def spare_refusal(job_env: Mapping[str, str], spare_env: Mapping[str, str]) -> str | None:
    """Why a spare zygote, loaded with ``spare_env``, cannot become the zygote of a job
    whose zygote would start with ``job_env``; None if it can."""
    for name in sorted(set(job_env) | set(spare_env)):
        if job_env.get(name) == spare_env.get(name):
            continue
        if name in THREAD_COUNT_VARIABLES:
            # A fork sets torch's pool to the worker's count, not numpy's OpenBLAS pool,
            # which took its size from the spare's as it loaded.
            return f"the job's {name} differs from the spare zygote's (its thread pools)"
        if name in PER_WORKER_VARIABLES or name.startswith(PER_WORKER_PREFIXES):
            continue
        if name in RECOMPUTED_VARIABLES:
            continue
        if name in START_NAMES or name.startswith(START_PREFIXES):
            return f"the job's {name} differs from the spare zygote's (read at start-up)"
    return None


def start_zygote(
    env: Mapping[str, str], args: Sequence[str], popen_kwargs: Mapping[str, Any]
) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """``python -u -m worker.zygote ARGS`` (a child of this process, in a session of its
    own, stdin on /dev/null) and this end of its socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        command = [sys.executable, "-u", "-m", "worker.zygote", *args]
        command += ["--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid())]
        proc = subprocess.Popen(
            command,
            env=dict(env),
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
    return proc, ours


class SpareZygote:
    """A zygote loaded before any job (``worker.zygote --spare``): root's, with the
    spare launcher's environment less nothing and plus nothing of any job's, in a
    root-only directory, until one launcher hands it its job (``Zygote(spare=)``)."""

    def __init__(self, env: Mapping[str, str], cwd: Path) -> None:
        self.env = dict(env)
        self.import_s: float | None = None
        self.proc, self.sock = start_zygote(self.env, ["--spare"], {"cwd": cwd})

    def wait_loaded(self, timeout: float) -> bool:
        """Whether it has loaded within ``timeout`` (its ``loaded`` message is taken)."""
        if self.import_s is not None:
            return True
        if not _readable(self.sock.fileno(), timeout):
            return False
        try:
            message = json.loads(self.sock.recv(MAX_MESSAGE_BYTES) or b"{}")
            if not isinstance(message, dict) or "loaded" not in message:
                raise ValueError(f"not a loaded message: {message!r:.80}")
            self.import_s = float(message["import_s"])
        except (OSError, ValueError, KeyError, TypeError):
            self.stop()  # it ended, or said what a spare does not say
            return False
        return True

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


# The spare zygote this process (a spare launcher that became one attempt's launcher)
# brought with it: taken once, by the attempt's ``WarmStarter``.
_spare: SpareZygote | None = None


def offer_spare(spare: SpareZygote) -> None:
    """Leave ``spare`` for this process's ``WarmStarter`` to take (``take_spare``)."""
    global _spare
    _spare = spare


def take_spare() -> SpareZygote | None:
    global _spare
    spare, _spare = _spare, None
    return spare


def discard_spare() -> None:
    """End a spare zygote that no ``WarmStarter`` took (warm starts are off)."""
    spare = take_spare()
    if spare is not None:
        spare.stop()


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


def _readable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` turns readable within ``timeout`` (a pidfd: its process ended)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))


# Popen's returncode for a worker whose zygote died before it: it ended, how is not known.
LOST_STATUS = 1
# Live and past forked workers of this launcher by pid, to signal through their pidfds.
_forked: dict[int, ForkedProcess] = {}


def forked(pid: int) -> ForkedProcess | None:
    """The forked worker with this pid, if this launcher forked one."""
    return _forked.get(pid)


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
        """Its zygote is gone: no one will tell this launcher how it ends (it is the
        agent's to reap), only that it ended, through the pidfd."""
        with self._done:
            self._orphaned = True
            self._done.notify_all()

    def _close_pidfd(self) -> None:
        """It has ended: forget its pidfd, and its pid, which is free for others now."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if _forked.get(self.pid) is self:
            del _forked[self.pid]

    def _check_orphan(self, timeout: float) -> None:
        """Once an orphan has ended (its pidfd turns readable), end it here with
        ``LOST_STATUS``: its real status went to whoever reaped it."""
        pidfd = self._pidfd
        if pidfd is None or not _readable(pidfd, timeout):
            return
        with self._done:
            if self.returncode is None:
                logger.warning(
                    "worker pid %d ended after its zygote; its exit status is lost", self.pid
                )
                self.returncode = LOST_STATUS
            self._close_pidfd()
            self._done.notify_all()

    def poll(self) -> int | None:
        if self.returncode is None and self._orphaned:
            self._check_orphan(0.0)
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
            self._check_orphan(step)

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
    args: list[str]
    worker: ForkedProcess | None = None
    refusal: str | None = None


class ZygoteBroke(Exception):
    """The zygote said something the protocol does not allow: it is given up."""


class Zygote:
    """One zygote process and the thread that reads what it says.

    The reader thread checks each child the zygote names (``verified_pid``) and
    registers it before it reads the next message, so the child's ``exited`` always
    finds it. The child itself waits at a gate (a pipe whose read end goes with the
    request) until the launcher has its registered worker in hand: a child that the
    launcher gave up on (no answer in time, a failed check) reads EOF and exits
    before it runs anything of the job's."""

    def __init__(
        self,
        *,
        env: Mapping[str, str],
        uid: int | None,
        popen_kwargs: Mapping[str, Any],
        on_change: Callable[[Zygote, str, str], None],
        spare: SpareZygote | None = None,
    ) -> None:
        self.env = dict(env)
        self.uid = uid
        self.gid = popen_kwargs.get("group", uid)
        self.spare = spare is not None
        self.refusal: str | None = None  # a spare's, when it would not adopt the job
        self.spare_passed_over: str | None = None  # why the spare is not this zygote
        self.pid: int | None = None
        self.import_s: float | None = None
        self.ready = threading.Event()
        self.gone = threading.Event()
        self._on_change = on_change
        self._lock = threading.Lock()  # one request at a time
        self._next_id = 0
        self._pending: dict[int, _Pending] = {}
        self._workers: dict[int, ForkedProcess] = {}
        if spare is not None:
            self._sock = spare.sock
            self._proc = spare.proc
            self._adopt(popen_kwargs)
        else:
            self._start(popen_kwargs)
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _adopt(self, popen_kwargs: Mapping[str, Any]) -> None:
        """Hand the spare this job: its user, environment, working directory (this
        launcher's own, the job's) and priority (this launcher's, as a child's would be)."""
        adoption = {
            "uid": popen_kwargs.get("user"),
            "gid": popen_kwargs.get("group"),
            "env": self.env,
            "cwd": os.getcwd(),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
        }
        payload = json.dumps({"adopt": adoption}).encode()
        try:
            if len(payload) > MAX_MESSAGE_BYTES:
                raise OSError("the job's environment is too large for one message")
            self._sock.sendmsg([payload], [], socket.MSG_DONTWAIT)
        except OSError:
            self.stop()
            self._sock.close()
            raise

    def _start(self, popen_kwargs: Mapping[str, Any]) -> None:
        # No cwd=: the launcher's own is the job's working directory, and Popen would look
        # the path up again as root, before the switch to the job's user.
        self._proc, self._sock = start_zygote(self.env, [], popen_kwargs)

    def rss_bytes(self) -> int | None:
        return procs.rss_bytes(self._proc.pid)

    def _read(self) -> None:
        try:
            while True:
                fds = array.array("i")
                payload, ancillary, _, _ = self._sock.recvmsg(
                    MAX_MESSAGE_BYTES, socket.CMSG_SPACE(4 * fds.itemsize), socket.MSG_CMSG_CLOEXEC
                )
                for level, kind, data in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
                received = list(fds)
                try:
                    if not payload:
                        break
                    self._dispatch(json.loads(payload), received)
                finally:
                    for fd in received:  # whatever _dispatch did not take
                        with contextlib.suppress(OSError):
                            os.close(fd)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ZygoteBroke) as exc:
            logger.warning("zygote %s: %s; giving it up", self._proc.pid, exc)
            self.stop()
        finally:
            self._lost()

    def _dispatch(self, message: dict[str, Any], fds: list[int]) -> None:
        """Apply one message; a descriptor it keeps it removes from ``fds``."""
        if not isinstance(message, dict):
            raise ZygoteBroke(f"not a message: {message!r:.80}")
        if "ready" in message and self.pid is None:
            if self.spare and self.uid is not None:
                uids = _status_field(self._proc.pid, "Uid")
                gids = _status_field(self._proc.pid, "Gid")
                groups = _status_field(self._proc.pid, "Groups")
                if (
                    not uids
                    or any(int(u) != self.uid for u in uids)
                    or any(int(g) != self.gid for g in gids)
                    or groups
                ):
                    raise ZygoteBroke(
                        f"the adopted spare runs as uids {uids}, gids {gids}, groups {groups}"
                    )
            self.pid = self._proc.pid
            self.import_s = float(message.get("import_s") or 0.0)
            self.ready.set()
            how = ", a spare loaded before the job" if self.spare else ""
            self._on_change(self, "ready", f"warm zygote pid {self.pid} ready{how}")
        elif "loaded" in message and self.spare and self.pid is None:
            pass  # a spare handed its job before it had loaded; its answer follows
        elif "refused" in message and self.spare and self.pid is None:
            self.refusal = str(message.get("reason") or "no reason given")[:300]
            raise ZygoteBroke(f"the spare zygote would not adopt the job: {self.refusal}")
        elif "exited" in message:
            worker = self._workers.pop(int(message["exited"]), None)
            if worker is not None:
                worker.exited(int(message["returncode"]))
        elif "forked" in message or "refused" in message:
            key = int(message.get("forked", message.get("refused", -1)))
            pending = self._pending.get(key)
            if pending is None or pending.ready.is_set():
                raise ZygoteBroke(f"a reply to no request ({key})")
            if "forked" in message:
                if len(fds) != 1:
                    raise ZygoteBroke("a child without its pidfd")
                pidfd = fds.pop()
                try:
                    pid = verified_pid(pidfd, self._proc.pid, self.uid)
                except (PermissionError, OSError, ValueError) as exc:
                    os.close(pidfd)
                    pending.refusal = f"the zygote's child failed its check: {exc}"
                    pending.ready.set()
                    raise ZygoteBroke(pending.refusal) from exc
                worker = ForkedProcess(pid, pidfd, pending.args)
                self._workers[pid] = worker
                _forked[pid] = worker
                pending.worker = worker
            else:
                pending.refusal = str(message.get("reason") or "no reason given")[:300]
            pending.ready.set()
        else:
            raise ZygoteBroke(f"an unknown message: {sorted(message)[:5]}")

    def _lost(self) -> None:
        self.gone.set()  # no fork from here on
        for worker in list(self._workers.values()):
            worker.orphan()
        self._workers.clear()
        with contextlib.suppress(OSError):
            self._sock.close()
        # The verdict (give up, or start another) comes before anyone waiting is woken, so
        # that a worker that waited for this zygote starts cold for the reason it gives.
        try:
            self._on_change(self, "lost", "")
        finally:
            self.ready.set()
            for pending in list(self._pending.values()):
                if not pending.ready.is_set():
                    pending.refusal = "the zygote is gone"
                    pending.ready.set()

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
            message = {
                "fork": key,
                "argv": list(args[2:]),
                "env": dict(env),
                "cwd": os.getcwd(),
                "new_session": True,
                "stdout": stdout is not None,
                "stderr": stderr is not None,
                "gate": True,
            }
            payload = json.dumps(message).encode()
            if len(payload) > MAX_MESSAGE_BYTES:
                raise ColdStart("the worker's environment is too large for one request")
            pending = _Pending(threading.Event(), list(args))
            gate_read, gate_write = os.pipe2(os.O_CLOEXEC)
            self._pending[key] = pending
            try:
                fds = array.array("i", [f.fileno() for f in outputs] + [gate_read])
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
                # Never blocks: a zygote that reads no requests fills its queue.
                self._sock.sendmsg([payload], rights, socket.MSG_DONTWAIT)
            except OSError as exc:
                os.close(gate_write)
                del self._pending[key]
                self.stop()
                raise ColdStart(f"cannot reach the zygote: {exc}") from exc
            finally:
                os.close(gate_read)
            try:
                answered = pending.ready.wait(FORK_REPLY_S)
                if not answered:
                    self.stop()
                    raise ColdStart(f"the zygote did not answer within {FORK_REPLY_S:.0f} s")
                if pending.worker is None:
                    raise ColdStart(f"the zygote refused: {pending.refusal}")
                os.write(gate_write, b"1")  # registered: the child may become the worker
                return pending.worker
            finally:
                os.close(gate_write)
                del self._pending[key]

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
        uid: int | None,
        popen_kwargs: Mapping[str, Any],
        on_event: Callable[[str, str, Zygote | None], None],
    ) -> None:
        self._env = dict(env)
        self._uid = uid
        self._popen_kwargs = dict(popen_kwargs)
        self._on_event = on_event
        self._losses = 0
        self._lock = threading.RLock()
        self._stopping = False
        self.zygote: Zygote | None = None
        self.given_up: str | None = None
        self._spare_note: str | None = None  # why the spare zygote was not used
        self._start_first()

    def _start(self, spare: SpareZygote | None = None) -> None:
        try:
            self.zygote = Zygote(
                env=self._env, uid=self._uid, popen_kwargs=self._popen_kwargs,
                on_change=self._changed, spare=spare,
            )  # fmt: skip
        except OSError as exc:
            if spare is not None:
                self._spare_note = f"the spare zygote could not be reached: {exc}"
                self._start()
                return
            self._give_up(f"cannot start the zygote: {exc}", None)

    def _start_first(self) -> None:
        """The spare zygote this launcher brought, if it can be this job's; else a new one."""
        spare = take_spare()
        if spare is not None:
            why = spare_refusal(self._env, spare.env)
            if why is None and spare.proc.poll() is not None:
                why = f"the spare zygote had ended (exit {spare.proc.returncode})"
            if why is None:
                self._start(spare)
                return
            self._spare_note = why
            spare.stop()
        self._start()

    def _give_up(self, why: str, zygote: Zygote | None) -> None:
        self.given_up = why
        self.zygote = None
        self._on_event("unavailable", why, zygote)

    def _changed(self, zygote: Zygote, state: str, message: str) -> None:
        if state == "ready":
            if self._spare_note is not None:
                message = f"{message} (the spare zygote was not used: {self._spare_note})"
                zygote.spare_passed_over, self._spare_note = self._spare_note, None
            self._on_event("ready", message, zygote)
            return
        with self._lock:
            if self._stopping or zygote is not self.zygote:
                return
            if zygote.spare and zygote.pid is None:
                # A spare that would not adopt the job, or died first: not a loss of
                # this job's zygote, which is started now as it would have been.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    zygote._proc.wait(5)
                self._spare_note = zygote.refusal or (
                    f"the spare zygote ended (exit {zygote._proc.poll()}) before it adopted the job"
                )
                self._start()
                return
            self._losses += 1
            with contextlib.suppress(subprocess.TimeoutExpired):
                zygote._proc.wait(5)
            what = f"the zygote (pid {zygote._proc.pid}) is gone (exit {zygote._proc.poll()})"
            if zygote.pid is None:  # it never got ready: another would fail the same way
                self._give_up(f"{what} before it was ready (its stderr is in the logs)", zygote)
            elif self._losses > MAX_LOSSES:
                self._give_up(f"{what}, {self._losses} times: workers start cold from now", zygote)
            else:
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
        waited = zygote.usable(READY_WAIT_S)
        replacement = self.zygote
        if waited is not None and zygote.spare and replacement not in (None, zygote):
            # The spare would not be this job's; the zygote started in its place is.
            zygote = replacement
            waited = zygote.usable(READY_WAIT_S)
        if waited is not None:
            with self._lock:
                if zygote is self.zygote:
                    # Waited once for all: the next ranks and restarts start cold at once.
                    self._give_up(waited, zygote)
                    zygote.stop()
                # A zygote that died was judged before the wait ended (``Zygote._lost``).
                raise ColdStart(self.given_up or waited)
        reason = cold_start_reason(args, env, zygote.env)
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
