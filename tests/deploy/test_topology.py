"""The docker-compose topology, run here as processes: PostgreSQL, a controller and
three agents sharing one snapshot directory. A job survives one agent being stopped
(``docker compose stop``) and a fourth being started (``--scale agent=4``).

Each process gets the environment and command its service has in
docker-compose.yml. Only what Docker would provide differs: container host
names become 127.0.0.1, container ports become free ones, the volumes become
directories, and each agent gets the name and work dir a container would have.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet

from service.client import RelaunchClient
from service.local_cluster import LocalCluster, free_port
from tests.deploy.compose import load_compose
from tests.e2e.helpers import (
    POLL_S,
    assert_trained,
    dump_logs,
    newest_metric_id,
    regression,
    wait_no_processes,
    wait_terminal,
    wait_world_size,
)
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


class ComposeHere:
    """Starts the services of docker-compose.yml as local processes."""

    def __init__(self, data: Path, database_url: str) -> None:
        self.snapshots = data / "volumes" / "snapshots"
        self.snapshots.mkdir(parents=True)
        self.cluster = LocalCluster(data_dir=data, port=free_port(), snapshot_root=self.snapshots)
        self.compose = load_compose(
            {
                "POSTGRES_PASSWORD": "unused-here",
                "RELAUNCH_ENROLMENT_TOKEN": self.cluster.enrolment_token,
                "RELAUNCH_SECRETS_KEYS": Fernet.generate_key().decode(),
            }
        )
        self.services = self.compose["services"]
        self.database_url = database_url
        self.data = data

    def _localize(self, env: dict[str, str], home: Path) -> dict[str, str]:
        ctl = self.services["controller"]["environment"]
        root = ctl["RELAUNCH_SNAPSHOT_ROOT"]
        api = f"http://controller:{ctl['RELAUNCH_PORT']}"
        here = {
            "DATABASE_URL": self.database_url,
            "RELAUNCH_HOST": "127.0.0.1",
            "RELAUNCH_PORT": str(self.cluster.port),
            "RELAUNCH_SNAPSHOT_ROOT": str(self.snapshots),
            "RELAUNCH_AGENT_CONTROLLER_URL": self.cluster.url,
        }
        containers = {  # what each of those is in the file
            "DATABASE_URL": "postgresql://relaunch:unused-here@postgres:5432/relaunch",
            "RELAUNCH_HOST": "0.0.0.0",
            "RELAUNCH_SNAPSHOT_ROOT": root,
            "RELAUNCH_AGENT_CONTROLLER_URL": api,
        }
        here["RELAUNCH_AGENT_WORK_DIR"] = str(home / "agent")  # each container has its own
        containers["RELAUNCH_AGENT_WORK_DIR"] = "/var/lib/relaunch-agent"
        out = {"HOME": str(home)}  # the image's user has its own home: data dir, work dir
        for key, value in env.items():
            if key in containers:
                assert value == containers[key], (key, value)
            out[key] = here.get(key, value)
        return out

    def _container_env(self, service: str, name: str) -> dict[str, str]:
        """The environment of container ``name`` of ``service``, as seen here."""
        env = self._localize(self.services[service]["environment"], self.data / "homes" / name)
        if service == "agent":
            env["RELAUNCH_AGENT_NAME"] = name  # a container's host name
        return env

    def start_controller(self) -> None:
        env = self._container_env("controller", "controller")
        self.cluster.spawn("controller", self.services["controller"]["command"], env)
        self.cluster.wait_healthy()
        self.cluster.learn_admin_token()

    def start_agent(self, name: str) -> None:
        """One more replica of the agent service (a container named ``name``)."""
        env = self._container_env("agent", name)
        self.cluster.spawn(name, self.services["agent"]["command"], env)

    def healthcheck(self, name: str, service: str, *extra: str) -> int:
        """Run the service's health check command in process ``name``'s environment."""
        test = self.services[service]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "relaunch"]
        env = self._container_env(service, name)
        cmd = [sys.executable, "-m", "service.cli", *test[2:], *extra]
        return subprocess.run(cmd, env=env, capture_output=True, check=False).returncode


@pytest.fixture
def deployment(tmp_path: Path, pg_database: str) -> Iterator[ComposeHere]:
    here = ComposeHere(tmp_path, pg_database)
    try:
        here.start_controller()
        yield here
    finally:
        here.cluster.stop_all()
        dump_logs(tmp_path)


def _alive(client: RelaunchClient) -> set[str]:
    return {n["name"] for n in client.nodes() if n["state"] == "ALIVE"}


def test_a_job_survives_a_stopped_agent_and_a_new_one_on_postgresql(
    deployment: ComposeHere,
) -> None:
    cluster = deployment.cluster
    for name in ("agent-1", "agent-2", "agent-3"):
        deployment.start_agent(name)
    cluster.wait_nodes(3)
    assert deployment.healthcheck("controller", "controller") == 0
    assert deployment.healthcheck("agent-1", "agent") == 0

    with cluster.client() as client:
        assert client.health()["role"] == "leader"
        spec: dict[str, Any] = regression(
            "compose", "2:3", params={"epochs": 6, "step_delay": 0.25}
        )
        job_id = client.submit(spec)["id"]
        wait_world_size(client, job_id, 3, after_step=4)

        seen = newest_metric_id(client, job_id)
        cluster.stop("agent-1")  # docker compose stop: SIGTERM, the agent ends its part
        assert deployment.healthcheck("agent-1", "agent", "--max-age-s", "0.5") != 0
        wait_world_size(client, job_id, 2, after_id=seen)

        seen = newest_metric_id(client, job_id)
        deployment.start_agent("agent-4")  # docker compose up --scale agent=4
        wait_for("agent-4 alive", lambda: "agent-4" in _alive(client), 60, POLL_S)
        wait_world_size(client, job_id, 3, after_id=seen)

        job = wait_terminal(client, job_id)
        assert_trained(client, job)
        assert job["restart_count"] == 0  # a node leaving or joining is no failure
        assert job["membership_changes"] >= 2
        kinds = [e["kind"] for e in client.events(job_id)]
        assert "node_left" in kinds and "node_joined" in kinds
        snapshots = client.snapshots(job_id)
        assert snapshots, "rank 0 wrote no snapshot"
        shared = deployment.snapshots / f"job-{job_id}"
        assert all(Path(s["path"]).parent == shared for s in snapshots)
    wait_no_processes(cluster, job_id)
    cluster.stop("controller", signal.SIGTERM)  # clean stop hands the lease back
