"""The reconciler in a child process of the controller.

A pass reads a thousand nodes and their attempts into Python objects and plans over
them, holding the interpreter lock for most of that; on a thread of the API's process
every heartbeat and report waits behind it. In a process of its own it competes with
the API only for a core.

The child is a new interpreter (``python -c``, ``CHILD_MAIN``: the API's
process has threads and open connections that a fork would copy) with its own pool of
connections. It dies with the controller (``PR_SET_PDEATHSIG``), so a SIGKILLed
controller leaves no reconciler acting on its lease. Two pipes join them, and nothing
else is shared, so a child that dies at any moment leaves no lock held:

- to the child: its settings, then wakes (``Wake``), each with the tickets of the
  callers that wait for the pass it starts (a registration's answer does); closing it
  stops the child, which hands the lease back;
- from the child: after every pass, the tickets that pass answers and the child's
  metrics (``Passed``), served on the controller's ``/metrics`` as last received
  (``service.metrics.Relayed``).

A child that dies while the controller runs is started again (after 1 s, doubling up to
30 s while it keeps dying); callers waiting on it give up after their own timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from contract.logs import LOG_FORMAT
from contract.prctl import set_parent_death_signal, set_process_name
from service.db import make_engine, make_session_factory
from service.gc_pauses import collect_young_after, freeze_what_started
from service.metrics import ReconcilerMetrics, Relayed
from service.passes import PassSignals
from service.reconciler import Reconciler
from service.settings import RESERVED_CONNECTIONS, ControllerSettings

logger = logging.getLogger(__name__)

PROCESS_NAME = "relaunch-recon"  # /proc/PID/comm keeps 15 bytes
RESPAWN_FIRST_S = 1.0
RESPAWN_MAX_S = 30.0
# A child that ran this long before it died is started again after RESPAWN_FIRST_S.
RESPAWN_RESET_AFTER_S = 60.0
STOP_WAIT_S = 10.0
# A child silent this long (no pass ended, leading or not) is taken as stuck and killed:
# at least this, and at least this many leases.
SILENCE_ALLOWED_MIN_S = 60.0
SILENCE_ALLOWED_LEASES = 6
# The child's command: this module imported (not run as __main__, so that the messages'
# classes pickle under the names the controller knows them by), then ``main``.
# A terminal's Ctrl-C, or a service manager's SIGTERM to every process of the controller,
# is the controller's to handle (it stops the child by closing the pipe): ignored from the
# child's first line, before its imports.
CHILD_MAIN = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "import sys; from service.reconciler_process import main; main(sys.argv[1:])"
)


class Respawns:
    """When a child process that died is started again: after ``RESPAWN_FIRST_S``,
    doubling up to ``RESPAWN_MAX_S`` while children keep dying, and after the first again
    once one ran ``RESPAWN_RESET_AFTER_S``."""

    def __init__(self, stopping: threading.Event) -> None:
        self._stopping = stopping
        self.delay = RESPAWN_FIRST_S  # the next wait

    def ran(self, began: float) -> None:
        """The child started at ``began`` (``time.monotonic``) has exited."""
        if time.monotonic() - began > RESPAWN_RESET_AFTER_S:
            self.delay = RESPAWN_FIRST_S

    def wait(self) -> None:
        """Wait ``delay`` (less if stopping), and double the next."""
        self._stopping.wait(self.delay)
        self.delay = min(self.delay * 2, RESPAWN_MAX_S)


def reap(child: subprocess.Popen[bytes]) -> int:
    """``child``'s exit status, once it has exited; SIGKILLed after ``STOP_WAIT_S``."""
    try:
        return child.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def silence_allowed(settings: ControllerSettings) -> float:
    """How long the controller waits for its child's next pass before it kills it: a pass
    and the rest after it (at most a third of a lease) end well within this."""
    return max(SILENCE_ALLOWED_MIN_S, SILENCE_ALLOWED_LEASES * settings.leader_lease_s)


@dataclass(frozen=True)
class Start:
    """The controller's first message to its child."""

    settings: ControllerSettings
    log_level: int


@dataclass(frozen=True)
class Wake:
    """Begin a pass; ``tickets``: callers that wait for it to end."""

    tickets: tuple[int, ...]


@dataclass(frozen=True)
class Passed:
    """A pass has ended: the tickets it answers, and the child's metrics after it."""

    tickets: list[int]
    metrics: list[Metric]


def main(argv: list[str]) -> None:
    """The child (``CHILD_MAIN``), with the arguments FROM_FD TO_FD PARENT_PID."""
    from_controller, to_controller, parent = (int(a) for a in argv)
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the controller died before the line above
        return
    set_process_name(PROCESS_NAME)
    inbox = Connection(from_controller, writable=False)
    outbox = Connection(to_controller, readable=False)
    try:
        start: Start = inbox.recv()
    except EOFError:  # the controller stopped as this child started
        return
    logging.basicConfig(level=start.log_level, format=LOG_FORMAT)
    lower_nice(start.settings.reconciler_nice)  # before any thread: each takes its own
    serve(start.settings, inbox, outbox)


