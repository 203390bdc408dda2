"""A real controller and two real node agents, as separate processes, per test module."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.client import RelaunchClient
from service.demo import LocalCluster, free_port

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    data = tmp_path_factory.mktemp("cluster")
    c = LocalCluster(data_dir=data, port=free_port(), store_port=free_port())
    try:
        c.start_controller()
        c.start_agent("node-a")
        c.start_agent("node-b")
        c.wait_nodes(2)
        yield c
    finally:
        c.stop_all()
        _dump_logs(data)


def _dump_logs(data: Path) -> None:
    """Keep the processes' logs visible in a failing run's output."""
    for log in sorted(data.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-40:]
        print(f"----- {log.name} -----\n" + "\n".join(tail))


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[RelaunchClient]:
    with RelaunchClient(cluster.url) as c:
        yield c


def wait_for(
    predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.3
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def wait_terminal(client: RelaunchClient, job_id: int, timeout_s: float = 240) -> dict[str, Any]:
    job: dict[str, Any] = wait_for(
        lambda: (j := client.job(job_id))["state"] in TERMINAL and j,
        timeout_s,
        f"job {job_id} to end",
    )
    return job


def wait_no_processes(cluster: LocalCluster, job_id: int, timeout_s: float = 15) -> None:
    wait_for(lambda: not cluster.job_processes(job_id), timeout_s, f"no process of job {job_id}")
