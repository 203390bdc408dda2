"""The c10d rendezvous store, hosted by the controller's side, never by a node.

One multi-tenant ``TCPStore`` serves every job (c10d rendezvous prefixes its
keys with the rendezvous id). It runs in its own process, started in its own
session so that a controller that crashes or is killed does not take it down:
running jobs keep their rendezvous state, and the restarted controller adopts
the store it finds listening on the port. Nodes connect with ``is_host=false``,
so no worker node is a single point of failure.

The store listens on exactly the configured address. ``TCPStore`` binds every
interface whatever host it is given, so the store binds its listening socket
itself and hands it over.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import psutil

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def connect_host(listen_host: str) -> str:
    """Where a process on this host dials a server that listens on ``listen_host``:
    loopback for a wildcard address, else the address itself."""
    return "127.0.0.1" if listen_host in WILDCARD_HOSTS else listen_host


def is_listening(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` and nowhere else.

    ``host`` is an IPv4 or IPv6 address or a name, which is bound to the first
    address it resolves to. The wildcards ``0.0.0.0`` (or ``""``) and ``::`` mean
    every IPv4 address, and every address of both families. Raises ``OSError``
    when the name does not resolve or the address cannot be bound.
    """
    infos = socket.getaddrinfo(
        host or "0.0.0.0", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(host != "::"))
        sock.bind(address)
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def store_args(host: str, port: int) -> list[str]:
    """The command line of the store for ``host:port``, after the interpreter."""
    return ["-m", "service.store", "--host", host, "--port", str(port)]


def find_store_process(host: str, port: int) -> psutil.Process | None:
    """The store process serving ``host:port``: its command line names exactly this
    address and port, and it holds a listening socket on the port. None if there is
    none, or if it belongs to a user this process may not inspect."""
    args = store_args(host, port)
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [])[1:] != args:
            continue
        try:
            sockets = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        if any(s.status == psutil.CONN_LISTEN and s.laddr.port == port for s in sockets):
            return proc
    return None


def end_process(proc: psutil.Process, grace_s: float = 5.0) -> None:
    """SIGTERM ``proc``, SIGKILL it after ``grace_s``; psutil refuses a reused pid."""
    try:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except psutil.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)
    except psutil.NoSuchProcess:
        pass


def claim_store(host: str, port: int) -> socket.socket | None:
    """Claim the ownership of the store on ``host:port``; None if a live process
    holds the claim.

    The claim is an abstract Unix socket name (Linux): the kernel drops it when its
    holder exits, SIGKILL included, and it is scoped like the TCP port, to one
    network namespace. Closing the socket gives the claim up.
    """
    digest = hashlib.sha256(f"{host}:{port}".encode()).hexdigest()[:16]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0relaunch-store-{port}-{digest}")
    except OSError:
        sock.close()
        return None
    return sock


