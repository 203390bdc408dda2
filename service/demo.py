"""``relaunch demo``: a controller, two node agents, a job, a killed worker, a recovery."""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from contract.job_users import DEFAULT_JOB_UID_BASE, interpreter_refusal
from service.client import RelaunchError
from service.local_cluster import LocalCluster
from service.timeline import print_timeline

DEMO_SPEC: dict[str, Any] = {
    "name": "demo-charlm",
    "task": {"name": "charlm", "params": {"epochs": 4, "seed": 7, "log_every_steps": 1}},
    "nnodes": "2:2",
    "nproc_per_node": 1,
    "max_restarts": 3,
    "snapshot": {"every_steps": 5},
}
KILL_AT_FRACTION = 0.4


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def run_demo(console: Console, port: int = 8080, keep_running: bool | None = None) -> int:
    if keep_running is None:
        keep_running = sys.stdout.isatty()
    data_dir = Path(tempfile.mkdtemp(prefix="relaunch-demo-"))
    cluster = LocalCluster(data_dir=data_dir, port=port)
    console.print(f"[bold]relaunch demo[/]  (state and logs in {data_dir})")
    if cluster.isolation == "user":
        refusal = interpreter_refusal(DEFAULT_JOB_UID_BASE + 1)
        if refusal is not None:
            # One person's demo of their own job: it may run as them rather than not at all.
            cluster.isolation = "none"
            console.print(
                f"[yellow]jobs run as this user, not as users of their own:[/] {escape(refusal)}"
            )
    try:
        with console.status("starting the controller (SQLite, migrations)"):
            cluster.start_controller()
        with console.status("starting two node agents"):
            cluster.start_agent("node-a")
            cluster.start_agent("node-b")
            cluster.wait_nodes(2)
        return _drive(console, cluster, keep_running)
    except (RuntimeError, RelaunchError) as exc:
        console.print(f"[bold red]demo failed:[/] {escape(str(exc))}")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        with console.status("stopping agents and controller"):
            cluster.stop_all()


def _drive(console: Console, cluster: LocalCluster, keep_running: bool) -> int:
    with cluster.client() as client:
        submitted_at = time.time()
        submitted = client.submit(DEMO_SPEC)
        job_id = submitted["id"]
        console.print(escape(job_summary(submitted)))
        killed_at: float | None = None
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[steps]}"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
        )
        with progress:
            bar = progress.add_task("waiting for placement", total=None, info="", steps="")
            while True:
                job = client.job(job_id)
                step, total = job["last_step"] or 0, job["total_steps"]
                loss = f"loss {job['last_loss']:.3f}" if job["last_loss"] is not None else ""
                progress.update(
                    bar,
                    description=f"job {job_id} {job['state']:<10}",
                    completed=step,
                    total=total,
                    steps=f"step {step}/{total or '?'}",
                    info=f"{loss} world {job['world_size'] or '-'} restarts {job['restart_count']}",
                )
                if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    break
                if killed_at is None and total and step >= KILL_AT_FRACTION * total:
                    victims = cluster.job_workers(job_id)
                    if victims:
                        victim = victims[-1]
                        victim.send_signal(signal.SIGKILL)
                        killed_at = time.time()
                        progress.console.print(
                            f"[bold red]SIGKILL[/] worker pid {victim.pid} at step {step}"
                        )
                time.sleep(0.3)
        events = client.events(job_id)
        metrics = client.metrics(job_id)
    print_timeline(console, events)
    _print_figures(console, job, submitted_at, killed_at, metrics)
    if keep_running:
        _serve_until_interrupted(console, cluster, job_id)
    else:
        console.print(ended_text(cluster.data_dir))
    return 0 if job["state"] == "SUCCEEDED" else 1


def ended_text(data_dir: Path) -> str:
    """What a demo that does not keep running says as it stops."""
    return (
        f"the demo is over: its controller and node agents stop now, so its API no longer "
        f"answers (their state and logs stay in {data_dir}); run `relaunch demo "
        f"--keep-running` to keep them up, with the API and the dashboard, until Ctrl-C"
    )


def _serve_until_interrupted(console: Console, cluster: LocalCluster, job_id: int) -> None:
    console.print(f"API: {cluster.url}/api/v1/jobs/{job_id}   docs: {cluster.url}/docs")
    console.print(f"dashboard: {cluster.url}/dashboard/")
    console.print(
        f"the demo's admin token (send it as 'Authorization: Bearer …'): {cluster.admin_token}"
    )
    console.print("the controller and node agents keep running; press Ctrl-C to stop them")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass


def job_summary(job: dict[str, Any]) -> str:
    """One line on a job the API returned: id, name, what it runs, where and how it recovers.

    e.g. ``submitted job 1 demo-charlm: task charlm (epochs=4, seed=7) on 2 nodes,
    1 process each, up to 3 restarts, a snapshot every 5 steps``.
    """
    spec = job["spec"]
    if spec.get("task"):
        params = ", ".join(f"{k}={v}" for k, v in spec["task"].get("params", {}).items())
        what = f"task {spec['task']['name']}" + (f" ({params})" if params else "")
    else:
        script = spec.get("script") or {}
        what = f"script {script['path']}" if script.get("path") else f"module {script['module']}"
    low, high = job["min_nodes"], job["max_nodes"]
    nodes = f"{low} node{'s' * (high != 1)}" if low == high else f"{low} to {high} nodes"
    procs, budget = spec["nproc_per_node"], spec["max_restarts"]
    restarts = f"up to {budget} restart{'s' * (budget != 1)}" if budget else "no restarts"
    snapshot = spec.get("snapshot") or {}
    if snapshot.get("every_steps"):
        saves = f"a snapshot every {snapshot['every_steps']} steps"
    elif snapshot.get("every_epochs"):
        saves = f"a snapshot every {snapshot['every_epochs']} epochs"
    else:
        saves = "a snapshot after each epoch"
    return (
        f"submitted job {job['id']} {job['name']}: {what} on {nodes}, {procs} "
        f"process{'es' * (procs != 1)} each, {restarts}, {saves}"
    )


def _print_figures(
    console: Console,
    job: dict[str, Any],
    submitted_at: float,
    killed_at: float | None,
    metrics: list[dict[str, Any]],
) -> None:
    console.print(f"job {job['id']} {job['state']} after {job['restart_count']} restart(s)")
    if metrics:
        console.print(f"submit → first step: {_ts(metrics[0]['time']) - submitted_at:.1f} s")
    if killed_at is not None:
        after = [m for m in metrics if _ts(m["time"]) > killed_at]
        if after:
            console.print(
                f"worker kill → resumed training: {_ts(after[0]['time']) - killed_at:.1f} s"
            )
    if job["finished_at"]:
        console.print(f"total run time: {_ts(job['finished_at']) - submitted_at:.1f} s")
