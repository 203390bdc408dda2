"""Two controller processes on one PostgreSQL database: one acts, the other stands by
and takes over when the first is SIGKILLed."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.fernet import Fernet

from service.local_cluster import LocalCluster, free_port
from tests.e2e.helpers import POLL_S, dump_logs
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
LEASE_S = 2.0
SECRETS_KEY = Fernet.generate_key().decode()


def _controller(
    data: Path, database_url: str, name: str, first: LocalCluster | None = None
) -> LocalCluster:
    """A controller; after the ``first``, one that shares its database and secrets (the
    first admin is made, and its token shown, only by the controller that starts first)."""
    c = LocalCluster(data_dir=data / name, port=free_port())
    if first is not None:
        c.admin_token, c.enrolment_token = first.admin_token, first.enrolment_token
    c.data_dir.mkdir(parents=True)
    c.start_controller(
        {
            "DATABASE_URL": database_url,
            "RELAUNCH_CONTROLLER_ID": name,
            "RELAUNCH_LEADER_LEASE_S": str(LEASE_S),
            "RELAUNCH_SECRETS_KEYS": SECRETS_KEY,  # the same on every controller
        }
    )
    return c


@pytest.fixture
def pair(tmp_path: Path, pg_database: str) -> Iterator[tuple[LocalCluster, LocalCluster]]:
    a = _controller(tmp_path, pg_database, "ctl-a")
    b = _controller(tmp_path, pg_database, "ctl-b", first=a)
    try:
        yield a, b
    finally:
        for c in (a, b):
            c.stop_all()
            dump_logs(c.data_dir)


def _health(c: LocalCluster) -> dict[str, Any]:
    with c.client() as client:
        return client.health()


def test_one_controller_acts_and_the_other_takes_over_when_it_dies(
    pair: tuple[LocalCluster, LocalCluster],
) -> None:
    a, b = pair
    wait_for("a leader", lambda: _health(a)["leader"] is not None, 20, POLL_S)
    roles = {_health(c)["controller"]: _health(c)["role"] for c in (a, b)}
    assert sorted(roles.values()) == ["leader", "standby"], roles
    leader, standby = (a, b) if roles["ctl-a"] == "leader" else (b, a)

    with standby.client() as client:  # the standby serves the API too
        node = {"name": "n1", "address": "127.0.0.1", "slots": 1, "pid": 1}
        enrol = {"authorization": f"Bearer {standby.enrolment_token}"}
        registered = httpx.post(f"{standby.url}/api/v1/nodes/register", json=node, headers=enrol)
        node_id, node_token = registered.json()["node_id"], registered.json()["node_token"]
        job_id = client.submit({"name": "j", "task": {"name": "regression"}, "nnodes": "1"})["id"]
        placed = wait_for("placement", lambda: client.job(job_id)["attempts"], 20, POLL_S)
        assert len(placed) == 1

        leader.stop("controller", signal.SIGKILL)
        health = wait_for(
            "the standby to take over",
            lambda: (h := client.health())["role"] == "leader" and h,
            LEASE_S * 10,
            POLL_S,
        )
        assert health["leader"] == health["controller"]
        second = client.submit({"name": "k", "task": {"name": "regression"}, "nnodes": "1"})["id"]
        client.cancel(job_id)  # frees n1 for the second job, which the new leader places
        beat = httpx.post(
            f"{standby.url}/api/v1/nodes/{node_id}/heartbeat",
            json={"running": []},
            headers={"authorization": f"Bearer {node_token}"},
        )
        assert beat.status_code == 200
        assert wait_for("placement by the new leader", lambda: client.job(second)["attempts"], 20)
        placed_events = [e for e in client.events(job_id) if e["kind"] == "placed"]
        assert len(placed_events) == 1  # never placed twice
