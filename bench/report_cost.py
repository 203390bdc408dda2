"""What one node report costs the controller, by kind: statements sent to the database,
CPU time and wall time, in-process, with no other load.

A fresh database (PostgreSQL by default, or SQLite) and the real app without its
background loops: ``2 x --jobs`` nodes of one slot register, ``--jobs`` queued jobs of two
nodes each are written straight into the jobs table, and reconciler passes place them all.
Then each job's two nodes report its life as a simulated node does
(``bench.sim_nodes``), each report applied as the report route applies it (one
transaction, ``service.reports.handle_report``): the node of group rank 0 its rendezvous
with its training's start, the other its rendezvous, then rank 0 two progress reports
(the second with a snapshot), its training's end with its launcher's exit, and its exit;
last the other node's exit, after the job succeeded. Each job must end SUCCEEDED, with
the same timeline events as every other job.

``--baseline-code DIR`` runs the same reports, in the same run, on the code in ``DIR`` (a
checkout of another commit: ``git worktree add /tmp/base REV``) in a process of its own,
alternating with this code's for ``--rounds`` rounds, and prints the two side by side.
This file is run as a script there, importing ``service``, ``contract`` and the database
set-up of ``bench.reconcile_pass`` from ``DIR``.

    python -m bench.report_cost --jobs 200 --db postgresql
    python -m bench.report_cost --baseline-code /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.reconcile_pass import ENROLMENT, T0, database

# The kinds of report, in the order a job's life sends them.
KINDS = (
    "rendezvous and start (rank 0)",
    "rendezvous (rank 1)",
    "progress",
    "progress with a snapshot",
    "finished, launcher exited",
    "exit: succeeded (rank 0)",
    "exit: succeeded (rank 1, job over)",
)


@dataclass(frozen=True)
class Member:
    node_id: int
    token: str
    member_id: int


def measure(jobs: int, db: str) -> dict[str, Any]:
    """The reports of ``jobs`` jobs' lives on this process's code: per kind, the statements,
    CPU ms and wall ms of each report; and the timeline each job ended with."""
    from fastapi.testclient import TestClient
    from pydantic import SecretStr
    from sqlalchemy import event, insert, select

    from service.api.app import create_app
    from service.auth import create_user
    from service.db import transaction
    from service.models import Attempt, AttemptMember, Job, JobEvent, Role
    from service.reconciler import Reconciler
    from service.secrets import load_keyring, seal_spec
    from service.settings import ControllerSettings
    from service.spec import JobSpec, TaskSpec
    from service.states import AttemptState, JobState

    clock = lambda: T0  # noqa: E731  (nothing here waits: no node is ever silent)
    with tempfile.TemporaryDirectory() as tmp, database(db, Path(tmp)) as url:
        settings = ControllerSettings(
            data_dir=Path(tmp) / "data",
            enrolment_token=SecretStr(ENROLMENT),
            **url,  # type: ignore[arg-type]
        )
        app = create_app(settings, clock=clock, run_background=False)
        with TestClient(app) as api:
            factory = app.state.session_factory
            tokens: dict[int, str] = {}
            for i in range(2 * jobs):
                r = api.post(
                    "/api/v1/nodes/register",
                    json={"name": f"n{i:05d}", "address": "127.0.0.1", "slots": 1, "pid": 1},
                    headers={"authorization": f"Bearer {ENROLMENT}"},
                )
                r.raise_for_status()
                tokens[r.json()["node_id"]] = r.json()["node_token"]
            spec = JobSpec(name="r", task=TaskSpec(name="regression"), nnodes="2")
            stored = seal_spec(load_keyring(settings), spec.model_dump(mode="json"))
            with transaction(factory) as session:
                owner = create_user(session, "reports", Role.ADMIN, T0)[0]
                session.execute(
                    insert(Job),
                    [
                        {
                            "name": "r",
                            "owner_id": owner.id,
                            "spec": stored,
                            "state": JobState.PENDING,
                            "created_at": T0 + timedelta(microseconds=i),
                            "updated_at": T0,
                            "attempt_count": 0,
                            "restart_count": 0,
                            "membership_changes": 0,
                            "message": "",
                        }
                        for i in range(jobs)
                    ],
                )
            reconciler = Reconciler(factory, settings, clock)
            while reconciler.run_once():
                pass
            with transaction(factory) as session:
                rows = session.execute(
                    select(Attempt.id, AttemptMember.id, AttemptMember.node_id)
                    .join(AttemptMember, AttemptMember.attempt_id == Attempt.id)
                    .where(Attempt.state == AttemptState.RUNNING)
                    .order_by(Attempt.id, AttemptMember.id)
                ).all()
            lives: dict[int, list[Member]] = {}
            for attempt_id, member_id, node_id in rows:
                lives.setdefault(attempt_id, []).append(Member(node_id, tokens[node_id], member_id))
            if len(lives) != jobs or any(len(m) != 2 for m in lives.values()):
                raise SystemExit(f"placed {len(lives)} of {jobs} jobs on two nodes each")
            statements = [0]

            @event.listens_for(app.state.engine, "before_cursor_execute")
            def _count(*_: Any) -> None:
                statements[0] += 1

            costs: dict[str, list[tuple[int, float, float]]] = {k: [] for k in KINDS}
            for attempt_id, members in lives.items():
                for kind, member, report in _life(attempt_id, members):
                    before, cpu, wall = statements[0], time.process_time(), time.perf_counter()
                    _apply(factory, member, report)
                    costs[kind].append(
                        (
                            statements[0] - before,
                            (time.process_time() - cpu) * 1000,
                            (time.perf_counter() - wall) * 1000,
                        )
                    )
            with transaction(factory) as session:
                states = Counter(s.value for s in session.scalars(select(Job.state)))
                timelines = Counter(
                    tuple(kinds)
                    for kinds in _timelines(
                        session.execute(
                            select(JobEvent.job_id, JobEvent.kind).order_by(JobEvent.id)
                        ).all()
                    ).values()
                )
    return {
        "costs": costs,
        "job_states": dict(states),
        "timelines": [[list(k), n] for k, n in timelines.items()],
    }


def _timelines(rows: Sequence[Any]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for job_id, kind in rows:
        out.setdefault(job_id, []).append(kind)
    return out


def _life(attempt_id: int, members: list[Member]) -> Iterator[tuple[str, Member, Any]]:
    """A job's reports, as ``bench.sim_nodes`` sends them, each with its kind and sender."""
    from contract.events import (
        LauncherExited,
        RendezvousComplete,
        SnapshotSaved,
        TrainingFinished,
        TrainingProgress,
        TrainingStarted,
        runtime_event,
    )
    from contract.protocol import AttemptExit, AttemptReport, LogLine

    first, second = members
    now = T0 + timedelta(seconds=1)

    def report(who: Member, events: list[Any], logs: list[str], exit: Any = None) -> Any:
        return AttemptReport(
            attempt_id=attempt_id,
            member_id=who.member_id,
            events=[runtime_event(e, now) for e in events],
            logs=[LogLine(time=now, line=line) for line in logs],
            exit=exit,
        )

    def rdzv(rank: int) -> Any:
        return RendezvousComplete(world_size=2, group_rank=rank, group_world_size=2)

    started = TrainingStarted(world_size=2, restart_count=0, total_steps=20)
    yield KINDS[0], first, report(first, [rdzv(0), started], ["training started"])
    yield KINDS[1], second, report(second, [rdzv(1)], [])
    progress = TrainingProgress(step=5, loss=0.2, world_size=2, samples_per_s=128.0)
    yield KINDS[2], first, report(first, [progress], ["step 5"])
    snapshot = SnapshotSaved(step=10, world_size=2, path=f"/s/{attempt_id}/10", bytes=2**20)
    progress = TrainingProgress(step=10, loss=0.1, world_size=2, samples_per_s=128.0)
    yield KINDS[3], first, report(first, [progress, snapshot], ["step 10"])
    ended = [TrainingFinished(step=20, loss=0.05), LauncherExited(outcome="succeeded")]
    yield KINDS[4], first, report(first, ended, [])
    succeeded = AttemptExit(outcome="succeeded", exit_code=0)
    yield KINDS[5], first, report(first, [], [], succeeded)
    yield KINDS[6], second, report(second, [], [], succeeded)


