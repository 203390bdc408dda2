"""A real controller answering its API on three processes (``RELAUNCH_API_PROCESSES=3``):
connections are spread over all of them, each answers the whole API, a registration
through any of them waits for the controller's reconciler, ``/metrics`` adds up every
process from any of them, and no process outlives the controller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from contract.protocol import Heartbeat, NodeRegister
from service.api_processes import PROCESS_NAME
from service.local_cluster import LocalCluster, free_port
from worker.client import ControllerClient

pytestmark = pytest.mark.e2e

PROCESSES = 3
METRICS_TOKEN = "scrape-" + "x" * 32
CONNECTIONS = 30  # each to one of three processes: all three get some (1 - 3e-5)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    (tmp_path / "controller").mkdir(mode=0o700)
    cluster = LocalCluster(data_dir=tmp_path / "controller", port=free_port())
    try:
        cluster.start_controller(
            {
                "RELAUNCH_API_PROCESSES": str(PROCESSES),
                "RELAUNCH_METRICS_TOKEN": METRICS_TOKEN,
            }
        )
        # Two helpers import and start at once on what may be a busy machine.
        until(lambda: scraped(cluster).get("relaunch_api_processes") == PROCESSES, 90.0)
        yield cluster
    finally:
        cluster.stop_all()


def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Until ``condition()``; a request in it that fails counts as not yet (a connection
    the kernel gave a helper that has just been killed is reset)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except (httpx.TransportError, httpx.HTTPStatusError):
            pass
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.1)


def scraped(cluster: LocalCluster, client: httpx.Client | None = None) -> dict[str, float]:
    """The samples of ``/metrics`` without labels, and the count of GETs of the nodes'
    list, over a new connection unless ``client`` is given."""
    headers = {"authorization": f"Bearer {METRICS_TOKEN}"}
    if client is None:
        response = httpx.get(f"{cluster.url}/metrics", headers=headers, timeout=10)
    else:
        response = client.get("/metrics", headers=headers)
    response.raise_for_status()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if not sample.labels:
                found[sample.name] = sample.value
            elif sample.name == "relaunch_http_request_seconds_count" and sample.labels == {
                "route": "/api/v1/nodes",
                "method": "GET",
                "status": "2xx",
            }:
                found["nodes_listed"] = sample.value
    return found


def processes(cluster: LocalCluster) -> tuple[psutil.Process, list[psutil.Process]]:
    """The controller's process and its API helpers."""
    main = psutil.Process(cluster.procs["controller"].pid)
    helpers = [c for c in main.children() if c.name() == PROCESS_NAME]
    return main, helpers


def serving(process: psutil.Process, port: int) -> int:
    """How many connections to ``port`` ``process`` holds open."""
    return sum(
        1
        for c in process.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def test_every_process_answers_and_metrics_add_up_from_any_of_them(
    cluster: LocalCluster,
) -> None:
    main, helpers = processes(cluster)
    assert len(helpers) == PROCESSES - 1
    admin = {"authorization": f"Bearer {cluster.admin_token}"}
    clients = [httpx.Client(base_url=cluster.url, timeout=10) for _ in range(CONNECTIONS)]
    try:
        for client in clients:
            response = client.get("/api/v1/nodes", headers=admin)
            assert response.status_code == 200, response.text
        held = {p.pid: serving(p, cluster.port) for p in (main, *helpers)}
        assert sum(held.values()) == CONNECTIONS
        assert all(held.values()), f"a process got no connection: {held}"
        # Every helper sends its share within a second; then any process's /metrics,
        # through any connection, counts every request.
        until(lambda: scraped(cluster).get("nodes_listed") == CONNECTIONS)
        time.sleep(1.5)
        assert {scraped(cluster, client)["nodes_listed"] for client in clients} == {CONNECTIONS}
    finally:
        for client in clients:
            client.close()


def test_a_registration_through_any_process_waits_for_the_reconciler_s_pass(
    cluster: LocalCluster,
) -> None:
    """Each node registers on a connection of its own, so some registrations reach a
    helper, whose wake goes to the controller's reconciler: the node's first heartbeat
    already brings a job that waited for a node."""
    nodes = 9
    with cluster.client() as admin:
        for number in range(nodes):
            admin.submit(
                {"name": f"wait-{number}", "task": {"name": "regression"}, "nnodes": "1:1"}
            )
    for number in range(nodes):
        with ControllerClient(cluster.url, cluster.enrolment_token) as client:
            registered = client.register(
                NodeRegister(name=f"node-{number}", address="127.0.0.1", slots=1, pid=1)
            )
            reply = client.heartbeat(registered.node_id, Heartbeat())
            assert len(reply.assignments) == 1, f"node-{number} was given nothing at once"


def test_a_helper_that_dies_is_started_again_and_its_counts_are_kept(
    cluster: LocalCluster,
) -> None:
    main, helpers = processes(cluster)
    admin = {"authorization": f"Bearer {cluster.admin_token}"}
    clients = [httpx.Client(base_url=cluster.url, timeout=10) for _ in range(CONNECTIONS)]
    try:
        for client in clients:
            client.get("/api/v1/nodes", headers=admin).raise_for_status()
        killed = next(h for h in helpers if serving(h, cluster.port))
        until(lambda: scraped(cluster).get("nodes_listed") == CONNECTIONS)
        time.sleep(1.5)  # every helper has sent its count since
    finally:
        for client in clients:
            client.close()
    killed.send_signal(signal.SIGKILL)
    killed.wait(10)
    until(lambda: killed.pid not in {h.pid for h in processes(cluster)[1]})
    until(lambda: len(processes(cluster)[1]) == PROCESSES - 1, 90.0)
    until(lambda: scraped(cluster).get("relaunch_api_processes") == PROCESSES, 90.0)
    # What the killed helper had counted is still in the sums: no counter fell.
    assert scraped(cluster)["nodes_listed"] == CONNECTIONS
    assert main.is_running()


def test_several_processes_refuse_an_in_memory_database(tmp_path: Path) -> None:
    """Each process would open a database of its own."""
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "server", "--port", str(free_port())],
        env={
            **os.environ,
            "RELAUNCH_DATA_DIR": str(tmp_path),
            "RELAUNCH_DATABASE_URL": "sqlite://",
            "RELAUNCH_API_PROCESSES": "2",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "RELAUNCH_API_PROCESSES above 1 needs a database file or PostgreSQL" in done.stderr


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_no_process_outlives_the_controller(cluster: LocalCluster, how: signal.Signals) -> None:
    main, helpers = processes(cluster)
    every = [main, *main.children(recursive=True)]
    assert len(helpers) == PROCESSES - 1
    assert len(every) == PROCESSES + 1  # the helpers and the reconciler's process
    main.send_signal(how)
    _, alive = psutil.wait_procs(every, timeout=20)
    assert not alive, f"still running after the controller: {alive}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{cluster.url}/healthz", timeout=5)
