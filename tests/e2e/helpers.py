"""Helpers for the end-to-end tests: a cluster of real processes, waiting on its jobs,
and what a failing wait prints."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.client import RelaunchClient
from service.local_cluster import LocalCluster, free_port
from tests.helpers import wait_for

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
POLL_S = 0.3  # between polls of the controller or the process table
NODE_TIMEOUT_S = 5  # the controller's node timeout where a test loses nodes


@contextlib.contextmanager
def running_cluster(
    data: Path,
    agents: tuple[str, ...] = (),
    snapshot_root: Path | None = None,
    controller_env: dict[str, str] | None = None,
    agent_env: dict[str, str] | None = None,
    wait_nodes_s: float = 60.0,
) -> Iterator[LocalCluster]:
    """A controller and ``agents``, stopped (and their logs printed) on the way out."""
    c = LocalCluster(data_dir=data, port=free_port(), snapshot_root=snapshot_root)
    try:
        c.start_controller(controller_env)
        for name in agents:
            c.start_agent(name, extra_env=agent_env)
        c.wait_nodes(len(agents), timeout_s=wait_nodes_s)
        yield c
    finally:
        c.stop_all()
        dump_logs(data)


def dump_logs(data: Path) -> None:
    """Keep the processes' logs visible in a failing run's output."""
    for log in sorted(data.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-40:]
        print(f"----- {log.name} -----\n" + "\n".join(tail))


def wait_terminal(client: RelaunchClient, job_id: int, timeout_s: float = 240) -> dict[str, Any]:
    with dumped_on_failure(client, job_id):
        job: dict[str, Any] = wait_for(
            f"job {job_id} to end",
            lambda: (j := client.job(job_id))["state"] in TERMINAL and j,
            timeout_s,
            POLL_S,
        )
    return job


@contextlib.contextmanager
def dumped_on_failure(client: RelaunchClient, job_id: int) -> Iterator[None]:
    """Print the job's state, events and log tail if the block fails an assertion."""
    try:
        yield
    except AssertionError:
        dump_job(client, job_id)
        raise


def dump_job(client: RelaunchClient, job_id: int, lines: int = 60) -> None:
    """Print a job's state, events and the tail of its logs, to explain a failing wait."""
    print(f"----- job {job_id} -----\n{client.job(job_id)}")
    for event in client.events(job_id):
        print(f"{event['time']} {event['kind']} node={event['node_id']} {event['data']}")
    for entry in client.logs(job_id)[-lines:]:
        print(f"{entry['time']} node={entry['node_id']} {entry['stream']}: {entry['line']}")


def all_logs(client: RelaunchClient, job_id: int) -> list[dict[str, Any]]:
    """Every log line of the job, page by page."""
    lines: list[dict[str, Any]] = []
    while page := client.logs(job_id, after_id=lines[-1]["id"] if lines else 0):
        lines += page
    return lines


def wait_no_processes(cluster: LocalCluster, job_id: int, timeout_s: float = 15) -> None:
    wait_for(
        f"no process of job {job_id}", lambda: not cluster.job_processes(job_id), timeout_s, POLL_S
    )


def regression(name: str, nnodes: str, **extra: Any) -> dict[str, Any]:
    params = {
        "epochs": 3,
        "samples": 1024,
        "batch_size": 32,
        "seed": 5,
        "step_delay": 0.1,
        "log_every_steps": 2,
        **extra.pop("params", {}),
    }
    return {
        "name": name,
        "task": {"name": "regression", "params": params},
        "nnodes": nnodes,
        "max_restarts": 3,
        "snapshot": {"every_steps": 5},
        **extra,
    }


def regression_spec(name: str, step_delay: float) -> dict[str, Any]:
    return {
        "name": name,
        "task": {
            "name": "regression",
            "params": {
                "epochs": 4,
                "samples": 1024,
                "batch_size": 32,
                "seed": 11,
                "step_delay": step_delay,
                "log_every_steps": 2,
            },
        },
        "nnodes": "2:2",
        "max_restarts": 3,
        "snapshot": {"every_steps": 8},
    }


def wait_world_size(
    client: RelaunchClient, job_id: int, size: int, after_step: int = 0, after_id: int = 0
) -> None:
    """Until rank 0 reports a training step past ``after_step`` at world size ``size``, in a
    metric newer than ``after_id``. To wait for what an action brings about, pass
    ``newest_metric_id`` taken before it: a job that re-formed resumes from its snapshot
    and reports steps again, so the job's last step can lie below steps it reported at the
    old world size."""
    with dumped_on_failure(client, job_id):
        wait_for(
            f"job {job_id} training at world size {size}",
            lambda: any(
                m["world_size"] == size and m["step"] > after_step
                for m in client.metrics(job_id, after_id=after_id)
            ),
            120,
            POLL_S,
        )


def newest_metric_id(client: RelaunchClient, job_id: int) -> int:
    """The id of the job's newest metric (0 if none yet)."""
    newest = 0
    while page := client.metrics(job_id, after_id=newest):
        newest = page[-1]["id"]
    return newest


def assert_trained(client: RelaunchClient, job: dict[str, Any]) -> None:
    assert job["state"] == "SUCCEEDED", job
    metrics = client.metrics(job["id"])
    assert job["last_step"] == job["total_steps"]  # from the training_finished event
    first_loss = metrics[0]["loss"]
    assert job["last_loss"] is not None and job["last_loss"] < first_loss / 10, metrics
