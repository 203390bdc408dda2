"""Recovery benchmark: raw torchrun (its documented defaults) against relaunch, same run.

For each scenario and system it starts two "nodes" (elastic agents on loopback),
waits until the job trains at world size 2, applies the fault, and measures the
seconds from the fault (or from starting the new node) to the first training
step at the expected world size, read from the probe's per-step log.

    python -m bench.recovery [--repeats 3] [--scenarios worker_kill,node_drop,...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from service.local_cluster import LocalCluster, free_port

PROBE = Path(__file__).resolve().parent / "ddp_probe.py"
SCENARIOS = {
    # name: (what is done, expected world size afterwards)
    "worker_kill": ("SIGKILL the worker with rank 1", 2),
    "node_drop": ("SIGKILL every process of the node of rank 1", 1),
    "node_drop_rank0": ("SIGKILL every process of the node of rank 0", 1),
    "node_add": ("start a third node", 3),
}
console = Console()


@dataclass
class Trial:
    steps_file: Path
    snapshot: Path
    nodes: dict[str, int] = field(default_factory=dict)  # node name -> agent pid

    def probe_args(self) -> list[str]:
        return [str(PROBE), "--steps-file", str(self.steps_file), "--snapshot", str(self.snapshot)]

    def steps(self) -> list[dict[str, float]]:
        try:
            lines = self.steps_file.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            with suppress(ValueError):
                out.append(json.loads(line))
        return out

    def first_step(self, after: float, world: int, timeout_s: float) -> float | None:
        """Seconds from ``after`` to the first step at ``world`` taken by a process that
        had not trained before ``after`` (a step the old incarnation finished just
        after the fault is not a recovery); None if none in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            steps = self.steps()
            old = {s.get("pid") for s in steps if s["t"] <= after}
            for s in steps:
                if s["t"] > after and s["world"] == world and s.get("pid") not in old:
                    return s["t"] - after
            time.sleep(0.1)
        return None

    def workers(self) -> list[psutil.Process]:
        marker = str(self.steps_file)
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if marker in cmd and not any("torch.distributed.run" in c for c in cmd):
                with suppress(psutil.Error):
                    if "RANK" in proc.environ() and "worker.launch" not in " ".join(cmd):
                        found.append(proc)
        return found

    def worker_of_rank(self, rank: int) -> psutil.Process:
        for proc in self.workers():
            with suppress(psutil.Error):
                if proc.environ().get("RANK") == str(rank):
                    return proc
        raise RuntimeError(f"no worker with rank {rank}")

    def node_of(self, worker: psutil.Process) -> str:
        ancestors = {p.pid for p in worker.parents()}
        for name, pid in self.nodes.items():
            if pid in ancestors:
                return name
        raise RuntimeError(f"worker {worker.pid} belongs to no known node")

    def sweep(self) -> None:
        """Kill every process of the trial, orphans included."""
        marker = str(self.steps_file)
        for proc in psutil.process_iter(["cmdline"]):
            if marker in (proc.info["cmdline"] or []):
                with suppress(psutil.Error):
                    proc.kill()


def kill_node(agent_pid: int) -> None:
    """SIGKILL an agent and every process below it at once, as a dying host would."""
    try:
        root = psutil.Process(agent_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with suppress(psutil.Error):
            proc.kill()


class RawTorchrun:
    """Nodes are `torchrun` agents on loopback with the settings its docs show."""

    name = "raw torchrun"

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []

    @contextmanager
    def trial(self, index: int) -> Iterator[tuple[Trial, Callable[[str], None]]]:
        trial = Trial(self.work / f"raw-{index}.steps", self.work / f"raw-{index}.pt")
        port = free_port()

        def start_node(name: str) -> None:
            log = open(self.work / f"raw-{index}-{name}.log", "wb")  # noqa: SIM115
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes=1:3",
                    "--nproc-per-node=1",
                    "--max-restarts=3",
                    f"--rdzv-id=bench{index}",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    *trial.probe_args(),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.procs.append(proc)
            trial.nodes[name] = proc.pid

        try:
            start_node("a")
            time.sleep(1.0)  # the first agent hosts the store, as in torchrun's docs
            start_node("b")
            yield trial, start_node
        finally:
            for pid in trial.nodes.values():
                kill_node(pid)
            trial.sweep()
            for proc in self.procs:
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)


