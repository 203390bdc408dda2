"""More than one process answering the API (``RELAUNCH_API_PROCESSES``).

One process answers every request on one event loop, and its route threads take the
interpreter lock in turn with that loop: past a few hundred requests a second, a
heartbeat waits for the loop, not for the database. Controllers on one database already
share everything a request needs (jobs, nodes, tokens, rendezvous, the heartbeats'
pace), so more processes on the same port answer the same API.

The controller (the main process) binds the port with ``SO_REUSEPORT``
(``bind_listener``), so that the kernel spreads new connections evenly over the
processes' sockets (processes that accept from one socket share it by who wakes first),
migrates the database and runs the reconciler; its lifespan then starts
``api_processes - 1`` helpers. Each helper is a new interpreter (``python -c``,
``HELPER_MAIN``: ``service.api_helper``) that inherits a socket of its own, bound to the
same port for it, and one end of a socket pair to the controller, over which nothing but
these messages go:

- to the helper: its settings first (``Start``), then answers to what it asked;
- from the helper: wakes of the reconciler (``Wake``: a submit's, a registration's that
  waits up to a second for the pass), which the controller passes to its own reconciler;
  its request metrics every ``PUSH_EVERY_S`` from its event loop (``Families``), which the
  controller adds to its own on ``/metrics``; and a scrape that reached the helper
  (``Expose``), which the controller answers, so that every process serves the same
  ``/metrics``.

A helper dies with the controller (``PR_SET_PDEATHSIG``) and stops once its pair is
closed, so a SIGKILLed controller leaves no process on its port. A helper that exits, or
whose event loop sent nothing for ``SILENCE_ALLOWED_S`` (stuck, or stopped), is killed
and its socket closed, so that the kernel stops giving it connections (those it had
queued are reset, and clients try again); another is started on a new socket after 1 s
(doubling up to 30 s while they keep dying). Signals are the controller's: a helper
ignores SIGINT and SIGTERM, and the controller stops its helpers (closes their pairs, then
SIGKILLs any still running after ``STOP_WAIT_S``) before it stops itself.
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
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from prometheus_client.core import Metric

# A child's first message (settings, log level), and how children are started again.
from service.reconciler_process import Respawns, Start, reap

if TYPE_CHECKING:
    from service.metrics import ControllerMetrics
    from service.settings import ControllerSettings

logger = logging.getLogger(__name__)

PROCESS_NAME = "relaunch-api"  # /proc/PID/comm keeps 15 bytes
STOP_WAIT_S = 10.0  # a stopping helper finishes the requests it has begun within this
PUSH_EVERY_S = 1.0  # how stale a helper's share of /metrics may be
# A helper whose event loop sent nothing this long is taken as stuck (or stopped), killed
# and started again: far longer than a loaded loop's turn, or a garbage collection.
SILENCE_ALLOWED_S = 30.0
# A scrape that reached a helper waits this long for the controller's answer.
EXPOSE_WAIT_S = 10.0
# The helper's command (``service.api_helper.main``); signals are the controller's.
HELPER_MAIN = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "import sys; from service.api_helper import main; main(sys.argv[1:])"
)


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (the first address ``host`` resolves to; port 0:
    a free one) that other sockets of this user may bind too (``SO_REUSEPORT``), not yet
    listening (a server listens once it serves)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return _bind_shared(family, kind, proto, address)


def _bind_like(listener: socket.socket) -> socket.socket:
    """Another socket on ``listener``'s address and port, for a helper."""
    return _bind_shared(listener.family, listener.type, listener.proto, listener.getsockname())


def _bind_shared(family: int, kind: int, proto: int, address: Any) -> socket.socket:
    shared = socket.socket(family, kind, proto)
    try:
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            shared.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        shared.bind(address)
    except BaseException:
        shared.close()
        raise
    return shared


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


