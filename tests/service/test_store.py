"""The rendezvous store: it listens only where it is told, and the controller that
owns it, by starting or by adopting it, ends it.

The stores here are real ``service.store`` processes; a controller that is killed
is a real process running a ``StoreSupervisor``, SIGKILLed.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta

import psutil
import pytest

from service.local_cluster import free_port
from service.settings import ControllerSettings
from service.store import (
    StoreSupervisor,
    find_store_process,
    is_listening,
    listen_socket,
    store_args,
)

DEFAULT_HOST: str = ControllerSettings.model_fields["store_host"].default
TIMEOUT = timedelta(seconds=10)

# A controller, as far as the store is concerned: it supervises the store, prints the
# pid of the store it owns, and waits to be killed.
CONTROLLER = """
import sys, time
from service.store import StoreSupervisor
supervisor = StoreSupervisor(sys.argv[1], int(sys.argv[2]))
supervisor.start()
print(supervisor.owned_pid, flush=True)
time.sleep(600)
"""


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


def _other_addresses() -> list[str]:
    """Addresses of this host that are not the default store host: another loopback
    address (Linux routes all of 127/8 to lo without configuration) and every IPv4
    address of the other interfaces."""
    found = ["127.0.0.2"]
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                found.append(addr.address)
    return found


def _is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # left for init to reap
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def port() -> Iterator[int]:
    """A free port for a store; any store process left on it is killed afterwards."""
    port = free_port()
    yield port
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [])[1:] == store_args(DEFAULT_HOST, port):
            proc.kill()


@pytest.fixture
def run_controller() -> Iterator[Callable[[int], tuple[subprocess.Popen[str], int]]]:
    """Start a controller stand-in for a port; return it and the pid of its store."""
    started: list[subprocess.Popen[str]] = []

    def run(port: int) -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen(
            [sys.executable, "-c", CONTROLLER, DEFAULT_HOST, str(port)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.isdigit(), f"the controller's supervisor owns no store: {line!r}"
        return proc, int(line)

    yield run
    for proc in started:
        with proc:  # closes its output pipe
            proc.kill()


def _kill(controller: subprocess.Popen[str]) -> None:
    controller.send_signal(signal.SIGKILL)
    controller.wait()


def _messages(caplog: pytest.LogCaptureFixture, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


@pytest.mark.parametrize(
    ("host", "reachable", "unreachable"),
    [
        ("127.0.0.1", ["127.0.0.1"], ["127.0.0.2", "::1"]),
        ("localhost", ["127.0.0.1"], ["127.0.0.2"]),
        ("::1", ["::1"], ["127.0.0.1"]),
        ("0.0.0.0", ["127.0.0.1", "127.0.0.2"], []),
        ("", ["127.0.0.1", "127.0.0.2"], []),
        ("::", ["::1", "127.0.0.1", "127.0.0.2"], []),
    ],
)
def test_the_listening_socket_takes_connections_on_its_address_only(
    host: str, reachable: list[str], unreachable: list[str]
) -> None:
    if any(":" in a for a in [host, *reachable, *unreachable]) and not _has_ipv6_loopback():
        pytest.skip("this host has no IPv6 loopback")
    with listen_socket(host, 0) as sock:
        port = sock.getsockname()[1]
        for address in reachable:
            assert is_listening(address, port), address
        for address in unreachable:
            assert not is_listening(address, port), address


def test_a_name_that_does_not_resolve_is_refused() -> None:
    with pytest.raises(OSError):
        listen_socket("no-such-host.invalid", 0)


def test_by_default_the_store_serves_loopback_and_refuses_other_addresses(port: int) -> None:
    import torch.distributed as dist

    supervisor = StoreSupervisor(DEFAULT_HOST, port)
    supervisor.ensure_running()
    try:
        for address in _other_addresses():
            assert not is_listening(address, port), f"the store answers on {address}"

        jobs = [
            dist.PrefixStore(
                f"job-{n}/", dist.TCPStore(DEFAULT_HOST, port, is_master=False, timeout=TIMEOUT)
            )
            for n in (1, 2)
        ]
        jobs[0].set("rank0", "node-a")
        jobs[1].set("rank0", "node-b")
        assert jobs[0].get("rank0") == b"node-a"
        assert jobs[1].get("rank0") == b"node-b"
        assert [jobs[0].add("writer", 1) for _ in range(2)] == [1, 2]
        jobs[1].wait(["rank0"], TIMEOUT)
    finally:
        supervisor.stop()
    assert not is_listening(DEFAULT_HOST, port)


def test_a_store_left_by_a_killed_controller_is_adopted_once_and_ended_by_stop(
    port: int,
    run_controller: Callable[[int], tuple[subprocess.Popen[str], int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="service.store")
    first, store_pid = run_controller(port)
    _kill(first)
    assert is_listening(DEFAULT_HOST, port)  # the store outlived its controller

    restarted = StoreSupervisor(DEFAULT_HOST, port, check_interval_s=3600)
    restarted.start()
    for _ in range(3):  # supervision ticks
        restarted.ensure_running()
    assert restarted.owned_pid == store_pid
    assert len(_messages(caplog, "adopting the rendezvous store")) == 1
    assert not _messages(caplog, "starting the rendezvous store")

    restarted.stop()
    assert _is_gone(store_pid)
    assert find_store_process(DEFAULT_HOST, port) is None
    assert not is_listening(DEFAULT_HOST, port)


def test_the_store_of_a_live_controller_is_used_never_ended_and_taken_over_when_it_dies(
    port: int,
    run_controller: Callable[[int], tuple[subprocess.Popen[str], int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="service.store")
    first, store_pid = run_controller(port)

    visitor = StoreSupervisor(DEFAULT_HOST, port, check_interval_s=3600)
    for _ in range(3):
        visitor.ensure_running()
    assert visitor.owned_pid is None
    assert len(_messages(caplog, "another controller on this host owns")) == 1
    visitor.stop()
    assert is_listening(DEFAULT_HOST, port)
    assert not _is_gone(store_pid)

    second = StoreSupervisor(DEFAULT_HOST, port, check_interval_s=3600)
    second.ensure_running()
    assert second.owned_pid is None
    _kill(first)
    second.ensure_running()  # the next tick after the owner died
    assert second.owned_pid == store_pid
    second.stop()
    assert _is_gone(store_pid)
    assert not is_listening(DEFAULT_HOST, port)


def test_something_else_listening_on_the_port_is_used_but_never_ended(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="service.store")
    with listen_socket(DEFAULT_HOST, 0) as other:
        port = other.getsockname()[1]
        supervisor = StoreSupervisor(DEFAULT_HOST, port, check_interval_s=3600)
        for _ in range(3):
            supervisor.ensure_running()
        assert supervisor.owned_pid is None
        assert len(_messages(caplog, "something other than a rendezvous store")) == 1
        supervisor.stop()
        assert is_listening(DEFAULT_HOST, port)