class Relaunch:
    """Nodes are relaunch agents; the job is the same probe script, submitted over REST."""

    name = "relaunch"

    def __init__(self, work: Path) -> None:
        self.cluster = LocalCluster(data_dir=work / "relaunch", port=free_port())
        self.cluster.data_dir.mkdir(parents=True, exist_ok=True)
        self.cluster.start_controller()
        self.client = self.cluster.client()

    def close(self) -> None:
        self.client.close()
        self.cluster.stop_all()

    @contextmanager
    def trial(self, index: int) -> Iterator[tuple[Trial, Callable[[str], None]]]:
        work = self.cluster.data_dir
        trial = Trial(work / f"rl-{index}.steps", work / f"rl-{index}.pt")

        def start_node(name: str) -> None:
            agent = f"t{index}-{name}"
            self.cluster.start_agent(agent)
            trial.nodes[agent] = self.cluster.procs[agent].pid

        start_node("a")
        start_node("b")
        self.cluster.wait_nodes(2)
        job = self.client.submit(
            {
                "name": f"bench-{index}",
                "nnodes": "1:3",
                "max_restarts": 3,
                "script": {"path": str(PROBE), "args": trial.probe_args()[1:]},
            }
        )
        try:
            yield trial, start_node
        finally:
            with suppress(Exception):
                self.client.cancel(job["id"])
            for agent in list(trial.nodes):
                self.cluster.stop(agent, timeout_s=15)
            trial.sweep()


def run_trial(
    system: RawTorchrun | Relaunch, scenario: str, index: int, timeout_s: float
) -> float | None:
    _, expected = SCENARIOS[scenario]
    with system.trial(index) as (trial, start_node):
        if trial.first_step(0.0, 2, timeout_s=120) is None:
            raise RuntimeError(f"{system.name}: the job never trained at world size 2")
        time.sleep(1.0)
        fault_at = time.time()
        if scenario == "worker_kill":
            trial.worker_of_rank(1).kill()
        elif scenario in ("node_drop", "node_drop_rank0"):
            rank = 0 if scenario == "node_drop_rank0" else 1
            node = trial.node_of(trial.worker_of_rank(rank))
            fault_at = time.time()
            kill_node(trial.nodes.pop(node))
        elif scenario == "node_add":
            start_node("c")
        return trial.first_step(fault_at, expected, timeout_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument(
        "--timeout",
        type=float,
        default=90.0,
        help="seconds after the fault before a trial counts as 'never'",
    )
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    work = Path(tempfile.mkdtemp(prefix="relaunch-bench-"))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raw, relaunch = RawTorchrun(work), Relaunch(work)
    results: dict[tuple[str, str], list[float | None]] = {}
    index = 0
    try:
        for scenario in scenarios:
            for rep in range(args.repeats):
                for system in (raw, relaunch):
                    index += 1
                    seconds = run_trial(system, scenario, index, args.timeout)
                    results.setdefault((scenario, system.name), []).append(seconds)
                    shown = "never" if seconds is None else f"{seconds:.1f} s"
                    console.print(f"{scenario} #{rep + 1} {system.name}: {shown}")
    finally:
        relaunch.close()
    print_table(results, scenarios, args.repeats, args.timeout)
    console.print(f"logs in {work}")


def _median(values: list[float | None]) -> float | None:
    """Median with 'never' counted as infinitely slow; None if the median is 'never'."""
    ordered = sorted(values, key=lambda v: float("inf") if v is None else v)
    if not ordered:
        return None
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    lo, hi = ordered[mid - 1], ordered[mid]
    return None if lo is None or hi is None else statistics.mean([lo, hi])


def print_table(
    results: dict[tuple[str, str], list[float | None]],
    scenarios: list[str],
    repeats: int,
    timeout: float,
) -> None:
    table = Table(
        title=f"seconds from fault to first step at the new world size "
        f"(median of {repeats}; 'never' = not within {timeout:.0f} s)"
    )
    for col in ("scenario", "fault", "raw torchrun", "relaunch", "raw / relaunch"):
        table.add_column(col)
    for scenario in scenarios:
        raw = _median(results.get((scenario, "raw torchrun"), []))
        rl = _median(results.get((scenario, "relaunch"), []))
        ratio = "-"
        if rl is not None:
            ratio = "∞" if raw is None else f"{raw / rl:.1f}x"
        table.add_row(
            scenario,
            SCENARIOS[scenario][0],
            _cell(raw, results.get((scenario, "raw torchrun"), [])),
            _cell(rl, results.get((scenario, "relaunch"), [])),
            ratio,
        )
    console.print(table)


def _cell(median: float | None, values: list[float | None]) -> str:
    runs = ", ".join("never" if v is None else f"{v:.1f}" for v in values)
    return f"{'never' if median is None else f'{median:.1f}'}  [dim]({runs})[/]"


if __name__ == "__main__":
    with suppress(KeyboardInterrupt):
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        main()
