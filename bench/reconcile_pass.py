"""One reconciler pass over a deep queue, in-process: the head read against a whole read.

A fresh database (PostgreSQL by default, or SQLite) and the real app without its
background loops: ``--nodes`` nodes of one slot register, ``--jobs`` queued jobs of one
node each are written straight into the jobs table (as a submit stores them), and a first
pass places a job on every node. Then, with every node held and nothing to do, it times
``--passes`` passes as the reconciler runs them now (the queue's head: no page read, as no
node is free) and as many passes that read the queue whole (what every pass did before),
interleaved; then a pass after each of ``--passes`` jobs finished (one node free: one job
placed), both ways. Last, ``--reps`` times each way in turn, ``--free`` jobs finish and one
pass places as many: its placements applied in batches (``PLACE_BATCH``, as now) or one
per transaction (``place_batch = 1``, as before). No other load: this is what a pass costs
the controller, not what it costs on a busy one (``bench.control_plane``). Python's garbage
collector runs as in the reconciler's process: what the start made frozen, the youngest
objects scanned at ``RELAUNCH_GC_YOUNG_THRESHOLD``.

    python -m bench.reconcile_pass --nodes 1000 --jobs 10000 --db postgresql
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

import psycopg
from cryptography.fernet import Fernet
from fastapi.testclient import TestClient
from pydantic import SecretStr
from rich.console import Console
from rich.table import Table
from sqlalchemy import insert, select

from bench.status_load import quantile
from service.api.app import create_app
from service.auth import create_user
from service.db import transaction
from service.gc_pauses import collect_young_after, freeze_what_started
from service.models import Attempt, Job, Role
from service.reconciler import PLACE_BATCH, PlaceJob, Reconciler
from service.secrets import load_keyring, seal_spec
from service.settings import ControllerSettings
from service.spec import JobSpec, TaskSpec
from service.states import AttemptState, JobState, MemberState

console = Console(width=None if sys.stdout.isatty() else 130)
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/test"
ENROLMENT = "enrol-" + "b" * 32
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@contextmanager
def database(kind: str, work: Path) -> Iterator[dict[str, str]]:
    """Settings for a fresh database of ``kind``; a PostgreSQL one is dropped after."""
    if kind == "sqlite":
        yield {"database_url": f"sqlite:///{work / 'relaunch.db'}"}
        return
    name = f"relaunch_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield {
            "database_url": f"{PG_ADMIN_URL.rsplit('/', 1)[0]}/{name}",
            "secrets_keys": Fernet.generate_key().decode(),
        }
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Sample(NamedTuple):
    """One pass's time in ms: wall, and on a CPU (its thread's)."""

    wall: float
    cpu: float


def timed(reconciler: Reconciler) -> tuple[Sample, list[object]]:
    """One pass: its times, and its actions."""
    start, cpu = time.perf_counter(), time.thread_time()
    actions: list[object] = list(reconciler.run_once())
    took = Sample((time.perf_counter() - start) * 1000, (time.thread_time() - cpu) * 1000)
    return took, actions


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=10000)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--db", choices=["postgresql", "sqlite"], default="postgresql")
    parser.add_argument("--free", type=int, default=200, help="jobs placed by one pass")
    parser.add_argument("--reps", type=int, default=3, help="such passes each way")
    args = parser.parse_args(argv)
    clock = lambda: T0  # noqa: E731  (nothing here waits: no node is ever silent)
    with tempfile.TemporaryDirectory() as tmp, database(args.db, Path(tmp)) as db:
        settings = ControllerSettings(
            data_dir=Path(tmp) / "data",
            enrolment_token=SecretStr(ENROLMENT),
            **db,  # type: ignore[arg-type]
        )
        app = create_app(settings, clock=clock, run_background=False)
        with TestClient(app) as api:
            factory = app.state.session_factory
            rows = _seed(api, settings, factory, args.nodes, args.jobs)
            reconciler = Reconciler(factory, settings, clock)
            # The collector as the reconciler's process sets it at its start.
            if settings.gc_freeze:
                freeze_what_started()
            thresholds = collect_young_after(settings.gc_young_threshold)
            try:
                t = _time_passes(reconciler, factory, args)
            finally:
                gc.set_threshold(*thresholds)
                if settings.gc_freeze:
                    gc.unfreeze()
    table = Table(title=f"one reconciler pass: {args.nodes} nodes, {rows} queued jobs, {args.db}")
    for column in ("pass", "reads of the queue", "p50 ms", "p99 ms", "CPU p50 ms", "passes"):
        table.add_column(column)
    table.add_row(
        "first of a term: places a job on every node",
        "whole",
        f"{t.first.wall:.0f}",
        "",
        f"{t.first.cpu:.0f}",
        "1",
    )
    for what, reads, values in (
        ("nothing to do (every node held)", "head (no page)", t.head),
        ("nothing to do (every node held)", "whole (as before)", t.whole),
        ("one node freed: places one job", "head (one page)", t.placing_head),
        ("one node freed: places one job", "whole (as before)", t.placing_whole),
    ):
        walls = [v.wall for v in values]
        table.add_row(
            what,
            reads,
            f"{wall(values):.1f}",
            f"{quantile(sorted(walls), 0.99):.1f}",
            f"{statistics.median(v.cpu for v in values):.1f}",
            str(len(values)),
        )
    for what, values in (
        (f"{args.free} nodes freed: places {args.free} jobs, {PLACE_BATCH} a batch", t.batched),
        (f"{args.free} nodes freed: places {args.free} jobs, one a transaction", t.one_by_one),
    ):
        walls = [v.wall for v in values]
        table.add_row(
            what,
            "head",
            f"{wall(values):.1f}",
            f"{max(walls):.1f} (max)",
            f"{statistics.median(v.cpu for v in values):.1f}",
            str(len(values)),
        )
    console.print(table)
    console.print(
        f"placing {args.free} jobs, batches against one a transaction: "
        f"{wall(t.one_by_one) / wall(t.batched):.1f}x faster (medians)"
    )
    ratio = wall(t.whole) / wall(t.head)
    console.print(
        f"with nothing to do, a whole read's pass takes {ratio:.1f}x a head read's (medians)"
    )


def wall(samples: list[Sample]) -> float:
    """The median wall time of ``samples``."""
    return statistics.median(s.wall for s in samples)


@dataclass
class Timings:
    """Each kind of pass's times."""

    first: Sample  # the first of a term: reads the queue whole, places
    head: list[Sample] = field(default_factory=list)  # nothing to do
    whole: list[Sample] = field(default_factory=list)  # nothing to do, the queue read whole
    placing_head: list[Sample] = field(default_factory=list)  # one job finished
    placing_whole: list[Sample] = field(default_factory=list)
    batched: list[Sample] = field(default_factory=list)  # ``--free`` jobs finished
    one_by_one: list[Sample] = field(default_factory=list)


