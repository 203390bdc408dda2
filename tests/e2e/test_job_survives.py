"""The working core end to end: a worker is SIGKILLed and the job still succeeds."""

from __future__ import annotations

import json
import signal
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from service.client import RelaunchClient
from service.local_cluster import LocalCluster
from tests.e2e.helpers import POLL_S, regression_spec, wait_no_processes, wait_terminal
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def final_model(cluster: LocalCluster, job_id: int) -> dict[str, torch.Tensor]:
    path = cluster.snapshot_dir(job_id) / "final.pt"
    state: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return state


def ended_members(client: RelaunchClient, job_id: int) -> list[dict[str, Any]]:
    """The members of the job's last attempt once none is ACTIVE any more; else none."""
    members: list[dict[str, Any]] = client.job(job_id)["attempts"][-1]["members"]
    return [] if any(m["state"] == "ACTIVE" for m in members) else members


def test_a_killed_worker_restarts_and_the_job_ends_with_the_uninterrupted_model(
    cluster: LocalCluster, client: RelaunchClient
) -> None:
    job_id = client.submit(regression_spec("killed", step_delay=0.15))["id"]
    wait_for("step 20", lambda: (client.job(job_id)["last_step"] or 0) >= 20, 120, POLL_S)
    victims = cluster.job_workers(job_id)
    assert len(victims) == 2, victims  # one worker on each node
    victims[0].send_signal(signal.SIGKILL)

    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    assert job["restart_count"] >= 1
    events = client.events(job_id)
    kinds = [e["kind"] for e in events]
    assert "worker_failed" in kinds
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert resumed, kinds
    # Every worker, the first ones and the restarted one, was a fork of a warm zygote.
    assert [e["data"]["state"] for e in events if e["kind"] == "zygote"] == ["ready"] * 2, kinds
    assert "cold_start" not in kinds
    assert resumed[0]["data"]["resumed_from_step"] > 0
    # The restart taken apart: every phase the Trainer reports, each moment after the one
    # before it (one machine, one clock). The fault's own moment only the killer knows.
    recovery = client.recoveries(job_id)[0]
    assert recovery["cause"] == "worker_failed", recovery
    phases = {p["name"]: p["seconds"] for p in recovery["phases"]}
    assert phases.pop("detection") is None
    assert all(seconds is not None and seconds >= 0 for seconds in phases.values()), recovery
    assert list(recovery["moments"]) == [
        "failed",
        "rendezvous",
        "process_started",
        "imported",
        "process_group",
        "snapshot_loaded",
        "first_step",
    ]
    # The total runs from the failure to the first step; a phase within the clock's
    # resolution (10 ms) below zero reads 0, which may add that much to it.
    moments = {name: datetime.fromisoformat(at) for name, at in recovery["moments"].items()}
    span = (moments["first_step"] - moments["failed"]).total_seconds()
    assert span - 1e-6 <= recovery["total_s"] <= span + 0.01 * len(phases) + 1e-6, recovery
    steps = [m["step"] for m in client.metrics(job_id)]
    assert steps[-1] == job["total_steps"]
    # A worker's own log lines name the job's attempt number and the global rank, the same
    # numbers the log entry carries (restarts inside the attempt keep its number).
    workers = [e for e in client.logs(job_id) if e["global_rank"] is not None]
    labelled = [e for e in workers if f"[job {job_id} attempt " in e["line"]]
    assert labelled, [e["line"] for e in workers[-20:]]
    for entry in labelled:
        label = f"[job {job_id} attempt {entry['attempt_number']} rank {entry['global_rank']}]"
        assert label in entry["line"], entry
    wait_no_processes(cluster, job_id)
    # Every node whose launcher succeeded finished; none of them reads as a leaver.
    members = wait_for(
        "every member of the last attempt to end", lambda: ended_members(client, job_id), 60, POLL_S
    )
    finished = {e["node_id"] for e in client.events(job_id) if e["kind"] == "node_finished"}
    assert finished, kinds
    assert {m["node_id"] for m in members if m["state"] == "FINISHED"} == finished, members

    reference_id = client.submit(regression_spec("reference", step_delay=0.0))["id"]
    reference = wait_terminal(client, reference_id)
    assert reference["state"] == "SUCCEEDED"
    assert reference["restart_count"] == 0
    got, want = final_model(cluster, job_id), final_model(cluster, reference_id)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5)