def lower_nice(by: int) -> None:
    """Add ``by`` (0 or less) to this thread's nice value, as threads started after it
    inherit it. Without the right to (CAP_SYS_NICE), go as low as ``RLIMIT_NICE`` lets an
    unprivileged process (systemd's ``LimitNICE``, compose's ``ulimits: nice``), or keep
    it; say so either way."""
    if by == 0:
        return
    before = os.getpriority(os.PRIO_PROCESS, 0)
    wanted = max(-20, before + by)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, wanted)
        return
    except OSError as exc:
        refused = exc.strerror
    floor = nice_floor()
    if before > floor > wanted:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, floor)
            logger.warning(
                "the reconciler process runs at nice %d, not %d: RLIMIT_NICE allows no lower "
                "without CAP_SYS_NICE",
                floor,
                wanted,
            )
            return
    logger.warning(
        "the reconciler process keeps nice %d: lowering it by %d needs CAP_SYS_NICE or a "
        "higher RLIMIT_NICE (%s)",
        before,
        -by,
        refused,
    )


def nice_floor() -> int:
    """The lowest nice value ``RLIMIT_NICE`` lets this process set without CAP_SYS_NICE:
    20 less the limit (Linux's ``setrlimit(2)``), so 20 (none lower) at the usual limit of 0."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY:
        return -20
    return max(-20, 20 - soft)


def serve(settings: ControllerSettings, inbox: Connection, outbox: Connection) -> None:
    """The reconciler's loop until the controller closes ``inbox``, then hand back the
    lease."""
    signals = PassSignals()
    listener = threading.Thread(target=_listen, args=(inbox, signals), name="wakes", daemon=True)
    listener.start()
    engine = make_engine(settings.db_url, RESERVED_CONNECTIONS, settings.database_ping_after_idle_s)
    registry = CollectorRegistry()

    def after_pass(tickets: list[int]) -> None:
        try:
            outbox.send(Passed(tickets, list(registry.collect())))
        except OSError:  # the controller is gone
            signals.request_stop()

    reconciler = Reconciler(
        make_session_factory(engine),
        settings,
        metrics=ReconcilerMetrics(registry),
        signals=signals,
        after_pass=after_pass,
    )
    if settings.gc_freeze:
        freeze_what_started()
    collect_young_after(settings.gc_young_threshold)
    try:
        reconciler.loop()
    finally:
        reconciler.stop()  # hands the lease back, so a standby takes over at once
        engine.dispose()


def _listen(inbox: Connection, signals: PassSignals) -> None:
    """Pass the controller's wakes on to the loop; stop it once the controller closes."""
    try:
        while True:
            wake: Wake = inbox.recv()
            signals.ask(wake.tickets, waiting=bool(wake.tickets))
    except (EOFError, OSError):
        pass
    signals.request_stop()


def _read_passes(inbox: Connection, heard: queue.Queue[Passed | None]) -> None:
    """Put each ``Passed`` the child sends on ``heard``, then None once it closes its end
    or sends what cannot be read."""
    try:
        while True:
            heard.put(inbox.recv())
    except (EOFError, OSError):
        pass
    except Exception:
        logger.exception("unreadable message from the reconciler process")
    heard.put(None)


