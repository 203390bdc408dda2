"""The reconciler in a child process of the controller.

A pass reads a thousand nodes and their attempts into Python objects and plans over
them, holding the interpreter lock for most of that; on a thread of the API's process
every heartbeat and report waits behind it. In a process of its own it competes with
the API only for a core.

The child is started with ``spawn`` (a fresh interpreter: the API's process has threads
and open connections that a fork would copy), holds its own pool of connections, and
dies with the controller (``PR_SET_PDEATHSIG``): a SIGKILLed controller leaves no
reconciler behind to keep acting on its lease. What crosses between the two:

- ``PassSignals``, shared: a submit or a registration wakes the loop, and a
  registration waits for the pass that sees it, as on a thread;
- the child's metrics, sent after every pass and served on the controller's
  ``/metrics`` as last received (``service.metrics.Relayed``).

A child that dies while the controller runs is started again (after 1 s, doubling up to
30 s while it keeps dying), with new signals: one killed while it held their lock would
otherwise leave it held.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from prometheus_client import CollectorRegistry

from contract.prctl import set_parent_death_signal, set_process_name
from service.db import make_engine, make_session_factory
from service.metrics import ReconcilerMetrics, Relayed
from service.passes import PassSignals
from service.reconciler import Reconciler
from service.settings import RESERVED_CONNECTIONS, ControllerSettings

logger = logging.getLogger(__name__)

PROCESS_NAME = "relaunch-recon"  # /proc/PID/comm keeps 15 bytes
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
RESPAWN_FIRST_S = 1.0
RESPAWN_MAX_S = 30.0
# A child that ran this long before it died starts again after RESPAWN_FIRST_S.
RESPAWN_RESET_AFTER_S = 60.0
STOP_WAIT_S = 15.0


def serve(
    settings: ControllerSettings,
    signals: PassSignals,
    metrics_out: Connection,
    parent: int,
    log_level: int,
) -> None:
    """The child's whole life: the reconciler's loop until the controller stops it, then
    hand back the lease. Runs in the child (the target of ``ReconcilerProcess``)."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the controller died before the line above
        return
    set_process_name(PROCESS_NAME)
    # A terminal's Ctrl-C, or a service manager's SIGTERM to every process of the
    # controller, is the controller's to handle: it stops this loop through ``signals``.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    engine = make_engine(settings.db_url, RESERVED_CONNECTIONS)
    registry = CollectorRegistry()

    def send_metrics() -> None:
        try:
            metrics_out.send(list(registry.collect()))
        except (BrokenPipeError, ConnectionResetError):  # the controller is going away
            signals.stop.set()

    reconciler = Reconciler(
        make_session_factory(engine),
        settings,
        metrics=ReconcilerMetrics(registry),
        signals=signals,
        after_pass=send_metrics,
    )
    try:
        reconciler.loop()
    finally:
        reconciler.stop()  # hands the lease back, so a standby takes over at once
        engine.dispose()


class ReconcilerProcess:
    """Runs the reconciler in a child process, started again if it dies; ``wake`` and
    ``stop`` as ``Reconciler``'s."""

    def __init__(self, settings: ControllerSettings, relayed: Relayed) -> None:
        self._settings = settings
        self._relayed = relayed
        self._context = multiprocessing.get_context("spawn")
        self._signals = PassSignals.across_processes(self._context)
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._process: BaseProcess | None = None
        self._watcher: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The child's pid while one runs."""
        process = self._process
        return process.pid if process is not None and process.is_alive() else None

    def start(self) -> None:
        # The watcher starts every child: the kernel's parent-death signal follows the
        # thread that forked, so that thread must live as long as the controller.
        self._watcher = threading.Thread(target=self._watch, name="reconciler-watch", daemon=True)
        self._watcher.start()
        self._started.wait(STOP_WAIT_S)

    def wake(self, wait_s: float = 0.0) -> bool:
        return self._signals.wake(wait_s)

    def stop(self) -> None:
        """Stop the child's loop (it hands the lease back), and wait for it to exit."""
        self._stopping.set()
        self._signals.request_stop()
        process = self._process
        if process is not None:
            process.join(STOP_WAIT_S)
            if process.is_alive():
                logger.warning(
                    "the reconciler process did not stop in %g s; killing it", STOP_WAIT_S
                )
                process.kill()
                process.join()
        if self._watcher is not None:
            self._watcher.join(STOP_WAIT_S)

    def _spawn(self) -> Connection:
        receive, send = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=serve,
            args=(
                self._settings,
                self._signals,
                send,
                os.getpid(),
                logging.getLogger().getEffectiveLevel(),
            ),
            name="reconciler",
            daemon=True,
        )
        process.start()
        send.close()  # the child holds the other end: its exit ends ``recv`` here
        self._process = process
        logger.info("reconciler running in process %s", process.pid)
        return receive

    def _watch(self) -> None:
        delay = RESPAWN_FIRST_S
        while not self._stopping.is_set():
            began = time.monotonic()
            receive = self._spawn()
            self._started.set()
            try:
                while True:
                    self._relayed.update(receive.recv())
            except (EOFError, OSError):
                pass
            finally:
                receive.close()
            process = self._process
            assert process is not None
            process.join()
            self._relayed.update([])
            if self._stopping.is_set():
                return
            if time.monotonic() - began > RESPAWN_RESET_AFTER_S:
                delay = RESPAWN_FIRST_S
            logger.error(
                "the reconciler process %s exited (code %s); starting another in %g s",
                process.pid,
                process.exitcode,
                delay,
            )
            self._stopping.wait(delay)
            delay = min(delay * 2, RESPAWN_MAX_S)
            # A child killed while it held the signals' lock left it held: new ones.
            self._signals = PassSignals.across_processes(self._context)
