"""An agent's heartbeats at a pace longer than 5 s reuse one connection to the controller:
both ends keep it open while idle (``worker.client.KEEP_ALIVE_S``, the controller's
``RELAUNCH_KEEP_ALIVE_S``), where httpx's and uvicorn's defaults closed it after 5 s."""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from contract.protocol import Heartbeat, NodeRegister
from service.local_cluster import LocalCluster, free_port
from worker.client import ControllerClient

IDLE_S = 6.0  # longer than the 5 s after which either default closed the connection


def _ports_to(port: int) -> set[int]:
    """This process's local ports of its open connections to ``port``."""
    return {
        c.laddr.port
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    }


def test_an_idle_connection_outlives_a_paced_heartbeat(tmp_path: Path) -> None:
    (tmp_path / "controller").mkdir(mode=0o700)
    cluster = LocalCluster(data_dir=tmp_path / "controller", port=free_port())
    try:
        cluster.start_controller()
        with ControllerClient(cluster.url, cluster.enrolment_token) as client:
            registered = client.register(
                NodeRegister(name="node-a", address="127.0.0.1", slots=1, pid=1)
            )
            client.heartbeat(registered.node_id, Heartbeat())
            before = _ports_to(cluster.port)
            assert len(before) == 1, before
            time.sleep(IDLE_S)
            assert _ports_to(cluster.port) == before  # the controller kept its end open
            client.heartbeat(registered.node_id, Heartbeat())
            assert _ports_to(cluster.port) == before  # and the client used it again
    finally:
        cluster.stop_all()