def test_what_the_api_acknowledged_is_readable_at_once(client: RelaunchClient) -> None:
    for _ in range(20):
        job_id = client.submit(regression_spec("visible", step_delay=0.0))["id"]
        assert client.job(job_id)["id"] == job_id
        assert client.cancel(job_id)["state"] == "CANCELLED"


def test_cancel_ends_every_process_of_the_job(
    cluster: LocalCluster, client: RelaunchClient
) -> None:
    job_id = client.submit(regression_spec("to-cancel", step_delay=0.2))["id"]
    wait_for("training to start", lambda: (client.job(job_id)["last_step"] or 0) >= 2, 120, POLL_S)
    assert cluster.job_workers(job_id)
    assert client.cancel(job_id)["state"] == "CANCELLED"
    wait_no_processes(cluster, job_id)
    stopped = wait_for(
        "both nodes to report they stopped",
        lambda: (
            len(s := [e for e in client.events(job_id) if e["kind"] == "node_stopped"]) == 2 and s
        ),
        30,
        POLL_S,
    )
    assert all(e["data"]["clean"] for e in stopped)
    assert client.cancel(job_id)["state"] == "CANCELLED"


def example_script(name: str, **extra: Any) -> dict[str, Any]:
    """A two-node job of the example torchrun script, writing result.json."""
    return {
        "name": name,
        "script": {
            "path": str(REPO / "examples" / "torchrun_script.py"),
            # Relative: into the job's own directory, where the job's user may write.
            "args": ["--out", "result.json"],
        },
        "nnodes": "2:2",
        **extra,
    }


def test_a_worker_its_zygote_cannot_serve_starts_cold_and_the_timeline_says_why(
    cluster: LocalCluster, client: RelaunchClient
) -> None:
    # The job's PYTHONPATH shadows numpy with a package that is not there to import: torch
    # goes on without numpy, the job's script needs none, but the zygote imports it.
    planted = cluster.snapshots / "planted-path"
    (planted / "numpy").mkdir(parents=True, exist_ok=True)
    (planted / "numpy" / "__init__.py").write_text("raise ModuleNotFoundError('planted numpy')\n")
    for path in (planted, planted / "numpy"):
        path.chmod(0o755)
    (planted / "numpy" / "__init__.py").chmod(0o644)
    job_id = client.submit(example_script("cold", env={"PYTHONPATH": str(planted)}))["id"]
    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    events = client.events(job_id)
    zygotes = [e for e in events if e["kind"] == "zygote"]
    assert [e["data"]["state"] for e in zygotes] == ["unavailable"] * 2, zygotes
    assert all("before it was ready" in e["message"] for e in zygotes), zygotes
    cold = [e for e in events if e["kind"] == "cold_start"]
    assert len(cold) == 2 and all("before it was ready" in e["message"] for e in cold), cold
    lines = [e["line"] for e in client.logs(job_id)]
    assert any("planted numpy" in line for line in lines), lines[-30:]


def test_a_torchrun_script_runs_unchanged_as_a_job(
    cluster: LocalCluster, client: RelaunchClient, tmp_path: Path
) -> None:
    job_id = client.submit(example_script("user-script"))["id"]
    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    result = json.loads((cluster.snapshot_dir(job_id) / "result.json").read_text())
    assert result["world_size"] == 2
    entries = client.logs(job_id)
    lines = [entry["line"] for entry in entries]
    assert any("done rank=0 world=2" in line for line in lines), lines[-20:]
    assert any("done rank=1 world=2" in line for line in lines), lines[-20:]
    # Each line is labelled as the rest of relaunch names things: its global rank (both
    # workers are local rank 0 of their node), its node's name, the job's attempt number.
    done = {e["global_rank"]: e for e in entries if "done rank=" in e["line"]}
    assert sorted(done) == [0, 1]
    for rank, entry in done.items():
        assert f"done rank={rank} " in entry["line"]
        assert (entry["local_rank"], entry["attempt_number"]) == (0, 1)
    assert {e["node_name"] for e in done.values()} == {"node-a", "node-b"}
    launcher = [e for e in entries if e["local_rank"] is None and "rendezvous:" in e["line"]]
    assert launcher, lines[-20:]
    for entry in launcher:
        assert f"[job {job_id} attempt 1 node {entry['node_name']}]" in entry["line"], entry