class ReconcilerProcess:
    """Runs the reconciler in a child process, started again if it dies; ``wake`` and
    ``stop`` as ``Reconciler``'s."""

    def __init__(self, settings: ControllerSettings, relayed: Relayed) -> None:
        self._settings = settings
        self._relayed = relayed
        self._tickets = itertools.count(1)
        self._lock = threading.Lock()  # guards the fields below
        self._waiting: dict[int, threading.Event] = {}  # callers waiting for a pass
        self._unsent: list[int] = []  # their tickets, not yet sent
        self._wake_unsent = False
        self._child: subprocess.Popen[bytes] | None = None
        self._outbox: Connection | None = None
        # Held while sending to the child, and to close its pipe (never both at once).
        self._send_lock = threading.Lock()
        self._to_send = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def pid(self) -> int | None:
        """The child's pid while one runs."""
        child = self._child
        return child.pid if child is not None and child.poll() is None else None

    def start(self) -> None:
        # The watcher starts every child: the kernel's parent-death signal follows the
        # thread that forked, so that thread must live as long as the controller.
        self._threads = [
            threading.Thread(target=self._watch, name="reconciler-watch", daemon=True),
            threading.Thread(target=self._send, name="reconciler-wakes", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def wake(self, wait_s: float = 0.0) -> bool:
        """As ``PassSignals.wake``: never blocks on the child; a wake sent while no child
        runs is lost, and the next child's first pass comes at once anyway."""
        done = threading.Event() if wait_s > 0 else None
        with self._lock:
            self._wake_unsent = True
            if done is not None:
                ticket = next(self._tickets)
                self._waiting[ticket] = done
                self._unsent.append(ticket)
        self._to_send.set()
        if done is None:
            return False
        try:
            return done.wait(wait_s)
        finally:
            with self._lock:
                self._waiting.pop(ticket, None)

    def stop(self) -> None:
        """Close the child's pipe (its loop ends and hands the lease back) and wait for it
        to exit; kill it after ``STOP_WAIT_S``."""
        self._stopping.set()
        self._to_send.set()
        self._close_outbox()
        deadline = time.monotonic() + STOP_WAIT_S
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        child = self._child
        if child is not None and child.poll() is None:
            logger.warning("the reconciler process did not stop in %g s; killed", STOP_WAIT_S)
            child.kill()
            child.wait()

    def _close_outbox(self) -> None:
        with self._lock:
            outbox, self._outbox = self._outbox, None
        if outbox is None:
            return
        # A send under way finishes first; one stuck (a stopped child) keeps the pipe open,
        # and the child is killed instead.
        if self._send_lock.acquire(timeout=1.0):
            try:
                outbox.close()
            finally:
                self._send_lock.release()

    def _send(self) -> None:
        """Send wakes as they come, those that came meanwhile in one message."""
        while not self._stopping.is_set():
            self._to_send.wait()
            self._to_send.clear()
            with self._lock:
                if not self._wake_unsent or self._outbox is None:
                    continue
                outbox, wake = self._outbox, Wake(tuple(self._unsent))
                self._unsent, self._wake_unsent = [], False
            with self._send_lock, contextlib.suppress(OSError):  # gone: the watcher sees
                outbox.send(wake)

    def _spawn(self) -> tuple[subprocess.Popen[bytes], Connection]:
        from_controller, to_child = os.pipe()  # each (read end, write end)
        from_child, to_controller = os.pipe()
        try:
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-P",  # nothing imported from the working directory
                    "-c",
                    CHILD_MAIN,
                    str(from_controller),
                    str(to_controller),
                    str(os.getpid()),
                ],
                pass_fds=(from_controller, to_controller),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (to_child, from_child):
                os.close(fd)
            raise
        finally:
            os.close(from_controller)
            os.close(to_controller)
        outbox = Connection(to_child, readable=False)
        inbox = Connection(from_child, writable=False)
        try:
            with contextlib.suppress(OSError):  # it died at once: the watcher sees
                outbox.send(Start(self._settings, logging.getLogger().getEffectiveLevel()))
        except BaseException:
            child.kill()
            child.wait()
            outbox.close()
            inbox.close()
            raise
        with self._lock:
            self._child, self._outbox = child, outbox
        if self._stopping.is_set():  # ``stop`` came while this one started
            self._close_outbox()
        self._to_send.set()  # wakes that came while no child ran: its first pass answers them
        logger.info("reconciler running in process %s", child.pid)
        return child, inbox

    def _watch(self) -> None:
        respawns = Respawns(self._stopping)
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                child, inbox = self._spawn()
            except Exception:
                logger.exception(
                    "could not start the reconciler process; again in %g s", respawns.delay
                )
                respawns.wait()
                continue
            self._hear(inbox, child)
            self._close_outbox()
            code = reap(child)
            self._relayed.not_leading()
            if self._stopping.is_set():
                return
            respawns.ran(began)
            logger.error(
                "the reconciler process %s exited (code %s); starting another in %g s",
                child.pid,
                code,
                respawns.delay,
            )
            respawns.wait()

    def _hear(self, inbox: Connection, child: subprocess.Popen[bytes]) -> None:
        """Read the child's passes until it closes its end (exits), or kill it once it has
        been silent for ``silence_allowed``: stuck (in a statement that never returns, or
        stopped), it would hold the lease it renews no longer, and ``/metrics`` would
        keep saying it leads. The reading is a thread's (``_read_passes``): a child
        stopped part-way through writing a message would hold a read here for ever."""
        silent_s = silence_allowed(self._settings)
        heard: queue.Queue[Passed | None] = queue.Queue()
        reader = threading.Thread(
            target=_read_passes, args=(inbox, heard), name="reconciler-inbox", daemon=True
        )
        reader.start()
        try:
            while True:
                try:
                    passed = heard.get(timeout=silent_s)
                except queue.Empty:
                    logger.error(
                        "the reconciler process %s ended no pass in %g s (stuck or stopped); "
                        "killing it",
                        child.pid,
                        silent_s,
                    )
                    child.kill()
                    return
                if passed is None:  # it closed its end, or sent what cannot be read
                    return
                self._relayed.update(passed.metrics)
                with self._lock:
                    answered = [self._waiting.get(t) for t in passed.tickets]
                for done in answered:
                    if done is not None:
                        done.set()
        finally:
            # Its end closes when it exits: a killed child's at once. One that lives on
            # (it sent what cannot be read) is reaped next, killed if it does not stop.
            reader.join(STOP_WAIT_S)
            if not reader.is_alive():
                inbox.close()