class Helper:
    """One running helper as the controller sees it: its process and its end of the pair.
    Writes, the hang-up and the close take one lock, so none of them meets a closed (or
    reused) descriptor."""

    def __init__(self, process: Any, link: Connection) -> None:
        self.process = process  # a ``subprocess.Popen``, or what a test gives
        self.link = link
        self._lock = threading.Lock()
        self._closed = False

    def send(self, message: Start | Woken | Exposed) -> None:
        with self._lock, contextlib.suppress(OSError):  # gone: the reader sees
            if not self._closed:
                self.link.send(message)

    def hang_up(self) -> None:
        """End the pair both ways: the helper reads the end and stops, and the reader of
        it here returns (closing it under a reader that waits would not wake it)."""
        with self._lock:
            if self._closed:
                return
            with (
                contextlib.suppress(OSError, ValueError),
                socket.fromfd(self.link.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as end,
            ):
                end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.link.close()


class ApiProcesses:
    """The controller's side: ``count`` helpers on ``listener``'s port, each started again
    (on a socket of its own) when it exits or goes silent; ``wake`` is the controller's
    reconciler's, ``metrics`` where the helpers' shares are kept and what answers their
    scrapes."""

    def __init__(
        self,
        settings: ControllerSettings,
        listener: socket.socket,
        count: int,
        wake: Callable[[float], bool],
        metrics: ControllerMetrics,
    ) -> None:
        self._settings = settings
        self._listener = listener
        self._wake = wake
        self._metrics = metrics
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._helpers: dict[int, Helper] = {}
        self._threads = [
            threading.Thread(target=self._watch, args=(slot,), name=f"api-{slot}", daemon=True)
            for slot in range(1, count + 1)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Hang up on every helper (it finishes what it has begun and exits), then
        SIGKILL what is still running after ``STOP_WAIT_S``."""
        self._stopping.set()
        with self._lock:
            for helper in self._helpers.values():
                helper.hang_up()
        deadline = time.monotonic() + STOP_WAIT_S + 1
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _watch(self, slot: int) -> None:
        respawns = Respawns(self._stopping)
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                helper = self._spawn()
            except Exception:
                logger.exception(
                    "could not start API process %s; again in %g s", slot, respawns.delay
                )
                respawns.wait()
                continue
            with self._lock:
                self._helpers[slot] = helper
                if self._stopping.is_set():  # ``stop`` came while it started
                    helper.hang_up()
            try:
                self.serve(slot, helper)
            except Exception:
                logger.exception("API process %s: its messages failed; stopping it", slot)
                helper.process.kill()
            finally:
                with self._lock:
                    self._helpers.pop(slot, None)
                helper.close()
                code = reap(helper.process)
                self._metrics.helpers.forget(slot)
            if self._stopping.is_set():
                return
            respawns.ran(began)
            logger.error(
                "API process %s (pid %s) exited (code %s); starting another in %g s",
                slot,
                helper.process.pid,
                code,
                respawns.delay,
            )
            respawns.wait()

    def _spawn(self) -> Helper:
        # A socket of its own: when the helper exits, its last copy closes and the kernel
        # gives the port's connections to the others only.
        listener = _bind_like(self._listener)
        mine, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
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
            listener.close()
            theirs.close()
        helper = Helper(process, Connection(mine.detach()))
        try:
            if not self._stopping.is_set():  # else it reads the end and exits
                helper.link.send(Start(self._settings, logging.getLogger().getEffectiveLevel()))
        except OSError:
            pass  # it died at once: ``serve`` reads the end of its pair
        except BaseException:
            process.kill()
            reap(process)
            helper.close()
            raise
        logger.info("API process running as %s", process.pid)
        return helper

    def serve(self, slot: int, helper: Helper) -> None:
        """Answer one helper until its pair closes (it exited, or ``stop``), or kill it
        once it has been silent for ``SILENCE_ALLOWED_S``. Only reads here: what waits
        (a wake that waits, a scrape that reads the database) is answered on a thread."""
        while True:
            try:
                if not helper.link.poll(SILENCE_ALLOWED_S):
                    logger.error(
                        "API process %s (pid %s) sent nothing for %g s (stuck or stopped); "
                        "killing it",
                        slot,
                        helper.process.pid,
                        SILENCE_ALLOWED_S,
                    )
                    helper.process.kill()
                    return
                message = helper.link.recv()
            except (EOFError, OSError):
                return
            if isinstance(message, Families):
                self._metrics.helpers.update(slot, message.metrics)
            elif isinstance(message, Wake) and message.wait_s <= 0:
                self._wake(0.0)
            elif isinstance(message, (Wake, Expose)):
                threading.Thread(target=self._answer, args=(helper, message), daemon=True).start()

    def _answer(self, helper: Helper, asked: Wake | Expose) -> None:
        if isinstance(asked, Wake):
            helper.send(Woken(asked.id, self._wake(asked.wait_s)))
        else:
            helper.send(Exposed(asked.id, self._metrics.exposition()))


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

    async def push(self, shares: Callable[[], list[Metric]]) -> None:
        """Send ``shares()`` (this process's metrics) every ``PUSH_EVERY_S`` until the
        pair closes. Run on the event loop, so that a loop that stops turning stops them,
        and the controller takes this process as stuck; sent on a thread of its own."""
        sender = anyio.CapacityLimiter(1)
        while not self.closed.is_set():
            await anyio.sleep(PUSH_EVERY_S)
            families = Families(shares())
            try:
                await anyio.to_thread.run_sync(self.send, families, limiter=sender)
            except OSError:
                return

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
