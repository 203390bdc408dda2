"""Recovery benchmark: raw torchrun (its documented defaults) against relaunch, same run.

For each scenario and system it starts two "nodes" (elastic agents on loopback),
waits until the job trains at world size 2, measures its throughput over a window
of undisturbed training, applies the fault, and measures the seconds from the
fault (or from starting the new node) to the first training step at the expected
world size, read from the probe's per-step log.

Each recovery is also taken apart into phases (``service.anatomy``): the probe
writes the moments of its new rank 0 process's start; under relaunch the job's
``/recoveries`` adds when the failure was recorded and when the rendezvous
completed. Raw torchrun's agent records neither, so there the phase up to the
new process covers detection and rendezvous too. All the clocks are this
machine's.

    python -m bench.recovery [--repeats 3] [--scenarios worker_kill,node_drop,...]
                             [--window 5] [--json PATH]
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
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from service import anatomy
from service.client import RelaunchClient
from service.local_cluster import LocalCluster, free_port

PROBE = Path(__file__).resolve().parent / "ddp_probe.py"
SCENARIOS = {
    # name: (what is done, expected world size afterwards)
    "worker_kill": ("SIGKILL the worker with rank 1", 2),
    "node_drop": ("SIGKILL every process of the node of rank 1", 1),
    "node_drop_rank0": ("SIGKILL every process of the node of rank 0", 1),
    "node_add": ("start a third node", 3),
}
console = Console(width=None if sys.stdout.isatty() else 150)


@dataclass
class Trial:
    steps_file: Path
    snapshot: Path
    nodes: dict[str, int] = field(default_factory=dict)  # node name -> agent pid
    job_id: int | None = None  # relaunch's job
    started_at: float | None = None  # when the job was submitted (raw: its first agent started)

    def probe_args(self) -> list[str]:
        return [str(PROBE), "--steps-file", str(self.steps_file), "--snapshot", str(self.snapshot)]

    def lines(self) -> list[dict[str, Any]]:
        try:
            lines = self.steps_file.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            with suppress(ValueError):
                out.append(json.loads(line))
        return out

    def steps(self) -> list[dict[str, float]]:
        return [line for line in self.lines() if "step" in line]

    def steps_per_s(self, since: float, until: float) -> float | None:
        """Steps per second between ``since`` and ``until``, from the first step in the
        window to the last; None with fewer than two."""
        times = [s["t"] for s in self.steps() if since <= s["t"] <= until]
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        return (len(times) - 1) / (times[-1] - times[0])

    def startup_moments(self, after: float, world: int) -> dict[str, float]:
        """The moments of the first rank 0 process started after ``after`` at ``world``:
        its start as the probe wrote it, and its first step; empty if there is none."""
        lines = self.lines()
        for line in lines:
            if "startup" in line and line["t"] > after and line["world"] == world:
                moments = {k: v for k, v in line["startup"].items() if v is not None}
                steps = [s for s in lines if "step" in s and s.get("pid") == line["pid"]]
                if steps:
                    moments["first_step"] = steps[0]["t"]
                return moments
        return {}

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

    def worker_of_rank(self, rank: int) -> psutil.Process:
        """The live process of ``rank``, as the probe wrote it when it joined (a worker
        forked from a zygote shows neither the probe's command line nor its rank in
        /proc)."""
        for line in reversed(self.lines()):
            if line.get("rank") == rank:
                with suppress(psutil.Error):
                    proc = psutil.Process(int(line["pid"]))
                    if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                        return proc
        raise RuntimeError(f"no live worker with rank {rank}")

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

    def recovery(self, trial: Trial, fault_at: float, world: int) -> anatomy.Recovery:
        """The agent records no failure or rendezvous time the bench can read."""
        return probe_recovery(trial, fault_at, world)

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
            trial.started_at = time.time()
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
    """Nodes are relaunch agents; the job is the same probe script, submitted over REST.
    ``name`` picks the agents' settings (``VARIANTS``): the defaults, workers forked from a
    warm zygote; every worker started as a new interpreter, as before warm starts; or a
    spare launcher and spare zygote kept loaded."""

    def __init__(self, work: Path, name: str = "relaunch") -> None:
        self.name = name
        self.agent_env, slug = VARIANTS[name]
        self.cluster = LocalCluster(data_dir=work / slug, port=free_port())
        self.cluster.data_dir.mkdir(parents=True, exist_ok=True)
        # As root each job runs as a user of its own: its probe writes here, as in /tmp.
        self.probes = work / f"{slug}-probes"
        self.probes.mkdir()
        self.probes.chmod(0o1777)
        self.cluster.start_controller()
        self.client = self.cluster.client()

    def close(self) -> None:
        self.client.close()
        self.cluster.stop_all()

    def registered_at(self, agent: str, wait_s: float = 60.0) -> float | None:
        """When the controller registered the node ``agent`` (its own clock, this machine's)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for node in self.client.nodes():
                if node["name"] == agent:
                    return datetime.fromisoformat(node["registered_at"]).timestamp()
            time.sleep(0.2)
        return None

    def recovery(self, trial: Trial, fault_at: float, world: int) -> anatomy.Recovery:
        """The controller's first recovery of the trial's job after the fault (the job's
        reports may lag its steps by a report interval or two)."""
        if trial.job_id is None:
            raise RuntimeError("the trial submitted no job")
        found = _first_recovery(self.client, trial.job_id, _at(fault_at))
        return probe_recovery(trial, fault_at, world, found)

    @contextmanager
    def trial(self, index: int) -> Iterator[tuple[Trial, Callable[[str], None]]]:
        trial = Trial(self.probes / f"rl-{index}.steps", self.probes / f"rl-{index}.pt")

        def start_node(name: str) -> None:
            agent = f"t{index}-{name}"
            self.cluster.start_agent(agent, extra_env=self.agent_env)
            trial.nodes[agent] = self.cluster.procs[agent].pid

        start_node("a")
        start_node("b")
        self.cluster.wait_nodes(2)
        trial.started_at = time.time()
        job = self.client.submit(
            {
                "name": f"bench-{index}",
                "nnodes": "1:3",
                "max_restarts": 3,
                "script": {"path": str(PROBE), "args": trial.probe_args()[1:]},
            }
        )
        trial.job_id = job["id"]
        try:
            yield trial, start_node
        finally:
            with suppress(Exception):
                self.client.cancel(job["id"])
            for agent in list(trial.nodes):
                self.cluster.stop(agent, timeout_s=15)
            trial.sweep()


def _first_recovery(
    client: RelaunchClient, job_id: int, after: datetime, wait_s: float = 15.0
) -> anatomy.Recovery | None:
    deadline = time.monotonic() + wait_s
    while True:
        for item in client.recoveries(job_id):
            failed = datetime.fromisoformat(item["moments"]["failed"])
            if failed >= after and "rendezvous" in item["moments"]:
                moments = {
                    name: (datetime.fromisoformat(at), item["clocks"][name])
                    for name, at in item["moments"].items()
                }
                return anatomy.Recovery(item["cause"], moments, anatomy.phases(moments))
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


@dataclass(frozen=True)
class TrialResult:
    scenario: str
    system: str
    repeat: int
    recovery_s: float | None  # None: not within the timeout
    steps_per_s: float | None  # before the fault, at world size 2
    recovery: anatomy.Recovery
    start_s: float | None = None  # from submitting (starting the agents) to the first step
    # node_add, relaunch: from the joining node's registration to the first step at 3
    join_s: float | None = None


def run_trial(
    system: RawTorchrun | Relaunch,
    scenario: str,
    index: int,
    timeout_s: float,
    window_s: float,
) -> tuple[float | None, float | None, anatomy.Recovery, float | None, float | None]:
    """(seconds to recover, steps/s before the fault, the recovery's phases, seconds from
    submitting the job to its first step at world size 2, and for a node that joins
    relaunch, seconds from its registration to the first step at world size 3)."""
    _, expected = SCENARIOS[scenario]
    with system.trial(index) as (trial, start_node):
        first = trial.first_step(0.0, 2, timeout_s=120)
        if first is None:
            raise RuntimeError(f"{system.name}: the job never trained at world size 2")
        started = None if trial.started_at is None else first - trial.started_at
        time.sleep(1.0)
        window_start = time.time()
        time.sleep(window_s)
        steps_per_s = trial.steps_per_s(window_start, time.time())
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
        seconds = trial.first_step(fault_at, expected, timeout_s)
        recovery = system.recovery(trial, fault_at, expected)
        join_s = None
        if scenario == "node_add" and seconds is not None and isinstance(system, Relaunch):
            registered = system.registered_at(list(trial.nodes)[-1])
            if registered is not None:
                join_s = fault_at + seconds - registered
        return seconds, steps_per_s, recovery, started, join_s


def probe_recovery(
    trial: Trial, fault_at: float, world: int, reported: anatomy.Recovery | None = None
) -> anatomy.Recovery:
    """The recovery after ``fault_at``: the fault, what the controller ``reported`` of
    it (its failure and rendezvous), and the probe's own start moments, which are the
    same for both launchers."""
    moments: dict[str, tuple[datetime, str]] = {"fault": (_at(fault_at), anatomy.OBSERVER)}
    cause = "fault"
    if reported is not None:
        cause = reported.cause
        for name in ("failed", "rendezvous"):
            if name in reported.moments:
                moments[name] = reported.moments[name]
    for name, seconds in trial.startup_moments(fault_at, world).items():
        moments[name] = (_at(seconds), "rank 0 worker")
    return anatomy.Recovery(cause, moments, anatomy.phases(moments))


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


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
    parser.add_argument(
        "--window",
        type=float,
        default=5.0,
        help="seconds of undisturbed training before the fault over which steps/s is measured",
    )
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    parser.add_argument(
        "--spare",
        action="store_true",
        help="also run relaunch with RELAUNCH_AGENT_SPARE_LAUNCHER=true (a spare launcher "
        "and a spare zygote per agent), side by side",
    )
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    work = Path(tempfile.mkdtemp(prefix="relaunch-bench-"))
    work.chmod(0o711)  # jobs run as users of their own and must pass through it
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    trials: list[TrialResult] = []
    index = 0
    with ExitStack() as running:  # every controller started is stopped, whatever fails
        raw = RawTorchrun(work)
        relaunch = Relaunch(work)
        running.callback(relaunch.close)
        cold = Relaunch(work, COLD)
        running.callback(cold.close)
        systems: list[RawTorchrun | Relaunch] = [raw, cold, relaunch]
        if args.spare:
            spare = Relaunch(work, SPARE)
            running.callback(spare.close)
            systems.append(spare)
        for scenario in scenarios:
            for rep in range(args.repeats):
                for system in systems:
                    index += 1
                    seconds, rate, recovery, started, join_s = run_trial(
                        system, scenario, index, args.timeout, args.window
                    )
                    trials.append(
                        TrialResult(
                            scenario,
                            system.name,
                            rep + 1,
                            seconds,
                            rate,
                            recovery,
                            started,
                            join_s,
                        )
                    )
                    shown = "never" if seconds is None else f"{seconds:.1f} s"
                    console.print(f"{scenario} #{rep + 1} {system.name}: {shown}")
    results: dict[tuple[str, str], list[float | None]] = {}
    for trial in trials:
        results.setdefault((trial.scenario, trial.system), []).append(trial.recovery_s)
    print_table(results, scenarios, args.repeats, args.timeout)
    print_phases(trials, scenarios, args.repeats)
    print_throughput(trials, args.window)
    print_start(trials)
    print_join(trials)
    if args.json is not None:
        args.json.write_text(json.dumps(figures(trials, args), indent=2) + "\n")
        console.print(f"figures in {args.json}")
    console.print(f"logs in {work}")


COLD = "relaunch, cold start"
SPARE = "relaunch, spares"
KNOWN_SYSTEMS = ("raw torchrun", COLD, "relaunch", SPARE)
# Relaunch's variants: the agents' extra environment, and the directory their cluster uses.
VARIANTS: dict[str, tuple[dict[str, str], str]] = {
    "relaunch": ({}, "relaunch"),
    COLD: ({"RELAUNCH_AGENT_WARM_WORKERS": "false"}, "relaunch-cold"),
    SPARE: ({"RELAUNCH_AGENT_SPARE_LAUNCHER": "true"}, "relaunch-spare"),
}


def _systems(trials: list[TrialResult]) -> list[str]:
    """The systems that ran, in the tables' order."""
    ran = {t.system for t in trials}
    return [s for s in KNOWN_SYSTEMS if s in ran]


PHASE_NAMES = [name for name, _ in anatomy.PHASES]


def _phase_medians(trials: list[TrialResult]) -> dict[str, dict[str, Any]]:
    """Per phase: the median seconds of the trials that measured it, and what it ran
    from (the most common start; it differs when a moment was not reported)."""
    out: dict[str, dict[str, Any]] = {}
    for name in PHASE_NAMES:
        found = [p for t in trials for p in t.recovery.phases if p.name == name]
        measured = [p for p in found if p.seconds is not None]
        sinces = [p.since for p in measured]
        out[name] = {
            "median_s": statistics.median(p.seconds for p in measured if p.seconds is not None)
            if measured
            else None,
            "since": max(set(sinces), key=sinces.count) if sinces else None,
            "trials": len(measured),
        }
    return out


def _throughput(trials: list[TrialResult]) -> dict[str, float | None]:
    medians: dict[str, float | None] = {}
    for system in _systems(trials):
        rates = [t.steps_per_s for t in trials if t.system == system and t.steps_per_s]
        medians[system] = statistics.median(rates) if rates else None
    raw, rl = medians.get("raw torchrun"), medians.get("relaunch")
    medians["relaunch / raw torchrun"] = rl / raw if rl is not None and raw else None
    return medians


def figures(trials: list[TrialResult], args: argparse.Namespace) -> dict[str, Any]:
    """Every figure measured, per trial and as medians, as plain JSON data."""

    def recovery_data(recovery: anatomy.Recovery) -> dict[str, Any]:
        return {
            "cause": recovery.cause,
            "moments": {
                name: {"time": at.timestamp(), "clock": clock}
                for name, (at, clock) in recovery.moments.items()
            },
            "phases": [
                {"name": p.name, "since": p.since, "seconds": p.seconds, "same_clock": p.same_clock}
                for p in recovery.phases
            ],
        }

    medians: dict[str, dict[str, Any]] = {}
    for trial in trials:
        medians.setdefault(trial.scenario, {})
    for scenario, by_system in medians.items():
        for system in _systems(trials):
            chosen = [t for t in trials if t.scenario == scenario and t.system == system]
            rates = [t.steps_per_s for t in chosen if t.steps_per_s]
            by_system[system] = {
                "recovery_s": _median([t.recovery_s for t in chosen]),
                "steps_per_s": statistics.median(rates) if rates else None,
                "phases": _phase_medians(chosen),
            }
    return {
        "settings": {
            "repeats": args.repeats,
            "scenarios": [s for s in args.scenarios.split(",") if s],
            "timeout_s": args.timeout,
            "window_s": args.window,
            "spare": args.spare,
        },
        "trials": [
            {
                "scenario": t.scenario,
                "system": t.system,
                "repeat": t.repeat,
                "recovery_s": t.recovery_s,
                "steps_per_s": t.steps_per_s,
                "start_s": t.start_s,
                "join_s": t.join_s,
                "recovery": recovery_data(t.recovery),
            }
            for t in trials
        ],
        "medians": medians,
        "throughput_steps_per_s": _throughput(trials),
        "start_s": _starts(trials),
        "join_s": _joins(trials),
    }


def print_phases(trials: list[TrialResult], scenarios: list[str], repeats: int) -> None:
    table = Table(
        title=f"where the recovery's seconds go (median of {repeats}; a phase runs from the "
        "moment before it, '← x' when that one was not seen; one machine, so one clock)"
    )
    for col in ("scenario", "system", *(n.replace("_", " ") for n in PHASE_NAMES)):
        table.add_column(col)
    natural = dict(zip(PHASE_NAMES, ["fault", *(m for _, m in anatomy.PHASES)], strict=False))
    for scenario in scenarios:
        for system in _systems(trials):
            chosen = [t for t in trials if t.scenario == scenario and t.system == system]
            cells = []
            for name, phase in _phase_medians(chosen).items():
                if phase["median_s"] is None:
                    cells.append("-")
                    continue
                since = "" if phase["since"] == natural[name] else f" ← {phase['since']}"
                cells.append(f"{phase['median_s']:.2f}{since}")
            table.add_row(scenario, system, *cells)
    console.print(table)


def print_throughput(trials: list[TrialResult], window: float) -> None:
    table = Table(
        title=f"training throughput, steps/s over {window:.0f} s of undisturbed training at "
        "world size 2 (median of every trial)"
    )
    columns = (*_systems(trials), "relaunch / raw torchrun")
    for col in columns:
        table.add_column(col)
    rates = _throughput(trials)
    table.add_row(*("-" if rates[k] is None else f"{rates[k]:.2f}" for k in columns))
    console.print(table)


def _medians(
    trials: list[TrialResult], figure: Callable[[TrialResult], float | None]
) -> dict[str, float | None]:
    """Per system, the median of ``figure`` over the trials that have it."""
    medians: dict[str, float | None] = {}
    for system in _systems(trials):
        values = [v for t in trials if t.system == system and (v := figure(t)) is not None]
        medians[system] = statistics.median(values) if values else None
    return medians


def _starts(trials: list[TrialResult]) -> dict[str, float | None]:
    return _medians(trials, lambda t: t.start_s)


def print_start(trials: list[TrialResult]) -> None:
    table = Table(
        title="seconds from submitting the job (raw torchrun: starting its first agent) to its "
        "first step at world size 2, on idle nodes (median of every trial)"
    )
    systems = _systems(trials)
    for col in systems:
        table.add_column(col)
    starts = _starts(trials)
    table.add_row(*("-" if starts[k] is None else f"{starts[k]:.1f}" for k in systems))
    console.print(table)


def _joins(trials: list[TrialResult]) -> dict[str, float | None]:
    return _medians(trials, lambda t: t.join_s)


def print_join(trials: list[TrialResult]) -> None:
    joins = _joins(trials)
    systems = [k for k, v in joins.items() if v is not None]
    if not systems:
        return
    table = Table(
        title="node add: seconds from the joining node's registration with the controller to "
        "the first step at world size 3 (median of every trial)"
    )
    for col in systems:
        table.add_column(col)
    table.add_row(*(f"{joins[k]:.1f}" for k in systems))
    console.print(table)


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
    systems = [s for s in KNOWN_SYSTEMS if any(key[1] == s for key in results)]
    ratios = ["raw / relaunch", "cold / warm"] + (["warm / spare"] if SPARE in systems else [])
    for col in ("scenario", "fault", *systems, *ratios):
        table.add_column(col)
    for scenario in scenarios:
        values = {system: results.get((scenario, system), []) for system in systems}
        medians = {system: _median(found) for system, found in values.items()}
        raw, cold, rl = (medians.get(system) for system in ("raw torchrun", COLD, "relaunch"))
        spare = [_ratio(rl, medians[SPARE])] if SPARE in systems else []
        table.add_row(
            scenario,
            SCENARIOS[scenario][0],
            *(_cell(medians[system], values[system]) for system in systems),
            _ratio(raw, rl),
            _ratio(cold, rl),
            *spare,
        )
    console.print(table)


def _ratio(slower: float | None, faster: float | None) -> str:
    if faster is None:
        return "-"
    return "∞" if slower is None else f"{slower / faster:.1f}x"


def _cell(median: float | None, values: list[float | None]) -> str:
    runs = ", ".join("never" if v is None else f"{v:.1f}" for v in values)
    return f"{'never' if median is None else f'{median:.1f}'}  [dim]({runs})[/]"


if __name__ == "__main__":
    with suppress(KeyboardInterrupt):
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        main()