def _time_passes(reconciler: Reconciler, factory: object, args: argparse.Namespace) -> Timings:
    t = Timings(first=timed(reconciler)[0])
    for _ in range(args.passes):
        t.head.append(timed(reconciler)[0])
        reconciler._whole_read = None  # the next pass reads the queue whole
        t.whole.append(timed(reconciler)[0])
    running = _running(factory)
    for i in range(args.passes):
        placing = t.placing_head if i % 2 == 0 else t.placing_whole
        _finish(factory, running.pop())
        if placing is t.placing_whole:
            reconciler._whole_read = None
        took, actions = timed(reconciler)
        assert [type(a) for a in actions] == [PlaceJob], actions
        placing.append(took)
    for i in range(2 * args.reps):
        many = t.batched if i % 2 == 0 else t.one_by_one
        reconciler.place_batch = PLACE_BATCH if many is t.batched else 1
        running = _running(factory)
        for attempt_id in running[: args.free]:
            _finish(factory, attempt_id)
        took, actions = timed(reconciler)
        assert [type(a) for a in actions] == [PlaceJob] * args.free, len(actions)
        many.append(took)
    return t


def _seed(
    api: TestClient, settings: ControllerSettings, factory: object, nodes: int, jobs: int
) -> int:
    for i in range(nodes):
        r = api.post(
            "/api/v1/nodes/register",
            json={"name": f"n{i:05d}", "address": "127.0.0.1", "slots": 1, "pid": 1},
            headers={"authorization": f"Bearer {ENROLMENT}"},
        )
        r.raise_for_status()
    spec = JobSpec(name="q", task=TaskSpec(name="regression"), nnodes="1")
    stored = seal_spec(load_keyring(settings), spec.model_dump(mode="json"))
    with transaction(factory) as session:  # type: ignore[arg-type]
        owner = create_user(session, "queue", Role.ADMIN, T0)[0]
        session.execute(
            insert(Job),
            [
                {
                    "name": "q",
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
    return jobs


def _running(factory: object) -> list[int]:
    """The running attempts' ids."""
    with transaction(factory) as session:  # type: ignore[arg-type]
        stmt = select(Attempt.id).where(Attempt.state == AttemptState.RUNNING)
        return list(session.scalars(stmt))


def _finish(factory: object, attempt_id: int) -> None:
    """The attempt succeeded and its members left, as their exit reports would have it:
    its node is free."""
    with transaction(factory) as session:  # type: ignore[arg-type]
        attempt = session.get_one(Attempt, attempt_id)
        for member in attempt.members:
            member.state, member.left_at, member.exit_code = MemberState.LEFT, T0, 0
        attempt.state, attempt.ended_at = AttemptState.SUCCEEDED, T0
        attempt.job.state, attempt.job.finished_at = JobState.SUCCEEDED, T0


if __name__ == "__main__":
    main()
