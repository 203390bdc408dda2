"""The c10d rendezvous store, hosted by the controller's side, never by a node.

One multi-tenant ``TCPStore`` serves every job (c10d rendezvous prefixes its
keys with the rendezvous id). It runs in its own process, started in its own
session so that a controller that crashes or is killed does not take it down:
running jobs keep their rendezvous state, and the restarted controller adopts
the store it finds listening on the port. Nodes connect with ``is_host=false``,
so no worker node is a single point of failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

logger = logging.getLogger(__name__)


def connect_host(listen_host: str) -> str:
    """Where a process on this host dials a server that listens on ``listen_host``:
    loopback for a wildcard address, else the address itself."""
    return "127.0.0.1" if listen_host in ("0.0.0.0", "::", "") else listen_host


def is_listening(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class StoreSupervisor:
    """Keeps one store process listening on ``host:port``; restarts it if it dies."""

    def __init__(self, host: str, port: int, check_interval_s: float = 2.0) -> None:
        self.host, self.port = host, port
        self._interval = check_interval_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ensure_running(self, timeout_s: float = 60.0) -> None:
        if is_listening(self._connect_host, self.port):
            if self._proc is None:
                logger.info("adopting the rendezvous store on %s:%s", self.host, self.port)
            return
        logger.info("starting the rendezvous store on %s:%s", self.host, self.port)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "service.store", "--host", self.host, "--port", str(self.port)],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while not is_listening(self._connect_host, self.port):
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"rendezvous store exited with {self._proc.returncode}; "
                    f"is port {self.port} taken?"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"rendezvous store did not listen within {timeout_s} s")
            time.sleep(0.1)

    @property
    def _connect_host(self) -> str:
        return connect_host(self.host)

    def start(self) -> None:
        self.ensure_running()
        self._thread = threading.Thread(target=self._watch, name="store-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.ensure_running()
            except RuntimeError:
                logger.exception("rendezvous store could not be restarted")

    def stop(self) -> None:
        """Stop watching, and end the store process if this supervisor started it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def serve(host: str, port: int) -> None:
    """Host the store until SIGTERM or SIGINT."""
    import torch.distributed as dist

    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    logger.info("rendezvous store listening on %s:%s (pid %s)", host, port, os.getpid())
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    del store


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="relaunch rendezvous store")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s store %(message)s")
    serve(args.host, args.port)


if __name__ == "__main__":
    main()