class StoreSupervisor:
    """Keeps one store process listening on ``host:port``; restarts it if it dies.

    The supervisor that holds the claim on ``host:port`` (``claim_store``) owns the
    store: it starts one when none listens, adopts the one a killed owner left
    behind, and ends it in ``stop()``. Without the claim (another live controller
    on this host uses the same store address) it uses that controller's store,
    never ends it, and takes it over once that controller is gone. Something other
    than a store listening on the port is used as it is and never ended.
    """

    def __init__(self, host: str, port: int, check_interval_s: float = 2.0) -> None:
        self.host, self.port = host, port
        self._interval = check_interval_s
        self._claim: socket.socket | None = None
        self._store: psutil.Process | None = None  # owned: started or adopted
        self._child: subprocess.Popen[bytes] | None = None  # the store, if started here
        self._reported: str | None = None  # the last "not ours" finding, logged once
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def _connect_host(self) -> str:
        return connect_host(self.host)

    @property
    def owned_pid(self) -> int | None:
        """The pid of the store this supervisor owns and ends in ``stop()``."""
        return self._store.pid if self._store is not None else None

    def ensure_running(self, timeout_s: float = 60.0) -> None:
        """Make sure a store listens; start one if none does and this supervisor may.

        Raises ``RuntimeError`` if a store it started exits or does not listen
        within ``timeout_s``, or if another controller holds the claim and nothing
        listens for that long.
        """
        with self._lock:
            deadline = time.monotonic() + timeout_s
            while not self._stop.is_set():
                if is_listening(self._connect_host, self.port):
                    self._account_for_listener()
                    return
                if self._store_is_alive():
                    logger.warning(
                        "the rendezvous store (pid %s) does not answer on %s:%s",
                        self.owned_pid,
                        self.host,
                        self.port,
                    )
                    return
                if self._holds_claim():
                    self._start(deadline)
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"another controller owns the rendezvous store on {self.host}:"
                        f"{self.port}, and nothing listens there"
                    )
                self._stop.wait(0.1)

    def _holds_claim(self) -> bool:
        if self._claim is None:
            self._claim = claim_store(self.host, self.port)
        return self._claim is not None

    def _store_is_alive(self) -> bool:
        if self._store is None:
            return False
        if self._child is not None:
            self._child.poll()  # reaps a store started here that has exited
        try:
            return self._store.is_running() and self._store.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _account_for_listener(self) -> None:
        """Something listens on the store's address: ours, or adopt it if we may."""
        if self._store_is_alive():
            return
        self._store = self._child = None  # an owned store, if any, has exited
        if not self._holds_claim():
            self._report_once("another controller on this host owns the rendezvous store")
            return
        found = find_store_process(self.host, self.port)
        if found is None:
            self._report_once("something other than a rendezvous store listens")
            return
        logger.info(
            "adopting the rendezvous store on %s:%s (pid %s)", self.host, self.port, found.pid
        )
        self._store, self._child, self._reported = found, None, None

    def _report_once(self, finding: str) -> None:
        if self._reported != finding:
            logger.warning("%s on %s:%s; using it as it is", finding, self.host, self.port)
            self._reported = finding

    def _start(self, deadline: float) -> None:
        logger.info("starting the rendezvous store on %s:%s", self.host, self.port)
        child = subprocess.Popen(
            [sys.executable, *store_args(self.host, self.port)],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        self._child, self._store, self._reported = child, psutil.Process(child.pid), None
        while not is_listening(self._connect_host, self.port):
            if child.poll() is not None:
                raise RuntimeError(
                    f"rendezvous store exited with {child.returncode}; "
                    f"is {self.host}:{self.port} taken?"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"rendezvous store did not listen on {self.host}:{self.port}")
            if self._stop.wait(0.1):
                return

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
        """Stop watching, end the store this supervisor owns (started or adopted),
        then give up the claim."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._store is not None:
                logger.info(
                    "stopping the rendezvous store on %s:%s (pid %s)",
                    self.host,
                    self.port,
                    self._store.pid,
                )
                end_process(self._store)
            if self._child is not None:
                self._child.poll()  # already reaped; records its exit status
            self._store = self._child = None
            if self._claim is not None:
                self._claim.close()
                self._claim = None


def serve(host: str, port: int) -> None:
    """Host the store on exactly ``host:port`` until SIGTERM or SIGINT.

    Raises ``OSError`` if that address cannot be listened on."""
    import torch.distributed as dist

    listener = listen_socket(host, port)
    address, bound_port = listener.getsockname()[:2]
    store = dist.TCPStore(
        connect_host(host),  # the server's own client dials it here
        port,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
        master_listen_fd=listener.detach(),  # the store owns and closes it
    )
    shown = f"[{address}]" if ":" in address else address
    logger.info("rendezvous store listening on %s:%s (pid %s)", shown, bound_port, os.getpid())
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
    try:
        serve(args.host, args.port)
    except OSError as exc:
        parser.exit(1, f"rendezvous store cannot listen on {args.host}:{args.port}: {exc}\n")


if __name__ == "__main__":
    main()
