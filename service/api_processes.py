"""More than one process answering the API (``RELAUNCH_API_PROCESSES``).

One process answers every request on one event loop, and its route threads take the
interpreter lock in turn with that loop: past a few hundred requests a second, a
heartbeat waits for the loop, not for the database. Controllers on one database already
share everything a request needs (jobs, nodes, tokens, rendezvous, the heartbeats'
pace), so more processes on the same port answer the same API.

The controller (the main process) binds the port once per process (``bind_listeners``:
``SO_REUSEPORT``, so that the kernel spreads new connections evenly over the processes'
sockets, where processes that accept from one socket share them by who wakes first),
migrates the database and runs the reconciler; once it serves, it starts
``api_processes - 1`` helpers. Each helper is a new interpreter (``python -c``,
``HELPER_MAIN``) that inherits its socket and accepts from it, and one end of a socket
pair to the controller, over which nothing but these messages go:

- to the helper: its settings first (``Start``), then answers to what it asked;
- from the helper: wakes of the reconciler (``Wake``: a submit's, a registration's that
  waits up to a second for the pass), which the controller passes to its own reconciler;
  its request metrics every ``PUSH_EVERY_S`` (``Families``), which the controller adds to
  its own on ``/metrics``; and a scrape that reached the helper (``Expose``), which the
  controller answers, so that every process serves the same ``/metrics``.

A helper dies with the controller (``PR_SET_PDEATHSIG``) and stops once its pair is
closed, so a SIGKILLed controller leaves no process on its port. A helper that dies is
started again (after 1 s, doubling up to 30 s while it keeps dying). Signals are the
controller's: a helper ignores SIGINT and SIGTERM, and the controller stops its helpers
(closes their pairs, then SIGKILLs any still running after ``STOP_WAIT_S``) before it
stops itself.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

if TYPE_CHECKING:
    from service.metrics import ControllerMetrics
    from service.settings import ControllerSettings

logger = logging.getLogger(__name__)

PROCESS_NAME = "relaunch-api"  # /proc/PID/comm keeps 15 bytes
RESPAWN_FIRST_S = 1.0
RESPAWN_MAX_S = 30.0
RESPAWN_RESET_AFTER_S = 60.0  # a helper that ran this long is started again after 1 s
STOP_WAIT_S = 10.0  # a stopping helper finishes the requests it has begun within this
PUSH_EVERY_S = 1.0  # how stale a helper's share of /metrics may be
# A scrape that reached a helper waits this long for the controller's answer.
EXPOSE_WAIT_S = 10.0
# The helper's command (``service.api_helper.main``); signals are the controller's.
HELPER_MAIN = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "import sys; from service.api_helper import main; main(sys.argv[1:])"
)


def bind_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` TCP sockets bound to ``host:port`` (port 0: the one the first gets), not
    yet listening (each process's server listens once it serves); with more than one,
    they share the port by ``SO_REUSEPORT``, which only sockets of this user can join."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listeners: list[socket.socket] = []
    try:
        for _ in range(count):
            listener = socket.socket(family, socket.SOCK_STREAM)
            listeners.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if count > 1:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            listener.bind((host, port))
            port = listener.getsockname()[1]
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    return listeners


@dataclass(frozen=True)
class Start:
    settings: ControllerSettings
    log_level: int


@dataclass(frozen=True)
class Wake:
    id: int
    wait_s: float


@dataclass(frozen=True)
class Woken:
    id: int
    ended: bool  # a pass begun after the wake has ended (``PassSignals.wake``)


@dataclass(frozen=True)
class Expose:
    id: int


@dataclass(frozen=True)
class Exposed:
    id: int
    body: bytes


@dataclass(frozen=True)
class Families:
    metrics: list[Metric]


class ApiProcesses:
    """The controller's side: a helper on each of ``listeners``, started again if it dies
    (on the same socket, which the controller keeps open: connections the kernel gave it
    meanwhile wait for the next helper); ``wake`` is the controller's reconciler's,
    ``metrics`` where the helpers' shares are kept and what answers their scrapes."""

    def __init__(
        self,
        settings: ControllerSettings,
        listeners: list[socket.socket],
        wake: Callable[[float], bool],
        metrics: ControllerMetrics,
    ) -> None:
        self._settings = settings
        self._listeners = listeners
        self._wake = wake
        self._metrics = metrics
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._helpers: dict[int, tuple[subprocess.Popen[bytes], Connection]] = {}
        self._threads = [
            threading.Thread(target=self._watch, args=(slot,), name=f"api-{slot}", daemon=True)
            for slot in range(len(listeners))
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def pids(self) -> list[int]:
        with self._lock:
            return [helper.pid for helper, _ in self._helpers.values()]

    def stop(self) -> None:
        """Close every helper's pair (it finishes what it has begun and exits), then
        SIGKILL what is still running after ``STOP_WAIT_S``."""
        self._stopping.set()
        with self._lock:
            helpers = list(self._helpers.values())
        for _, link in helpers:
            _hang_up(link)
        for thread in self._threads:
            thread.join(STOP_WAIT_S + 1)

    def _watch(self, slot: int) -> None:
        delay = RESPAWN_FIRST_S
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                helper, link = self._spawn(self._listeners[slot])
            except Exception:
                logger.exception("could not start API process %s; again in %g s", slot, delay)
                self._stopping.wait(delay)
                delay = min(delay * 2, RESPAWN_MAX_S)
                continue
            with self._lock:
                self._helpers[slot] = (helper, link)
            if self._stopping.is_set():  # ``stop`` came while it started
                _hang_up(link)
            self._serve(slot, link)
            with contextlib.suppress(OSError):
                link.close()
            try:
                code = helper.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                helper.kill()
                code = helper.wait()
            with self._lock:
                self._helpers.pop(slot, None)
            self._metrics.helpers.forget(slot)
            if self._stopping.is_set():
                return
            if time.monotonic() - began > RESPAWN_RESET_AFTER_S:
                delay = RESPAWN_FIRST_S
            logger.error(
                "API process %s (pid %s) exited (code %s); starting another in %g s",
                slot,
                helper.pid,
                code,
                delay,
            )
            self._stopping.wait(delay)
            delay = min(delay * 2, RESPAWN_MAX_S)

    def _spawn(self, listener: socket.socket) -> tuple[subprocess.Popen[bytes], Connection]:
        mine, theirs = socket.socketpair()
        try:
            helper = subprocess.Popen(
                [
                    sys.executable,
                    "-P",  # nothing imported from the working directory
                    "-c",
                    HELPER_MAIN,
                    str(listener.fileno()),
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=(listener.fileno(), theirs.fileno()),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        link = Connection(mine.detach())
        with contextlib.suppress(OSError):  # it died at once: ``_serve`` reads the end
            link.send(Start(self._settings, logging.getLogger().getEffectiveLevel()))
        logger.info("API process running as %s", helper.pid)
        return helper, link

    def _serve(self, slot: int, link: Connection) -> None:
        """Answer one helper until its pair closes (it exited, or ``stop``)."""
        sending = threading.Lock()

        def reply(message: Woken | Exposed) -> None:
            with sending, contextlib.suppress(OSError):
                link.send(message)

        def waited_wake(wake: Wake) -> None:
            reply(Woken(wake.id, self._wake(wake.wait_s)))

        while True:
            try:
                message = link.recv()
            except (EOFError, OSError):
                return
            if isinstance(message, Families):
                self._metrics.helpers.update(slot, message.metrics)
            elif isinstance(message, Wake):
                if message.wait_s > 0:  # waits up to a second: not on this reader
                    threading.Thread(target=waited_wake, args=(message,), daemon=True).start()
                else:
                    self._wake(0.0)
            elif isinstance(message, Expose):
                reply(Exposed(message.id, self._metrics.exposition()))


def _hang_up(link: Connection) -> None:
    """End ``link`` both ways: its helper reads the end and stops, and our reader of it
    returns (closing it under a reader that waits in ``recv`` would not wake it)."""
    with (
        contextlib.suppress(OSError, ValueError),
        socket.fromfd(link.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as end,
    ):
        end.shutdown(socket.SHUT_RDWR)


class ControllerLink:
    """A helper's side of its pair: what it asks the controller, and the answers."""

    def __init__(self, link: Connection) -> None:
        self._link = link
        self._sending = threading.Lock()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._answers: dict[int, tuple[threading.Event, list[Woken | Exposed]]] = {}
        self.closed = threading.Event()

    def listen(self, on_close: Callable[[], None]) -> None:
        """Read the controller's answers on a thread; ``on_close`` once the pair closes."""

        def read() -> None:
            try:
                while True:
                    message = self._link.recv()
                    with self._lock:
                        waiting = self._answers.get(message.id)
                    if waiting is not None:
                        waiting[1].append(message)
                        waiting[0].set()
            except (EOFError, OSError):
                pass
            finally:
                self.closed.set()
                with self._lock:
                    for done, _ in self._answers.values():
                        done.set()
                on_close()

        threading.Thread(target=read, name="controller-link", daemon=True).start()

    def push(self, shares: Callable[[], list[Metric]]) -> None:
        """Send ``shares()`` (this process's metrics) every ``PUSH_EVERY_S`` on a thread,
        until the pair closes."""

        def pushing() -> None:
            while not self.closed.wait(PUSH_EVERY_S):
                try:
                    self.send(Families(shares()))
                except OSError:
                    return

        threading.Thread(target=pushing, name="metrics-push", daemon=True).start()

    def send(self, message: Wake | Expose | Families) -> None:
        with self._sending:
            self._link.send(message)

    def _ask(self, make: Callable[[int], Wake | Expose], wait_s: float) -> Woken | Exposed | None:
        done: threading.Event = threading.Event()
        answer: list[Woken | Exposed] = []
        ident = next(self._ids)
        with self._lock:
            self._answers[ident] = (done, answer)
        try:
            if self.closed.is_set():
                return None
            self.send(make(ident))
            done.wait(wait_s)
            return answer[0] if answer else None
        except OSError:
            return None
        finally:
            with self._lock:
                self._answers.pop(ident, None)

    def wake(self, wait_s: float = 0.0) -> bool:
        """The controller's reconciler's ``wake``, from this process."""
        if wait_s <= 0:
            with contextlib.suppress(OSError):
                self.send(Wake(0, 0.0))
            return False
        answer = self._ask(lambda ident: Wake(ident, wait_s), wait_s + 1.0)
        return isinstance(answer, Woken) and answer.ended

    def exposition(self) -> bytes:
        """Every process's metrics, as the controller serves them; ``ConnectionError``
        when it does not answer."""
        answer = self._ask(Expose, EXPOSE_WAIT_S)
        if not isinstance(answer, Exposed):
            raise ConnectionError("the controller's main process did not answer for /metrics")
        return answer.body
