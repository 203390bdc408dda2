"""Users' own torchrun scripts as jobs: progress without any call, and their own resumes."""

from __future__ import annotations

import ast
import contextlib
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from service.client import RelaunchClient
from service.local_cluster import LocalCluster
from tests.e2e.helpers import (
    POLL_S,
    all_logs,
    dumped_on_failure,
    wait_no_processes,
    wait_terminal,
)
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def script_job(name: str, script: str, *args: str) -> dict[str, Any]:
    return {
        "name": name,
        "script": {"path": str(EXAMPLES / script), "args": list(args)},
        "nnodes": "2:2",
        "max_restarts": 3,
    }


def imported_packages(script: Path) -> set[str]:
    tree = ast.parse(script.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return {name.split(".")[0] for name in names}


def kill_a_worker(cluster: LocalCluster, job_id: int) -> None:
    victims = cluster.job_workers(job_id)
    assert len(victims) == 2, victims  # one worker on each node
    victims[0].send_signal(signal.SIGKILL)


def test_a_script_that_calls_nothing_of_relaunch_shows_progress_and_survives_a_kill(
    cluster: LocalCluster, client: RelaunchClient
) -> None:
    assert not imported_packages(EXAMPLES / "torchrun_script.py") & {
        "worker",
        "service",
        "contract",
    }
    job_id = client.submit(
        script_job("plain", "torchrun_script.py", "--steps", "150", "--step-delay", "0.1")
    )["id"]
    with dumped_on_failure(client, job_id):
        first = wait_for(
            "a step and a step time",
            lambda: (j := client.job(job_id))["step_time_s"] is not None and j,
            120,
            POLL_S,
        )
        assert first["step_time_s"] > 0
        wait_for(
            "the step to grow",
            lambda: (client.job(job_id)["last_step"] or 0) > first["last_step"],
            120,
            POLL_S,
        )
    kill_a_worker(cluster, job_id)

    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    assert job["restart_count"] >= 1
    kinds = [e["kind"] for e in client.events(job_id)]
    assert "worker_failed" in kinds
    assert "restarting" in kinds
    assert job["last_step"] == 150  # the count is reported at exit
    wait_no_processes(cluster, job_id)


def test_the_example_script_resumes_from_its_own_snapshot_after_a_kill(
    cluster: LocalCluster, client: RelaunchClient
) -> None:
    args = ("--epochs", "6", "--points", "512", "--batch-size", "16", "--step-delay", "0.1")
    job_id = client.submit(script_job("own-snapshots", "ddp_script.py", *args))["id"]
    steps_per_epoch = 512 // (16 * 2)
    with dumped_on_failure(client, job_id):
        wait_for(
            "two epochs (two snapshots)",
            lambda: (client.job(job_id)["last_step"] or 0) >= 2 * steps_per_epoch + 2,
            180,
            POLL_S,
        )
    kill_a_worker(cluster, job_id)

    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    events = client.events(job_id)
    kinds = [e["kind"] for e in events]
    assert "restarting" in kinds
    [resumed] = [e for e in events if e["kind"] == "resumed"]
    at = resumed["data"]["resumed_from_step"]
    assert at >= 2 * steps_per_epoch and at % steps_per_epoch == 0
    assert f"resumed from snapshot at step {at}" in resumed["message"]
    assert kinds.index("restarting") < kinds.index("resumed")
    metrics = client.metrics(job_id)
    # The script's reports carry its loss; the counted first step of each start has none.
    losses = [m for m in metrics if m["loss"] is not None]
    assert len(losses) >= len(metrics) - 2, metrics
    assert metrics[-1]["step"] == 6 * steps_per_epoch
    assert metrics[-1]["loss"] is not None
    assert job["last_step"] == 6 * steps_per_epoch
    wait_no_processes(cluster, job_id)


def test_a_frozen_worker_of_a_plain_script_is_found_by_its_own_step_time(
    cluster: LocalCluster, client: RelaunchClient
) -> None:
    """Sub-second steps and the default hang timeout: the timeout is the adaptive floor,
    not the 600 s cap, so the stopped worker is dumped and restarted, and the job ends."""
    job_id = client.submit(
        script_job("frozen", "torchrun_script.py", "--steps", "200", "--step-delay", "0.05")
    )["id"]
    with dumped_on_failure(client, job_id):
        wait_for(
            "steps of a known rhythm",
            lambda: (client.job(job_id)["last_step"] or 0) >= 40,
            120,
            POLL_S,
        )
    workers = cluster.job_workers(job_id)
    assert len(workers) == 2, workers  # one on each node
    victim = workers[0]
    victim.send_signal(signal.SIGSTOP)  # just that worker: its launcher and node go on
    stopped_at = time.monotonic()
    try:

        def hang_detected() -> list[dict[str, Any]]:
            return [e for e in client.events(job_id) if e["kind"] == "hang_detected"]

        with dumped_on_failure(client, job_id):
            hangs = wait_for("the frozen worker to be found hung", hang_detected, 180, POLL_S)
        found_s = time.monotonic() - stopped_at
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.send_signal(signal.SIGCONT)

    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    assert job["restart_count"] >= 1
    for hang in hangs:
        data = hang["data"]
        assert data["rule"] == "adaptive"
        assert data["timeout_s"] <= 60, data  # derived from the steps, not the 600 s cap
        assert "median beat interval" in data["derivation"]
        assert "adaptive" in hang["message"]
    events = client.events(job_id)
    assert "hang" in {e["data"]["cause"] for e in events if e["kind"] == "worker_failed"}
    dumps = [line for line in all_logs(client, job_id) if "most recent call" in line["line"]]
    assert dumps, "no stack dump in the job's logs"
    print(f"hang found {found_s:.1f} s after the SIGSTOP; timeout {hangs[0]['data']}")
    wait_no_processes(cluster, job_id)
