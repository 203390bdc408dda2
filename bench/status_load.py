"""Status API under load while two jobs train: what a room full of open dashboards costs.

A controller and two node agents on this machine train two one-node jobs. First the
jobs train with no API load (the baseline). Then, one phase at a time, client
processes poll the job list or one job's detail as fast as they can, each with one
keep-alive connection, either plainly or as a dashboard does: sending back the ETag
of its last answer (If-None-Match), which is answered 304 while nothing changed.

Per phase: requests/s, p50 and p99 latency, the share of 304s, the controller's
CPU time per request (its process's CPU over the phase, less what it used unloaded,
over the requests: the cost that does not depend on how busy the machine is), and
the jobs' training throughput (rank 0's samples/s, median over the phase) against
the unloaded baseline, in the same run. With ``--rate`` the clients together send
that many requests a second, as a number of open dashboards would, instead of as
many as they can.

    python -m bench.status_load [--seconds 10] [--clients 4] [--rate 0]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from service.client import RelaunchClient
from service.local_cluster import LocalCluster, free_port

console = Console(width=130)
JOB = {
    "task": {
        "name": "regression",
        "params": {
            "epochs": 1000,
            "samples": 4096,
            "batch_size": 64,
            "step_delay": 0.002,
            "log_every_steps": 50,
        },
    },
    "nnodes": "1",
    "snapshot": {"every_steps": 200},
}


@dataclass
class Phase:
    name: str
    path: str  # "" for the unloaded baseline
    conditional: bool = False


@dataclass
class Result:
    phase: Phase
    requests: int
    seconds: float
    latencies_ms: list[float]
    not_modified: int
    samples_per_s: float
    controller_cpu_s: float


def hammer(
    url: str,
    token: str,
    path: str,
    conditional: bool,
    until: float,
    interval_s: float = 0.0,
    first_s: float = 0.0,
) -> tuple[list[float], int]:
    """One client: GET ``path`` back to back until ``until``, or one every ``interval_s``
    seconds from ``first_s`` on (clients start apart, as dashboards opened at different
    moments poll); latencies and 304 count. A paced request's latency runs from when it
    was due: one the client sends late, behind a slow answer, waited too."""
    latencies: list[float] = []
    not_modified = 0
    etag: str | None = None
    headers = {"authorization": f"Bearer {token}"}
    due = time.perf_counter() + first_s
    with httpx.Client(base_url=url, timeout=10.0) as http:
        while time.time() < until:
            if interval_s:
                time.sleep(max(0.0, due - time.perf_counter()))
            sent = {**headers, "if-none-match": etag} if conditional and etag else headers
            start = min(time.perf_counter(), due) if interval_s else time.perf_counter()
            response = http.get(path, headers=sent)
            latencies.append((time.perf_counter() - start) * 1000)
            due += interval_s
            if response.status_code == 304:
                not_modified += 1
            elif response.status_code == 200:
                etag = response.headers.get("etag")
            else:
                raise RuntimeError(f"GET {path}: {response.status_code} {response.text[:200]}")
    return latencies, not_modified


def throughput(client: RelaunchClient, job_ids: list[int], since: float, until: float) -> float:
    """Median of rank 0's samples/s of both jobs, reported between ``since`` and ``until``."""
    speeds = []
    for job_id in job_ids:
        after = 0
        while page := client.metrics(job_id, after_id=after):
            after = page[-1]["id"]
            for m in page:
                when = datetime.fromisoformat(m["time"]).timestamp()
                if since <= when <= until and m["samples_per_s"]:
                    speeds.append(m["samples_per_s"])
    return statistics.median(speeds) if speeds else float("nan")


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def run_phase(
    cluster: LocalCluster,
    client: RelaunchClient,
    jobs: list[int],
    phase: Phase,
    seconds: float,
    clients: int,
    rate: float,
) -> Result:
    assert cluster.admin_token is not None
    controller = psutil.Process(cluster.procs["controller"].pid)
    cpu_before = cpu_seconds(controller)
    start = time.time()
    until = start + seconds
    latencies: list[float] = []
    not_modified = 0
    if phase.path:
        interval_s = clients / rate if rate else 0.0
        args = [
            (
                cluster.url,
                cluster.admin_token,
                phase.path,
                phase.conditional,
                until,
                interval_s,
                i * interval_s / clients,
            )
            for i in range(clients)
        ]
        with multiprocessing.Pool(clients) as pool:
            for lat, nm in pool.starmap(hammer, args):
                latencies += lat
                not_modified += nm
    else:
        time.sleep(seconds)
    elapsed = time.time() - start
    controller_cpu_s = cpu_seconds(controller) - cpu_before
    time.sleep(1.0)  # let the last progress reports of the phase arrive
    speed = throughput(client, jobs, start + 1.0, start + elapsed)
    return Result(phase, len(latencies), elapsed, latencies, not_modified, speed, controller_cpu_s)


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase")
    parser.add_argument("--clients", type=int, default=4, help="polling processes per phase")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="requests/s of all clients (0: as many as they can)"
    )
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="relaunch-bench-status-"))
    cluster = LocalCluster(data_dir=work, port=free_port())
    try:
        cluster.start_controller()
        for name in ("node-a", "node-b"):
            cluster.start_agent(name)
        cluster.wait_nodes(2)
        with cluster.client() as client:
            jobs = [client.submit({**JOB, "name": f"load-{i}"})["id"] for i in (1, 2)]
            deadline = time.time() + 120
            while not all(client.metrics(j) for j in jobs):
                if time.time() > deadline:
                    raise RuntimeError("the jobs did not start training")
                time.sleep(0.5)
            time.sleep(3.0)  # past start-up
            detail = f"/api/v1/jobs/{jobs[0]}"
            phases = [
                Phase("no load (baseline)", ""),
                Phase("job list", "/api/v1/jobs"),
                Phase("job list, If-None-Match", "/api/v1/jobs", conditional=True),
                Phase("job detail", detail),
                Phase("job detail, If-None-Match", detail, conditional=True),
                Phase("no load (again)", ""),
            ]
            results = []
            for phase in phases:
                console.print(f"phase: {phase.name} ({args.seconds:g} s)")
                results.append(
                    run_phase(cluster, client, jobs, phase, args.seconds, args.clients, args.rate)
                )
            for job_id in jobs:
                client.cancel(job_id)
    finally:
        cluster.stop_all()
    print_table(results, args)


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    baseline = statistics.mean(
        r.samples_per_s for r in results if not r.phase.path and r.samples_per_s == r.samples_per_s
    )
    unloaded = [r.controller_cpu_s / r.seconds for r in results if not r.phase.path]
    idle_cpu = statistics.mean(unloaded)  # the reconciler and the jobs' reports
    pace = f"{args.rate:g} requests/s in all" if args.rate else "as fast as they can"
    table = Table(
        title=f"status API under load: {args.clients} polling processes ({pace}), "
        f"{args.seconds:g} s per phase, two one-node jobs training (relaunch's regression task)"
    )
    for column in (
        "phase",
        "req/s",
        "p50 ms",
        "p99 ms",
        "304s",
        "controller CPU ms/req",
        "training samples/s",
        "vs no load",
    ):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for r in results:
        loaded = bool(r.phase.path)
        table.add_row(
            r.phase.name,
            f"{r.requests / r.seconds:.0f}" if loaded else "-",
            f"{quantile(r.latencies_ms, 0.5):.1f}" if loaded else "-",
            f"{quantile(r.latencies_ms, 0.99):.1f}" if loaded else "-",
            f"{100 * r.not_modified / r.requests:.0f} %" if loaded and r.requests else "-",
            f"{1000 * (r.controller_cpu_s - idle_cpu * r.seconds) / r.requests:.2f}"
            if loaded and r.requests
            else "-",
            f"{r.samples_per_s:.0f}",
            f"{100 * (r.samples_per_s / baseline - 1):+.1f} %",
        )
    console.print(table)
    console.print(
        "baseline: the mean of the two unloaded phases. Targets (issue 5): >= 1,000 req/s, "
        "p99 <= 50 ms, training slowdown < 5 %. Controller CPU: its process's, less its "
        f"unloaded {1000 * idle_cpu:.0f} ms/s, per request. Load average at the end: "
        f"{psutil.getloadavg()[0]:.1f} on {psutil.cpu_count()} CPUs."
    )


if __name__ == "__main__":
    main()
