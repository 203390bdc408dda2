"""What one request of the fleet's costs the API's process, by kind: the CPU time of the
controller's process (its reconciler runs in a process of its own) per request.

A request's cost is small (a few milliseconds) and a shared machine's CPU time per
request drifts between minutes by more than the changes measured, so the codes are
measured side by side: every code (this one, and ``--baseline-code DIR``, a checkout of
another commit: ``git worktree add /tmp/base REV``) runs its own controller at once, and
the requests go to them in turn, ``--per-batch`` of one kind to one controller, then to
the next, for ``--batches`` rounds, each code first in every other round. The table gives
each code's median over the batches of the CPU time per request, with its quartiles, and
the median over the rounds of the ratio of the two codes' batches of one round (those
met the same machine), with how many rounds this code's cost less; a second table gives
the same of the time a request took, as this process sent them one at a time. Each
controller runs pinned to one core and this process to another, where there are two.
``--baseline-code .`` measures this code against itself: the bench's own spread.

Each controller gets a fresh database and the same small fleet, over HTTP: two nodes
that run one job of two nodes (placed by the controller's reconciler), and a third node
with nothing to run. The kinds: a heartbeat of the idle node; a heartbeat of a node that
runs its assignment; a progress report with a log line, as a worker's node sends them; a
key set in the job's rendezvous store, as torch's elastic agent sets its keys.

    python -m bench.request_cost
    python -m bench.request_cost --baseline-code /tmp/base --batches 30 --per-batch 200
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil

from bench.reconcile_pass import database
from contract.events import (
    EventData,
    RendezvousComplete,
    TrainingProgress,
    TrainingStarted,
    runtime_event,
)
from contract.protocol import AttemptReport, LogLine
from contract.rendezvous import MEMBER_HEADER
from service.local_cluster import LocalCluster, free_port

API = "/api/v1"
KINDS = (
    "heartbeat, a node with nothing to run",
    "heartbeat, a node that runs its assignment",
    "progress report with a log line",
    "rendezvous store: set a key",
)


class Fleet:
    """The requests of each kind, against one controller."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.http = httpx.Client(base_url=cluster.url, timeout=30.0)
        nodes = [self._register(f"cost-{i}") for i in range(3)]
        spec = {"name": "cost", "task": {"name": "regression"}, "nnodes": "2"}
        admin = {"authorization": f"Bearer {cluster.admin_token}"}
        self.http.post(f"{API}/jobs", json=spec, headers=admin).raise_for_status()
        self.rdzv_id = ""  # the job's rendezvous, once placed
        held = self._placed(nodes)
        (self.runner, self.attempt_id, member_id), idle = held[0], nodes[2]
        store = f"{API}/rendezvous/{self.rdzv_id}/store/set"
        as_member = {**self.runner[1], MEMBER_HEADER: str(member_id)}
        key = {"items": [{"key": "cost", "value": "AA=="}]}
        self._report_to_start(held)
        self.step = 0
        # Both members heartbeat in turn, so that neither is lost while the other reports.
        members = itertools.cycle([node for node, _, _ in held])
        self.requests: dict[str, Callable[[], httpx.Response]] = {
            KINDS[0]: lambda: self._beat(idle, []),
            KINDS[1]: lambda: self._beat(next(members), [self.attempt_id]),
            KINDS[2]: lambda: self._progress(member_id),
            KINDS[3]: lambda: self.http.post(store, json=key, headers=as_member),
        }

    def _register(self, name: str) -> tuple[int, dict[str, str]]:
        body = {"name": name, "address": "127.0.0.1", "slots": 1, "pid": 1}
        enrol = {"authorization": f"Bearer {self.cluster.enrolment_token}"}
        response = self.http.post(f"{API}/nodes/register", json=body, headers=enrol)
        response.raise_for_status()
        answer = response.json()
        return answer["node_id"], {"authorization": f"Bearer {answer['node_token']}"}

    def _beat(self, node: tuple[int, dict[str, str]], running: list[int]) -> httpx.Response:
        body = {"running": [{"attempt_id": a, "processes": 1} for a in running]}
        return self.http.post(f"{API}/nodes/{node[0]}/heartbeat", json=body, headers=node[1])

    def _placed(
        self, nodes: list[tuple[int, dict[str, str]]]
    ) -> list[tuple[tuple[int, dict[str, str]], int, int]]:
        """The two nodes the job was placed on, each with its attempt and membership."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            held = []
            for node in nodes:
                for assignment in self._beat(node, []).json()["assignments"]:
                    held.append((node, assignment["attempt_id"], assignment["member_id"]))
                    self.rdzv_id = assignment["rendezvous"]["rdzv_id"]
            if len(held) == 2:
                return sorted(held, key=lambda h: h[2])
            time.sleep(0.2)
        raise SystemExit("the controller placed no job within 60 s")

    def _report_to_start(self, held: list[tuple[tuple[int, dict[str, str]], int, int]]) -> None:
        """Both nodes' rendezvous, and the training's start: the job is RUNNING."""
        for rank, (node, attempt_id, member) in enumerate(held):
            events: list[EventData] = [
                RendezvousComplete(world_size=2, group_rank=rank, group_world_size=2)
            ]
            if rank == 0:
                events.append(TrainingStarted(world_size=2, restart_count=0))
            self._send(node, attempt_id, member, events, []).raise_for_status()

    def _progress(self, member_id: int) -> httpx.Response:
        self.step += 1
        progress = TrainingProgress(step=self.step, loss=0.5, world_size=2, samples_per_s=64.0)
        line = LogLine(time=datetime.now(UTC), line=f"step {self.step}")
        return self._send(self.runner, self.attempt_id, member_id, [progress], [line])

    def _send(
        self,
        node: tuple[int, dict[str, str]],
        attempt_id: int,
        member_id: int,
        events: list[EventData],
        logs: list[LogLine],
    ) -> httpx.Response:
        """A report of ``events`` and ``logs``, as an agent sends it (``contract``)."""
        body = AttemptReport(
            attempt_id=attempt_id,
            member_id=member_id,
            events=[runtime_event(e) for e in events],
            logs=logs,
        )
        return self.http.post(
            f"{API}/nodes/{node[0]}/reports", json=body.model_dump(mode="json"), headers=node[1]
        )


@contextlib.contextmanager
def controller(code: Path, db: str, work: Path) -> Iterator[LocalCluster]:
    """A controller of ``code`` (one API process, its reconciler in a process of its own)
    on a fresh database, its output under ``work``."""
    with database(db, work) as url:
        env = {
            "PYTHONPATH": str(code),
            "RELAUNCH_RECONCILER_PROCESS": "true",
            "RELAUNCH_API_PROCESSES": "1",
            # The fleet is silent between its batches, seconds long: none of it is lost.
            "RELAUNCH_NODE_TIMEOUT_S": "600",
            **{f"RELAUNCH_{k.upper()}": v for k, v in url.items()},
        }
        (work / "controller").mkdir(mode=0o700)
        cluster = LocalCluster(data_dir=work / "controller", port=free_port())
        here = Path.cwd()
        os.chdir(code)  # ``python -m service.cli`` imports from where it starts
        try:
            cluster.start_controller(env)
        finally:
            os.chdir(here)
        try:
            yield cluster
        finally:
            cluster.stop_all()


def _answered(response: httpx.Response) -> None:
    if not response.is_success:
        raise SystemExit(f"{response.request.url.path}: {response.status_code} {response.text}")


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


Figures = dict[str, dict[str, list[float]]]  # by code, by kind: one figure a batch


def measure(
    codes: list[tuple[str, Path]], db: str, batches: int, per_batch: int
) -> tuple[Figures, Figures]:
    """Per code and kind, of each batch: the API process's CPU ms per request, and the ms
    a request took as this process waited for it (one at a time)."""
    costs: Figures = {name: {k: [] for k in KINDS} for name, _ in codes}
    waits: Figures = {name: {k: [] for k in KINDS} for name, _ in codes}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        fleets = []
        for i, (name, code) in enumerate(codes):
            work = Path(tmp) / str(i)
            work.mkdir()
            cluster = stack.enter_context(controller(code, db, work))
            process = psutil.Process(cluster.procs["controller"].pid)
            fleets.append((name, process, Fleet(cluster)))
        cores = os.sched_getaffinity(0)
        if len(cores) >= 2:  # this process on one core, the controllers on another
            mine, theirs = sorted(cores)[:2]
            os.sched_setaffinity(0, {mine})
            stack.callback(os.sched_setaffinity, 0, cores)
            for _, process, _ in fleets:
                process.cpu_affinity([theirs])
        for _, _, fleet in fleets:  # warm: each route's first call builds what it keeps
            for request in fleet.requests.values():
                for _ in range(50):
                    _answered(request())
        for batch in range(batches):
            # Each code goes first in every other round: what one leaves behind (the
            # database's work after a burst) is not always met by the same code.
            for name, process, fleet in fleets if batch % 2 == 0 else reversed(fleets):
                for kind, request in fleet.requests.items():
                    before, started = _cpu_s(process), time.perf_counter()
                    for _ in range(per_batch):
                        _answered(request())
                    took = time.perf_counter() - started
                    costs[name][kind].append((_cpu_s(process) - before) * 1000 / per_batch)
                    waits[name][kind].append(took * 1000 / per_batch)
    return costs, waits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--db", choices=["postgresql", "sqlite"], default="postgresql")
    parser.add_argument("--baseline-code", type=Path, help="a checkout of the code to compare")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--per-batch", type=int, default=200)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    codes = [("this code", Path(__file__).resolve().parent.parent)]
    if args.baseline_code is not None:
        codes.append(("baseline", args.baseline_code.resolve()))
    costs, waits = measure(codes, args.db, args.batches, args.per_batch)
    batches = f"median of {args.batches} batches of {args.per_batch} (quartiles)"
    _print(f"CPU ms of the API's process per request, {args.db}: {batches}", codes, costs)
    _print(f"ms a request took, one at a time, {args.db}: {batches}", codes, waits)
    for name, code in codes:
        print(f"{name}: {code}")
    if args.json is not None:
        results = {
            name: {
                "code": str(code),
                "cpu_ms_per_request_by_batch": costs[name],
                "wall_ms_per_request_by_batch": waits[name],
            }
            for name, code in codes
        }
        args.json.write_text(json.dumps(results, indent=2))


def _print(title: str, codes: list[tuple[str, Path]], figures: Figures) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("request")
    for name, _ in codes:
        table.add_column(name, justify="right")
    if len(codes) == 2:
        table.add_column("this / baseline, by round: median (rounds below 1)", justify="right")
    for kind in KINDS:
        cells = [kind]
        for name, _ in codes:
            q1, median, q3 = statistics.quantiles(figures[name][kind], n=4)
            cells.append(f"{median:.2f} ({q1:.2f} to {q3:.2f})")
        if len(codes) == 2:
            pairs = zip(*(figures[name][kind] for name, _ in codes), strict=True)
            # A batch too short for the clock's tick (10 ms) can read no CPU time at all.
            ratios = [a / b for a, b in pairs if b > 0]
            below = sum(r < 1 for r in ratios)
            middle = f"{statistics.median(ratios):.2f}" if ratios else "-"
            cells.append(f"{middle} ({below} of {len(ratios)})")
        table.add_row(*cells)
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