def _apply(factory: Any, member: Member, report: Any) -> None:
    """As the report route applies it."""
    from service.db import retry_on_stale
    from service.reports import handle_report

    now = T0 + timedelta(seconds=2)
    retry_on_stale(factory, lambda s: handle_report(s, member.node_id, report, now, member.token))


def _run_elsewhere(code: Path, jobs: int, db: str) -> dict[str, Any]:
    """``measure`` in a process that imports ``service`` and ``contract`` from ``code``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "PYTHONPATH": str(code)}
        subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--jobs",
                str(jobs),
                "--db",
                db,
                "--measure-only",
                str(out),
            ],
            cwd=code,
            env=env,
            check=True,
        )
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _summary(runs: list[dict[str, Any]]) -> dict[str, tuple[float, float, float]]:
    """Per kind, over every run: the median statements, CPU ms and wall ms of a report."""
    out = {}
    for kind in KINDS:
        costs = [c for run in runs for c in run["costs"][kind]]
        statements, cpu, wall = (statistics.median(c[i] for c in costs) for i in range(3))
        out[kind] = (statements, cpu, wall)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--db", choices=["postgresql", "sqlite"], default="postgresql")
    parser.add_argument(
        "--baseline-code",
        type=Path,
        help="a checkout of the code to compare against, run in the same run",
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs of each code, alternating")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--measure-only", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_only is not None:
        args.measure_only.write_text(json.dumps(measure(args.jobs, args.db)))
        return
    here = Path(__file__).resolve().parent.parent
    codes = [("this code", here)]
    if args.baseline_code is not None:
        codes.append(("baseline", args.baseline_code.resolve()))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in codes}
    for _ in range(args.rounds):
        for name, code in codes:
            runs[name].append(_run_elsewhere(code, args.jobs, args.db))
    summaries = {name: _summary(r) for name, r in runs.items()}
    _print(args, codes, runs, summaries)
    if args.json is not None:
        results = {
            name: {
                "code": str(code),
                "per_report": {
                    kind: dict(zip(("statements", "cpu_ms", "wall_ms"), cost, strict=True))
                    for kind, cost in summaries[name].items()
                },
                "job_states": [r["job_states"] for r in runs[name]],
                "timelines": [r["timelines"] for r in runs[name]],
            }
            for name, code in codes
        }
        args.json.write_text(json.dumps(results, indent=2))


def _print(
    args: argparse.Namespace,
    codes: list[tuple[str, Path]],
    runs: dict[str, list[dict[str, Any]]],
    summaries: dict[str, dict[str, tuple[float, float, float]]],
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(100, 36 * len(codes) + 40))
    title = (
        f"one node report, applied as the route applies it: {args.jobs} jobs of two nodes, "
        f"{args.db}, {args.rounds} run(s) of each code; medians"
    )
    table = Table(title=title)
    table.add_column("report")
    for name, _ in codes:
        table.add_column(f"{name}: statements", justify="right")
        table.add_column("CPU ms", justify="right")
        table.add_column("wall ms", justify="right")
    for kind in KINDS:
        cells = [kind]
        for name, _ in codes:
            statements, cpu, wall = summaries[name][kind]
            cells += [f"{statements:g}", f"{cpu:.2f}", f"{wall:.2f}"]
        table.add_row(*cells)
    console.print(table)
    life_cpu = {name: sum(summaries[name][k][1] for k in KINDS) for name, _ in codes}
    for name, code in codes:
        life_statements = sum(summaries[name][k][0] for k in KINDS)
        last = runs[name][-1]
        console.print(
            f"{name} ({code}): a job's {len(KINDS)} reports {life_statements:g} statements, "
            f"{life_cpu[name]:.1f} ms of CPU (sum of medians); jobs at the end "
            f"{last['job_states']}; {len(last['timelines'])} distinct timeline(s)"
        )
    if len(codes) == 2:
        ratio = life_cpu["baseline"] / life_cpu["this code"]
        console.print(f"a job's reports cost the baseline {ratio:.2f}x this code's CPU")
        same = {json.dumps(r["timelines"]) for rs in runs.values() for r in rs}
        console.print(
            "every run's jobs ended with the same timelines"
            if len(same) == 1
            else "the timelines DIFFER between runs"
        )


if __name__ == "__main__":
    main()
