"""Control plane under load: many simulated nodes and a deep queue against one controller.

A real controller process (as ``service.local_cluster`` starts it) on SQLite or
PostgreSQL; ``--jobs`` jobs (nnodes 1:2, spread over users of 100 jobs each) are
submitted and queue; ``--nodes`` simulated node agents (``bench.sim_nodes``: the
real node protocol over HTTP, no torch) register, heartbeat at the controller's
interval, run what they are assigned and report on it until it succeeds. For
``--seconds`` it measures:

- the reconciler's pass time, from the controller's own histogram
  (``relaunch_reconcile_pass_seconds``, the delta over the run): p50 and p99 as
  Prometheus' ``histogram_quantile`` estimates them from the buckets, the mean
  exactly, and the share of passes within the target (a bucket bound, so exact);
- the heartbeat's answer time as the nodes see it (each request timed);
- reads of the job list and of one job's detail, plain and with If-None-Match, by
  ``--readers`` polling processes, a quarter of the run each;
- the controller's CPU (share of one core) and its resident memory.

    python -m bench.control_plane --nodes 200 --jobs 2000 --db sqlite --seconds 60 \\
        --json control-plane.json

``--baseline-fixed-interval`` runs the same load twice, back to back: first with the
heartbeat pace off (every node told the base interval, as before the pace), then as
configured, and prints the two side by side; each ``--baseline-*`` flag does the same for
what it names. ``--api-processes N`` answers the API on N processes
(``RELAUNCH_API_PROCESSES``), with the 40 API threads shared out among them so that their
database pools stay within PostgreSQL's default 100 connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import math
import multiprocessing
import os
import re
import secrets
import statistics
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
from cryptography.fernet import Fernet
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from bench.sim_nodes import (
    REGISTER_TIMEOUT_S,
    FleetStats,
    Registrations,
    Rendezvous,
    SimNode,
    Training,
)
from bench.status_load import quantile
from service.api_processes import PROCESS_NAME as API_HELPER_NAME
from service.gc_pauses import CollectionTimer
from service.local_cluster import LocalCluster, free_port
from service.settings import RESERVED_CONNECTIONS, ControllerSettings
from worker.client import KEEP_ALIVE_S

console = Console()
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/test"
JOBS_PER_USER = 100
# What a node agent waits for an answer (worker.client's default) before it gives up.
AGENT_TIMEOUT_S = 5.0
# This Python's own first garbage-collection threshold (700 in 3.11), as this process,
# which has not changed it, reads it: the controller runs on the same interpreter.
PYTHON_GC_YOUNG_THRESHOLD = gc.get_threshold()[0]
# The most reads one reader at a fixed rate has under way at once.
READER_CONNECTIONS_MAX = 64
# The API threads that several API processes share out (the controller's default for one).
API_THREADS_SHARED = 40
# What the controller's processes may hold of PostgreSQL's connections (100, less the 3 kept
# for superusers): each API process a pool of its API threads, its heartbeat threads and
# ``RESERVED_CONNECTIONS``, and a pool of its heartbeat threads' own (their commits do not
# wait for the disk); the reconciler's process ``RESERVED_CONNECTIONS``. At the
# controller's default heartbeat threads.
PG_CONNECTIONS = 97
HEARTBEAT_THREADS: int = ControllerSettings.model_fields["heartbeat_threads"].default
API_PROCESS_CONNECTIONS_BESIDE_THREADS = 2 * HEARTBEAT_THREADS + RESERVED_CONNECTIONS
RECONCILER_CONNECTIONS = RESERVED_CONNECTIONS
# The targets, at 1,000 nodes and 10,000 jobs on PostgreSQL.
RECONCILE_P99_TARGET_MS = 100.0
HEARTBEAT_P99_TARGET_MS = 50.0


def node_limits(keep_alive_s: float = KEEP_ALIVE_S) -> httpx.Limits:
    """A simulated node's connections: a few, since its heartbeat and its reports may be
    under way at once; an idle one is kept ``keep_alive_s``, as an agent keeps it
    (``worker.client.KEEP_ALIVE_S``) unless told less."""
    return httpx.Limits(
        max_connections=4,
        max_keepalive_connections=4,
        keepalive_expiry=min(KEEP_ALIVE_S, keep_alive_s),
    )


@dataclass(frozen=True)
class Options:
    nodes: int = 20
    jobs: int = 100
    db: str = "sqlite"
    seconds: float = 30.0
    readers: int = 1
    # Each reader's reads a second, sent on a fixed schedule (an open loop); None: back to
    # back, each read sent when the last is answered.
    read_rate: float | None = None
    training: Training = field(default_factory=Training)
    pg_admin_url: str = PG_ADMIN_URL
    work_dir: Path | None = None  # kept, with the controller's log; default: a temporary one
    # RELAUNCH_HEARTBEATS_PER_S_MAX of the controller; None: its default.
    heartbeats_per_s_max: float | None = None
    # What a node's registration waits for its answer, and whether its tries carry a
    # registration key (as agents' do).
    register_timeout_s: float = REGISTER_TIMEOUT_S
    registration_key: bool = True
    # RELAUNCH_RECONCILER_PROCESS: the reconciler in a child process (the default) or on a
    # thread of the API's process.
    reconciler_process: bool = True
    # RELAUNCH_GC_FREEZE: what the controller made at start left out of garbage collections.
    gc_freeze: bool = True
    # RELAUNCH_GC_YOUNG_THRESHOLD of the controller; None: its default.
    gc_young_threshold: int | None = None
    # RELAUNCH_DATABASE_PING_AFTER_IDLE_S=0 (a ping at every loan of a pooled connection)
    # and RELAUNCH_HEARTBEAT_ONE_STATEMENT=false (a heartbeat is a transaction of two).
    every_round_trip: bool = False
    # RELAUNCH_HEARTBEAT_SYNCHRONOUS_COMMIT of the controller; None: its default.
    heartbeat_synchronous_commit: bool | None = None
    # RELAUNCH_HEARTBEAT_THREADS of the controller; None: its default.
    heartbeat_threads: int | None = None
    # RELAUNCH_HEARTBEAT_WAIT_MAX_S of the controller (0: no heartbeat shed); None: default.
    heartbeat_wait_max_s: float | None = None
    # RELAUNCH_KEEP_ALIVE_S of the controller, and how long the nodes keep an idle
    # connection (at most this); None: the defaults, the agents' (60 s).
    keep_alive_s: int | None = None
    # RELAUNCH_API_PROCESSES and RELAUNCH_API_THREADS (per process); None: the defaults.
    api_processes: int | None = None
    api_threads: int | None = None
    # Seconds the fleet runs after the last registration before the measurement starts:
    # the burst of the fleet's start (every node free at once, a placement wave, its
    # reports) drains meanwhile; the heartbeats it saw are reported apart.
    settle_s: float = 30.0
    # Whether this process's garbage collector is held while the fleet settles and is
    # measured (``_collector_held``). The simulated nodes stand for as many agent processes:
    # one pause of this process stops them all at once, which no real fleet does.
    hold_own_collector: bool = True
    # An open loop: at most this many runs train at once, each on a fixed clock, and the
    # runs assigned beyond them wait their turn (``SimNode``'s ``turns``). While the fleet
    # holds more runs than this, the reports it sends do not depend on how fast the
    # controller answers, so two codes are given the same load. None: the closed loop.
    runs_at_once: int | None = None
    # The tree the controller imports its code from (a checkout of another commit, for
    # ``--baseline-code``); None: this bench's own, ``CODE_ROOT``.
    code: str | None = None
    # The cores the controller's processes run on, and no other process of the bench's:
    # the simulated fleet, its readers and PostgreSQL's server run on the machine's others
    # (``cores_apart``), as a controller's host is apart from its fleet's and its
    # database's. None: every process on every core.
    controller_cores: tuple[int, ...] | None = None
    # ``Training.step_spread`` of the simulated runs: each attempt's steps last ``step_s``
    # times a factor of its own within 1 -/+ this, so that runs end and start spread over
    # time rather than in waves. 0: every run the same length.
    step_spread: float = 0.5


@dataclass(frozen=True)
class ReadPhase:
    name: str
    path: str
    conditional: bool


# The tree this bench is in. The controller and every process it starts import their code
# from it (``PYTHONPATH``), or from ``--baseline-code``'s for that run, so that every
# process runs the code meant: the reconciler's process and the API's helpers start with
# ``python -P``, which leaves the working directory off the path, and would import what the
# environment has installed.
CODE_ROOT = Path(__file__).resolve().parents[1]

# The phases of a pass (``relaunch_reconcile_phase_seconds``): its lease, reading the
# nodes and placed jobs, reading the queue, planning, applying; "load" is the two reads
# together, as controllers timed them before they were timed apart.
RECONCILE_PHASES = ("lease", "fleet", "queue", "load", "plan", "apply")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def run(options: Options) -> dict[str, Any]:
    """Start a controller, load it as ``options`` says, and return what was measured."""
    with tempfile.TemporaryDirectory(prefix="relaunch-bench-cp-") as temporary:
        work = options.work_dir or Path(temporary)
        metrics_token = secrets.token_urlsafe(32)
        with started_controller(options, work, metrics_token) as cluster:
            result = asyncio.run(_measure(cluster, options, metrics_token))
    result["options"] = {
        k: v for k, v in asdict(options).items() if k not in ("pg_admin_url", "work_dir")
    }
    return result


@contextmanager
def started_controller(options: Options, work: Path, metrics_token: str) -> Iterator[LocalCluster]:
    """A controller on a database of its own (PostgreSQL: a fresh one, dropped after)."""
    env = {
        "RELAUNCH_METRICS_TOKEN": metrics_token,
        "RELAUNCH_RECONCILER_PROCESS": "true" if options.reconciler_process else "false",
        "RELAUNCH_GC_FREEZE": "true" if options.gc_freeze else "false",
    }
    if options.gc_young_threshold is not None:
        env["RELAUNCH_GC_YOUNG_THRESHOLD"] = str(options.gc_young_threshold)
    if options.heartbeat_threads is not None:
        env["RELAUNCH_HEARTBEAT_THREADS"] = str(options.heartbeat_threads)
    if options.heartbeat_wait_max_s is not None:
        env["RELAUNCH_HEARTBEAT_WAIT_MAX_S"] = f"{options.heartbeat_wait_max_s:g}"
    if options.keep_alive_s is not None:
        env["RELAUNCH_KEEP_ALIVE_S"] = str(options.keep_alive_s)
    if options.api_processes is not None:
        env["RELAUNCH_API_PROCESSES"] = str(options.api_processes)
    if options.api_threads is not None:
        env["RELAUNCH_API_THREADS"] = str(options.api_threads)
    if options.every_round_trip:
        env["RELAUNCH_DATABASE_PING_AFTER_IDLE_S"] = "0"
        env["RELAUNCH_HEARTBEAT_ONE_STATEMENT"] = "false"
    if options.heartbeat_synchronous_commit is not None:
        env["RELAUNCH_HEARTBEAT_SYNCHRONOUS_COMMIT"] = str(
            options.heartbeat_synchronous_commit
        ).lower()
    if options.heartbeats_per_s_max is not None:
        env["RELAUNCH_HEARTBEATS_PER_S_MAX"] = f"{options.heartbeats_per_s_max:g}"
    # The controller is started with ``python -m``, which would put the working directory
    # (this tree) first on its path: ``PYTHONSAFEPATH`` leaves it off, as ``-P`` does.
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [options.code or str(CODE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    database = None
    if options.db == "postgresql":
        database = f"relaunch_bench_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(options.pg_admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{database}"')
        env["RELAUNCH_DATABASE_URL"] = f"{options.pg_admin_url.rsplit('/', 1)[0]}/{database}"
        env["RELAUNCH_SECRETS_KEYS"] = Fernet.generate_key().decode()
    (work / "controller").mkdir(mode=0o700, parents=True, exist_ok=True)
    cluster = LocalCluster(data_dir=work / "controller", port=free_port())
    try:
        with cores_apart(options.controller_cores, database_processes) as controller_side:
            with controller_side():
                cluster.start_controller(env)
            yield cluster
    finally:
        cluster.stop_all()
        if database is not None:
            with psycopg.connect(options.pg_admin_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def database_processes() -> list[psutil.Process]:
    """The PostgreSQL server's processes living now: its postmaster (whose new backends
    are forked with its affinity) and its backends."""
    return [p for p in psutil.process_iter(["name"]) if p.info["name"] == "postgres"]


def split_cores(chosen: Iterable[int], allowed: Iterable[int]) -> tuple[set[int], set[int]]:
    """``chosen`` cores for the controller and the rest of ``allowed`` for everything
    else; refused (ValueError, with what to change) unless both sides have a core."""
    mine, every = set(chosen), set(allowed)
    if not mine:
        raise ValueError("give at least one core to the controller")
    if not mine <= every:
        raise ValueError(
            f"cores {sorted(mine - every)} are not this process's to use "
            f"(it may run on {sorted(every)})"
        )
    if not every - mine:
        raise ValueError(
            f"no core left for the fleet and the database: give the controller fewer than "
            f"all of {sorted(every)}"
        )
    return mine, every - mine


@contextmanager
def cores_apart(
    controller_cores: Iterable[int] | None,
    others: Callable[[], Iterable[psutil.Process]] = database_processes,
) -> Iterator[Callable[[], contextlib.AbstractContextManager[None]]]:
    """The controller on ``controller_cores`` and everything else on the other cores.

    Yields a context manager to start the controller in: within it this process runs on
    the controller's cores, so that the controller and every process it forks inherit
    them; outside it, this process (the simulated fleet, and the readers it starts) and
    the ``others`` (the database's server) run on the rest. Every affinity is put back
    on leaving. With no ``controller_cores``, nothing is moved."""
    if controller_cores is None:
        yield contextlib.nullcontext
        return
    allowed = os.sched_getaffinity(0)
    mine, rest = split_cores(controller_cores, allowed)
    moved: list[tuple[psutil.Process, list[int]]] = []

    @contextmanager
    def controller_side() -> Iterator[None]:
        os.sched_setaffinity(0, mine)
        try:
            yield
        finally:
            os.sched_setaffinity(0, rest)

    os.sched_setaffinity(0, rest)
    try:
        for process in others():
            with contextlib.suppress(psutil.Error):
                before = process.cpu_affinity()
                process.cpu_affinity(sorted(rest))
                moved.append((process, before))
        yield controller_side
    finally:
        for process, before in moved:
            with contextlib.suppress(psutil.Error):
                process.cpu_affinity(before)
        os.sched_setaffinity(0, allowed)


async def _measure(cluster: LocalCluster, options: Options, metrics_token: str) -> dict[str, Any]:
    assert cluster.admin_token is not None
    admin = {"authorization": f"Bearer {cluster.admin_token}"}
    async with (
        httpx.AsyncClient(base_url=cluster.url, timeout=120.0) as http,
        contextlib.AsyncExitStack() as clients,
    ):
        # A client per node, as each agent has: one client for the whole fleet looks through
        # its every connection for each request, and at 1,000 nodes that kept the bench's
        # own loop busy, which the nodes' timings then counted as the controller's.
        limits = node_limits(options.keep_alive_s or KEEP_ALIVE_S)
        fleet = [
            await clients.enter_async_context(
                httpx.AsyncClient(base_url=cluster.url, timeout=AGENT_TIMEOUT_S, limits=limits)
            )
            for _ in range(options.nodes)
        ]
        started = time.monotonic()
        job_ids = await _submit_jobs(http, admin, options.jobs)
        submit_s = time.monotonic() - started

        stats = FleetStats()
        rendezvous = Rendezvous()
        token = cluster.enrolment_token
        turns = asyncio.Semaphore(options.runs_at_once) if options.runs_at_once else None
        training = replace(
            options.training, fixed_clock=turns is not None, step_spread=options.step_spread
        )
        nodes = [
            SimNode(f"sim-{i:05d}", fleet[i], token, training, rendezvous, stats, turns)
            for i in range(options.nodes)
        ]
        # Each node heartbeats from its registration on, as an agent does (a node silent
        # until the whole fleet had registered was lost); the measurement starts once all
        # have registered, and ends at ``until[0]``.
        until = [math.inf]
        serving: list[asyncio.Task[None]] = []

        registrations = Registrations()

        async def join(node: SimNode) -> None:
            await node.register(
                timeout_s=options.register_timeout_s,
                with_key=options.registration_key,
                counts=registrations,
            )
            serving.append(asyncio.create_task(node.serve(lambda: until[0])))

        started = time.monotonic()
        try:
            await _bounded(32, [join(node) for node in nodes])
        except BaseException:
            until[0] = 0.0  # the nodes that serve stop at their next heartbeat
            await asyncio.gather(*serving, return_exceptions=True)
            raise
        register_s = time.monotonic() - started

        controller = psutil.Process(cluster.procs["controller"].pid)
        code = code_roots(controller)
        me = psutil.Process()
        phases = _read_phases(job_ids[0])
        pool = (
            multiprocessing.get_context("spawn").Pool(options.readers) if options.readers else None
        )
        try:
            # The readers are up, and a reader that ran ``_reader_ready`` has imported this
            # module (what ``poll`` needs; with one reader, the default, that is every
            # reader); meanwhile the nodes waited (this blocks the loop), so the settling
            # counts from here.
            if pool is not None:
                pool.starmap(_reader_ready, [()] * options.readers)
            if options.hold_own_collector:
                _hold_collector()
            await asyncio.sleep(options.settle_s)
            before = await _scrape(http, metrics_token)
            cpu_before, my_cpu_before = _cpu_split(controller), _cpu(me)
            machine_before, database_before = psutil.cpu_times(), _database_cpu()
            start, measured_from = time.monotonic(), time.time()
            until[0] = start + options.seconds
            start_beats = (stats.heartbeat_ms, stats.heartbeat_timeouts, start - started)
            stats.reset()
            rss: list[int] = []
            running: list[tuple[int, int]] = []
            latest: list[tuple[float, Samples]] = []
            lags: list[tuple[float, float]] = []
            own_gc = _OwnCollections()  # this process's collections while it measures
            with own_gc.installed():
                reads, *_ = await asyncio.gather(
                    asyncio.to_thread(
                        _read, pool, cluster.url, cluster.admin_token, phases, options, time.time()
                    )
                    if pool is not None
                    else _no_reads(),
                    _watch_metrics(http, metrics_token, until[0], latest),
                    _sample_rss(controller, until[0], rss),
                    _sample_running(stats, until[0], running),
                    _sample_lag(until[0], lags),
                    *serving,
                )
            wall = time.monotonic() - start
            cpu_after = _cpu_split(controller)
            cpu = (
                cpu_after[0] - cpu_before[0],
                cpu_after[1] - cpu_before[1],
                cpu_after[2] - cpu_before[2],
            )
            my_cpu = _cpu(me) - my_cpu_before
            machine = _machine_shares(machine_before, psutil.cpu_times())
            machine["database_server_share_of_one_core"] = (
                _cpu_since(database_before, _database_cpu()) / wall
            )
            try:
                after = await asyncio.wait_for(_scrape(http, metrics_token), 30.0)
                metrics_s = time.monotonic() - start
            except (httpx.HTTPError, TimeoutError) as exc:
                console.print(f"/metrics did not answer at the end ({exc!r})")
                # The last scrape that answered; none: nothing of the controller's own.
                metrics_s, after = (latest[-1][0] - start, latest[-1][1]) if latest else (0, before)
        finally:
            gc.enable()
            gc.unfreeze()
            if pool is not None:
                pool.terminate()
    result = _result(
        before, after, stats, reads, wall, cpu, my_cpu, rss, submit_s, register_s, options
    )
    result["reconcile"]["measured_over_s"] = metrics_s
    # When the window began (Unix time): its seconds, as the slowest heartbeats' are
    # numbered, matched against a server's own logs.
    result["measured_from"] = measured_from
    result["setup"]["fleet_start"] = fleet_start(*start_beats, options.settle_s)
    result["machine"] = machine
    result["setup"]["registrations"] = vars(registrations)
    result["offered"] = offered(stats, running, wall, start)
    result["reconcile"]["slow_passes_logged"] = slow_passes(cluster)
    result["code"] = {"root": options.code or str(CODE_ROOT), "processes_by_root": code}
    late_ms = [lag for _, lag in lags]
    result["heartbeat"]["tail"]["during_own_stalls"] = during_stalls(
        stats.heartbeat_sent, result["heartbeat"]["p99_ms"], lags
    )
    result["bench_loop"] = {
        "lag_p99_ms": quantile(late_ms, 0.99),
        "lag_max_ms": max(late_ms, default=float("nan")),
        "stalls_over_50_ms": sum(lag > STALL_MS for lag in late_ms),
        "collections": len(own_gc.pauses_ms),
        "collections_ms": sum(own_gc.pauses_ms),
        "collection_max_ms": max(own_gc.pauses_ms, default=0.0),
    }
    return result


LAG_TICK_S = 0.01
# A tick of this process's loop woken later than this (ms) is a stall.
STALL_MS = 50.0


def _hold_collector() -> None:
    """Collect once, then leave what this process holds out of later collections and run
    none until ``gc.enable``: a collection stops every simulated node in this process at
    once (one took up to 165 ms at 1,000 nodes), then their heartbeats due meanwhile
    reach the controller together, a burst no fleet of separate agents sends. Reference
    counting still frees what is not in a cycle; the cycles made in the window (about
    70 s) wait for the end of the run."""
    gc.collect()
    gc.freeze()
    gc.disable()


async def _sample_lag(until: float, lags: list[tuple[float, float]]) -> None:
    """When this process's event loop woke a sleep of ``LAG_TICK_S`` (``time.monotonic``)
    and how late (ms), until ``until``: its simulated nodes send and read nothing while it
    is late."""
    while time.monotonic() < until:
        asked = time.perf_counter()
        await asyncio.sleep(LAG_TICK_S)
        lags.append((time.monotonic(), (time.perf_counter() - asked - LAG_TICK_S) * 1000))


def during_stalls(
    beats: list[tuple[float, float]], p99_ms: float, lags: list[tuple[float, float]]
) -> int:
    """How many of the slowest hundredth of the heartbeats (``beats``: when each was sent,
    ``time.monotonic``, and its ms; at or above ``p99_ms``) were under way while this
    process's own event loop stalled (``lags``: a tick woken over ``STALL_MS`` late, and
    when). This process is not the controller: a stall of its own is the machine's, which
    the controller's processes meet as well."""
    stalls = [(woke - lag / 1000, woke) for woke, lag in lags if lag > STALL_MS]
    return sum(
        any(start < sent + ms / 1000 and end > sent for start, end in stalls)
        for sent, ms in beats
        if ms >= p99_ms
    )


class _OwnCollections(CollectionTimer):
    """The pauses of this process's garbage collector (ms)."""

    def __init__(self) -> None:
        super().__init__()
        self.pauses_ms: list[float] = []

    def observe(self, generation: int, seconds: float) -> None:
        self.pauses_ms.append(seconds * 1000)


def code_roots(controller: psutil.Process) -> dict[str, int]:
    """How many of the controller's processes import the service's code from where, as
    Python looks for it: first in the working directory, unless started with ``-P`` or
    ``PYTHONSAFEPATH`` (as the bench starts the controller), then along ``PYTHONPATH``
    (``CODE_ROOT`` or ``--baseline-code`` first, as the bench sets it); "(installed)" where
    neither holds it."""
    roots: dict[str, int] = {}
    for process in [controller, *controller.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            environ = process.environ()
            path = environ.get("PYTHONPATH", "").split(os.pathsep)
            if "-P" not in process.cmdline() and not environ.get("PYTHONSAFEPATH"):
                path.insert(0, process.cwd())
            root = next(
                (p for p in path if p and (Path(p) / "service" / "__init__.py").is_file()),
                "(installed)",
            )
            roots[root] = roots.get(root, 0) + 1
    return roots


def fleet_start(
    heartbeat_ms: list[float], timed_out: int, seconds: float, settle_s: float
) -> dict[str, Any]:
    """The heartbeats of the fleet's start (``seconds`` from the first registration to
    the measurement, ``settle_s`` of them settling), which the measurement leaves out."""
    return {
        "seconds": seconds,
        "settle_s": settle_s,
        "heartbeats": len(heartbeat_ms),
        "heartbeat_p50_ms": quantile(heartbeat_ms, 0.5),
        "heartbeat_p99_ms": quantile(heartbeat_ms, 0.99),
        "heartbeats_timed_out": timed_out,
    }


SLOW_PASS = re.compile(r"slow reconciler pass: ([0-9.]+) s \((.*?)\) over (\d+) nodes and (\d+)")


def slow_passes(cluster: LocalCluster) -> dict[str, Any]:
    """The reconciler's own lines about passes slower than its interval: what is known of
    the passes even when /metrics no longer answers."""
    log = (cluster.log_dir or cluster.data_dir) / "controller.log"
    found = [SLOW_PASS.search(line) for line in log.read_text(errors="replace").splitlines()]
    seconds = [float(m.group(1)) for m in found if m]
    return {
        "count": len(seconds),
        "p50_s": quantile(seconds, 0.5),
        "max_s": max(seconds, default=float("nan")),
        "last": next((m.group(0) for m in reversed(found) if m), ""),
    }


async def _watch_metrics(
    http: httpx.AsyncClient, token: str, until: float, latest: list[tuple[float, Samples]]
) -> None:
    """Scrape every 5 s until ``until``, keeping the last answer: a controller that stops
    answering by the end still leaves what it measured until then."""
    while time.monotonic() < until:
        await asyncio.sleep(min(5.0, max(0.0, until - time.monotonic())))
        try:
            latest.append((time.monotonic(), await asyncio.wait_for(_scrape(http, token), 10.0)))
        except (httpx.HTTPError, TimeoutError):
            continue


async def _bounded(limit: int, calls: list[Any]) -> list[Any]:
    """Await ``calls`` with at most ``limit`` under way at once."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Any) -> Any:
        async with gate:
            return await call

    return await asyncio.gather(*(one(c) for c in calls))


async def _submit_jobs(http: httpx.AsyncClient, admin: dict[str, str], count: int) -> list[int]:
    """Submit ``count`` jobs, queued: ``JOBS_PER_USER`` per user, each user made by the
    admin (the per-user limits are checked against the user's own unfinished jobs)."""
    tokens = []
    for number in range((count + JOBS_PER_USER - 1) // JOBS_PER_USER):
        body = {"name": f"bench-{number}", "max_active_jobs": 100_000, "max_nodes": 1_000_000}
        response = await http.post("/api/v1/users", json=body, headers=admin)
        response.raise_for_status()
        tokens.append(response.json()["token"]["secret"])

    async def submit(number: int) -> int:
        spec = {
            "name": f"bench-{number}",
            "task": {"name": "regression", "params": {"epochs": 1}},
            "nnodes": "1:2",
            "snapshot": {"every_steps": 5},
        }
        token = tokens[number // JOBS_PER_USER]
        response = await http.post(
            "/api/v1/jobs", json=spec, headers={"authorization": f"Bearer {token}"}
        )
        response.raise_for_status()
        job_id: int = response.json()["id"]
        return job_id

    return await _bounded(8, [submit(n) for n in range(count)])


def _read_phases(job_id: int) -> list[ReadPhase]:
    detail = f"/api/v1/jobs/{job_id}"
    return [
        ReadPhase("job list", "/api/v1/jobs", conditional=False),
        ReadPhase("job list, If-None-Match", "/api/v1/jobs", conditional=True),
        ReadPhase("job detail", detail, conditional=False),
        ReadPhase("job detail, If-None-Match", detail, conditional=True),
    ]


class _Reads:
    """What one reader saw: latencies (ms) of answered requests, how many were 304, what
    went wrong (a status other than 200 and 304, or an exception) by kind, and the last
    ETag."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.not_modified = 0
        self.errors: dict[str, int] = {}
        self.etag: str | None = None

    def headers(self, token: str, conditional: bool) -> dict[str, str]:
        sent = {"authorization": f"Bearer {token}"}
        if conditional and self.etag:
            sent["if-none-match"] = self.etag
        return sent

    def failed(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def answered(self, response: httpx.Response, counted_from: float) -> None:
        """A read answered now, its time counted from ``counted_from`` (``perf_counter``:
        when it was sent, or when it was due)."""
        self.latencies.append((time.perf_counter() - counted_from) * 1000)
        if response.status_code == 304:
            self.not_modified += 1
        elif response.status_code == 200:
            self.etag = response.headers.get("etag")
        else:
            self.failed(str(response.status_code))

    def result(self) -> tuple[list[float], int, dict[str, int]]:
        return self.latencies, self.not_modified, self.errors


def poll(
    url: str,
    token: str,
    path: str,
    conditional: bool,
    until: float,
    rate: float | None = None,
    since: float | None = None,
) -> tuple[list[float], int, dict[str, int]]:
    """One reader: GET ``path`` until ``until`` (``time.time``), sending back the last ETag
    if ``conditional``; its latencies (ms) of answered requests, the count of 304s, and what
    went wrong (a status other than 200 and 304, or an exception), by kind.

    With no ``rate``, back to back: the next read leaves when the last is answered, so a
    slower controller is sent fewer (a closed loop). With a ``rate``, one read due every
    ``1 / rate`` s from ``since`` (``time.time``; default: now) until ``until``, each sent
    when due whether or not the reads before were answered (an open loop), or at once if
    it is already late (the phase before overran); a latency counts from when its read was
    due, so the wait of a late read, or of one for one of the reader's
    ``READER_CONNECTIONS_MAX`` connections, counts. Reads sent before the first full answer
    came back carry no ETag, so an open loop's share of 304s is a little lower.

    It sends at least one request, even when it starts after ``until``: a phase that a slow
    previous one overran still measures what a read costs then."""
    if rate is not None:
        begun = time.time() if since is None else since
        return asyncio.run(_poll_at(url, token, path, conditional, (begun, until), rate))
    reads = _Reads()
    with httpx.Client(base_url=url, timeout=30.0) as http:
        first = True
        while first or time.time() < until:
            first = False
            start = time.perf_counter()
            try:
                response = http.get(path, headers=reads.headers(token, conditional))
            except httpx.HTTPError as exc:
                reads.failed(type(exc).__name__)
                continue
            reads.answered(response, start)
    return reads.result()


async def _poll_at(
    url: str, token: str, path: str, conditional: bool, window: tuple[float, float], rate: float
) -> tuple[list[float], int, dict[str, int]]:
    reads = _Reads()
    since, until = window
    count = max(1, math.ceil((until - since) * rate))
    limits = httpx.Limits(max_connections=READER_CONNECTIONS_MAX)
    async with httpx.AsyncClient(base_url=url, timeout=30.0, limits=limits) as http:

        async def read(due: float) -> None:
            try:
                response = await http.get(path, headers=reads.headers(token, conditional))
            except httpx.HTTPError as exc:
                reads.failed(type(exc).__name__)
                return
            reads.answered(response, due)

        sent: list[asyncio.Task[None]] = []
        start = time.perf_counter() - (time.time() - since)  # ``since`` on this clock
        for number in range(count):
            due = start + number / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            sent.append(asyncio.create_task(read(due)))
        await asyncio.gather(*sent)
    return reads.result()


def _reader_ready() -> None:
    """Nothing: a reader that runs it has imported this module."""


async def _no_reads() -> list[dict[str, Any]]:
    """What ``_read`` returns with no readers (``--readers 0``)."""
    return []


def _read(
    pool: Any, url: str, token: str, phases: list[ReadPhase], options: Options, start: float
) -> list[dict[str, Any]]:
    """Each phase for a quarter of the run, by ``options.readers`` polling processes."""
    results = []
    length = options.seconds / len(phases)
    for number, phase in enumerate(phases):
        until = start + (number + 1) * length
        began = time.time()
        due = start + number * length
        args = [(url, token, phase.path, phase.conditional, until, options.read_rate, due)]
        args *= options.readers
        latencies: list[float] = []
        not_modified = 0
        errors: dict[str, int] = {}
        for lat, nm, failed in pool.starmap(poll, args):
            latencies += lat
            not_modified += nm
            for kind, count in failed.items():
                errors[kind] = errors.get(kind, 0) + count
        seconds = max(time.time() - began, 1e-9)
        results.append(
            {
                "phase": phase.name,
                "requests": len(latencies),
                "per_s": len(latencies) / seconds,
                "offered_per_s": (
                    None if options.read_rate is None else options.read_rate * options.readers
                ),
                "p50_ms": quantile(latencies, 0.5),
                "p99_ms": quantile(latencies, 0.99),
                "not_modified_share": not_modified / len(latencies) if latencies else 0.0,
                "errors": errors,
            }
        )
    return results


async def _sample_rss(process: psutil.Process, until: float, into: list[int]) -> None:
    while time.monotonic() < until:
        into.append(_rss_tree(process))
        await asyncio.sleep(1.0)


async def _sample_running(stats: FleetStats, until: float, into: list[tuple[int, int]]) -> None:
    """Every second: the runs training, and those that wait their turn."""
    while time.monotonic() < until:
        into.append((stats.running, stats.waiting))
        await asyncio.sleep(1.0)


def offered(
    stats: FleetStats, running: list[tuple[int, int]], wall: float, start: float
) -> dict[str, Any]:
    """The load the fleet put on the controller. In the closed loop (the default) it is
    not fixed: a node asks for work and reports on it, so a controller that places more
    jobs (or places them on one node rather than two) gets more requests, and its latencies
    are those of a heavier load. With ``runs_at_once`` it is fixed while runs wait their
    turn (``runs_waiting_min`` above 0): then as many train whatever the controller does.
    Heartbeats count every answer, a shed one's 503 included. How the runs' ends fell over
    the window's whole seconds from ``start`` (``time.monotonic``) shows whether they came
    evenly or in waves, each a burst of exits and of the next runs' starts."""
    training = [r for r, _ in running]
    waiting = [w for _, w in running]
    return {
        "runs_running_mean": statistics.fmean(training) if training else float("nan"),
        "runs_running_max": max(training, default=0),
        "runs_waiting_mean": statistics.fmean(waiting) if waiting else float("nan"),
        "runs_waiting_min": min(waiting, default=0),
        "runs_per_job_placed": stats.runs_started / len(stats.jobs_placed)
        if stats.jobs_placed
        else float("nan"),
        "reports_per_s": len(stats.report_sent) / wall,
        "heartbeats_per_s": len(stats.heartbeat_sent) / wall,
        "runs_ended_per_second": per_second(stats.run_ended, start, wall),
    }


def per_second(times: Iterable[float], start: float, wall: float) -> dict[str, float]:
    """How many of ``times`` fell in each whole second from ``start`` within ``wall``
    seconds: the median second's and the busiest's, and the share of all in the busiest
    fifth of the seconds (a fifth: even; all: every one in a fifth of the time)."""
    seconds = int(wall)
    counts = [0] * seconds
    for when in times:
        second = int(when - start)
        if 0 <= second < seconds:
            counts[second] += 1
    if not seconds:
        return {}
    counts.sort()
    busiest = counts[-max(1, seconds // 5) :]
    return {
        "p50": quantile([float(c) for c in counts], 0.5),
        "max": float(counts[-1]),
        "busiest_fifth_share": sum(busiest) / sum(counts) if sum(counts) else float("nan"),
    }


def _spread(ms: list[float]) -> dict[str, float]:
    """How many, and their p50 and p99 (nan if none)."""
    return {"count": len(ms), "p50_ms": quantile(ms, 0.5), "p99_ms": quantile(ms, 0.99)}


def tail_of(
    beats: list[tuple[float, float]], reports: list[tuple[float, float]], p99_ms: float
) -> dict[str, Any]:
    """Where in time the slowest hundredth of the heartbeats (``beats``: when each was
    sent, ``time.monotonic``, and its ms; at or above ``p99_ms``) were sent: in how many
    distinct seconds of the window, and the three seconds with the slowest heartbeats,
    each with the heartbeats and reports sent in it and the heartbeats' median; and how
    many heartbeats the whole seconds of the window held (``per_second``: the fewest, the
    median, the most), which a fleet of even phases keeps close together."""
    if not beats:
        return {"slow": 0, "seconds": 0, "worst": [], "per_second": {}}
    t0 = min(sent for sent, _ in beats)
    by_second: dict[int, list[float]] = defaultdict(list)
    for sent, ms in beats:
        by_second[int(sent - t0)].append(ms)
    reports_in = Counter(int(sent - t0) for sent, _ in reports)
    slow = [int(sent - t0) for sent, ms in beats if ms >= p99_ms]
    # The first and the last second of the window may be cut short; one in between that
    # saw no heartbeat sent holds none.
    last = max(by_second)
    whole = sorted(float(len(by_second.get(second, ()))) for second in range(1, last))
    worst = sorted(by_second, key=lambda second: max(by_second[second]), reverse=True)[:3]
    return {
        "slow": len(slow),
        "seconds": len(set(slow)),
        "of_seconds": last + 1,
        "per_second": {"min": whole[0], "p50": quantile(whole, 0.5), "max": whole[-1]}
        if whole
        else {},
        "worst": [
            {
                "second": second,
                "heartbeats": len(by_second[second]),
                "reports": reports_in[second],
                "p50_ms": quantile(by_second[second], 0.5),
                "max_ms": max(by_second[second]),
                "slow": slow.count(second),
            }
            for second in worst
        ],
    }


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def _cpu_split(controller: psutil.Process) -> tuple[float, float, float]:
    """CPU seconds of the controller's own process, of its reconciler's process (unless it
    runs on a thread), and of its API helpers (``RELAUNCH_API_PROCESSES``), living now."""
    reconciler = helpers = 0.0
    for child in controller.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.name() == API_HELPER_NAME:
                helpers += _cpu(child)
            else:
                reconciler += _cpu(child)
    return _cpu(controller), reconciler, helpers


def _database_cpu() -> dict[int, float]:
    """CPU seconds of each process of the PostgreSQL server (its backends and its own),
    by pid; none on a machine without one running."""
    seconds: dict[int, float] = {}
    for process in database_processes():
        with contextlib.suppress(psutil.Error):  # exited since, or not ours to read
            seconds[process.pid] = _cpu(process)
    return seconds


def _cpu_since(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two ``_database_cpu`` readings by the processes alive at
    the second (a backend that exited between them is not counted)."""
    return sum(spent - before.get(pid, 0.0) for pid, spent in after.items())


def _machine_shares(before: Any, after: Any) -> dict[str, float]:
    """How busy the whole machine was between two ``psutil.cpu_times()`` readings: the
    share of all its cores' time spent busy, and in the kernel."""
    spent = {
        field: getattr(after, field) - getattr(before, field)
        for field in after._fields
        if field not in ("guest", "guest_nice")  # Linux counts them in user and nice too
    }
    total = sum(spent.values()) or 1.0
    idle = spent.get("idle", 0.0) + spent.get("iowait", 0.0)
    return {"busy_share": 1 - idle / total, "system_share": spent.get("system", 0.0) / total}


def _rss_tree(process: psutil.Process) -> int:
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return int(total)


async def _scrape(http: httpx.AsyncClient, token: str) -> Samples:
    response = await http.get("/metrics", headers={"authorization": f"Bearer {token}"})
    response.raise_for_status()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _by_label(
    before: Samples, after: Samples, name: str, label: str, values: Iterable[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """The mean and p99 (ms) of histogram ``name`` between the two scrapes, by each of
    ``values`` of ``label`` that has samples in between."""
    means, p99s = {}, {}
    for value in values:
        n = _delta(before, after, f"{name}_count", **{label: value})
        if n:
            means[value] = 1000 * _delta(before, after, f"{name}_sum", **{label: value}) / n
            p99s[value] = 1000 * histogram_quantile(
                0.99, buckets(before, after, name, **{label: value})
            )
    return means, p99s


def buckets(before: Samples, after: Samples, name: str, **labels: str) -> list[tuple[float, float]]:
    """The histogram ``name``'s cumulative buckets over the run: (upper bound, count)."""
    found = []
    for (sample, sample_labels), count in after.items():
        values = dict(sample_labels)
        if sample != f"{name}_bucket" or any(values.get(k) != v for k, v in labels.items()):
            continue
        bound = float(values["le"])
        found.append((bound, count - before.get((sample, sample_labels), 0.0)))
    return sorted(found)


def gc_pauses(before: Samples, after: Samples) -> dict[str, dict[str, float]]:
    """The API process's garbage collections over the run, by generation: how many, their
    total and p99 time (``relaunch_gc_pause_seconds``)."""
    found = {}
    for generation in ("0", "1", "2"):
        name = "relaunch_gc_pause_seconds"
        found[generation] = {
            "count": _delta(before, after, f"{name}_count", generation=generation),
            "total_ms": 1000 * _delta(before, after, f"{name}_sum", generation=generation),
            "p99_ms": 1000
            * histogram_quantile(0.99, buckets(before, after, name, generation=generation)),
        }
    return found


def _gc_line(controller: dict[str, Any]) -> str:
    pauses = controller["gc_pauses"]
    return "; ".join(
        f"gen {g}: {p['count']:.0f}, {p['total_ms']:.0f} ms, p99 {p['p99_ms']:.0f} ms"
        for g, p in pauses.items()
    )


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float:
    """Prometheus' estimate: linear within the bucket the rank falls in; the largest
    finite bound if it falls in +Inf; NaN with no observations."""
    if not cumulative or cumulative[-1][1] <= 0:
        return float("nan")
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def share_within(cumulative: list[tuple[float, float]], bound: float) -> float:
    """The share of observations at most ``bound`` (exact when it is a bucket bound)."""
    total = cumulative[-1][1] if cumulative else 0.0
    within = next((count for b, count in cumulative if b >= bound), total)
    return within / total if total else float("nan")


def _result(
    before: Samples,
    after: Samples,
    stats: FleetStats,
    reads: list[dict[str, Any]],
    wall: float,
    cpu: tuple[float, float, float],
    my_cpu: float,
    rss: list[int],
    submit_s: float,
    register_s: float,
    options: Options,
) -> dict[str, Any]:
    passes = buckets(before, after, "relaunch_reconcile_pass_seconds")
    passes_n = _delta(before, after, "relaunch_reconcile_pass_seconds_count")
    pass_sum = _delta(before, after, "relaunch_reconcile_pass_seconds_sum")
    # A controller times either "load" or its parts; the split is missing where the
    # kernel does not say.
    phases, phases_p99 = _by_label(
        before, after, "relaunch_reconcile_phase_seconds", "phase", RECONCILE_PHASES
    )
    split, split_p99 = _by_label(
        before,
        after,
        "relaunch_reconcile_pass_split_seconds",
        "state",
        ("running", "runnable", "blocked"),
    )
    actions = {
        dict(labels)["action"]: _delta(before, after, name, **dict(labels))
        for (name, labels) in after
        if name == "relaunch_reconcile_actions_total"
    }
    beats = buckets(before, after, "relaunch_heartbeat_seconds")
    heartbeat_server = _delta(before, after, "relaunch_heartbeat_seconds_sum")
    heartbeat_server_n = _delta(before, after, "relaunch_heartbeat_seconds_count")
    states = ("PENDING", "WAITING", "RUNNING", "RESTARTING", "SUCCEEDED", "FAILED", "CANCELLED")
    reconcile_p99 = 1000 * histogram_quantile(0.99, passes)
    beats_ms = stats.heartbeat_ms
    heartbeat_p99 = quantile(beats_ms, 0.99)
    return {
        "seconds": wall,
        "setup": {
            "submit_s": submit_s,
            "submits_per_s": options.jobs / submit_s if submit_s else float("nan"),
            "register_s": register_s,
            "register_timeout_s": options.register_timeout_s,
            "registration_key": options.registration_key,
        },
        "reconcile": {
            "passes": passes_n,
            "p50_ms": 1000 * histogram_quantile(0.5, passes),
            "p99_ms": reconcile_p99,
            "mean_ms": 1000 * pass_sum / passes_n if passes_n else float("nan"),
            "within_target": share_within(passes, RECONCILE_P99_TARGET_MS / 1000),
            "phase_mean_ms": phases,
            "phase_p99_ms": phases_p99,
            # What the pass's thread did: on a CPU, waiting for one, asleep.
            "split_mean_ms": split,
            "split_p99_ms": split_p99,
            "actions": actions,
            # Passes that read the queue whole (a shape change, a new term, ...) or its head.
            "queue_reads": {
                read: _delta(before, after, "relaunch_reconcile_queue_reads_total", read=read)
                for read in ("whole", "head")
            },
        },
        "heartbeat": {
            "count": len(beats_ms),
            "timed_out": stats.heartbeat_timeouts,
            "per_s": len(beats_ms) / wall,
            "interval_told_s_max": stats.interval_told_s_max,
            "p50_ms": quantile(beats_ms, 0.5),
            "p99_ms": heartbeat_p99,
            # Those whose answer started a run on the node (made the long way), and the rest.
            "starting": _spread(stats.starting_ms),
            "others": _spread(stats.steady_ms),
            "tail": tail_of(stats.heartbeat_sent, stats.report_sent, heartbeat_p99),
            "server_mean_ms": 1000 * heartbeat_server / heartbeat_server_n
            if heartbeat_server_n
            else float("nan"),
            # The controller's own time, from the request to the reply's last byte: what the
            # nodes see less the network and the bench's own delays (its client shares the
            # machine).
            "server_p50_ms": 1000 * histogram_quantile(0.5, beats),
            "server_p99_ms": 1000 * histogram_quantile(0.99, beats),
            "shed": {
                reason: _delta(
                    before, after, "relaunch_requests_shed_total", lane="heartbeat", reason=reason
                )
                for reason in ("waited", "gone")
            },
        },
        "reports": _spread(stats.report_ms),
        "reads": reads,
        "jobs": {
            "placed": len(stats.jobs_placed),
            "runs_started": stats.runs_started,
            "runs_succeeded": stats.runs_succeeded,
            "runs_fenced": stats.runs_fenced,
            "runs_stopped": stats.runs_stopped,
            "by_state_at_end": {
                s: after.get(("relaunch_jobs", frozenset({("state", s)})), 0.0) for s in states
            },
        },
        "nodes_by_state_at_end": {
            s: after.get(("relaunch_nodes", frozenset({("state", s)})), 0.0)
            for s in ("ALIVE", "LOST", "LEFT")
        },
        "controller": {
            "cpu_share_of_one_core": sum(cpu) / wall,
            "reconciler_process_cpu_share_of_one_core": cpu[1] / wall,
            "api_helpers_cpu_share_of_one_core": cpu[2] / wall,
            "rss_mib_max": max(rss, default=0) / 2**20,
            "rss_mib_end": (rss[-1] if rss else 0) / 2**20,
            "gc_pauses": gc_pauses(before, after),
        },
        "bench_client_cpu_share_of_one_core": my_cpu / wall,
        "errors": stats.errors,
        "targets": {
            "reconcile_p99_ms": RECONCILE_P99_TARGET_MS,
            "reconcile_p99_met": reconcile_p99 <= RECONCILE_P99_TARGET_MS,
            "heartbeat_p99_ms": HEARTBEAT_P99_TARGET_MS,
            "heartbeat_p99_met": heartbeat_p99 <= HEARTBEAT_P99_TARGET_MS,
        },
    }


def print_table(result: dict[str, Any]) -> None:
    o = result["options"]
    table = Table(
        title=f"control plane: {o['nodes']} nodes, {o['jobs']} jobs (1:2), {o['db']}, "
        f"{result['seconds']:.0f} s"
    )
    for column, justify in (("measure", "left"), ("p50 ms", "right"), ("p99 ms", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    table.add_column("more", justify="left")
    rec, hb, rep = result["reconcile"], result["heartbeat"], result["reports"]
    phases = ", ".join(f"{k} {v:.0f}" for k, v in rec["phase_mean_ms"].items())
    phases_p99 = ", ".join(f"{k} {v:.0f}" for k, v in rec.get("phase_p99_ms", {}).items())
    table.add_row(
        "reconcile pass (controller histogram)",
        f"{rec['p50_ms']:.0f}",
        f"{rec['p99_ms']:.0f}",
        f"{rec['passes']:.0f} passes in {rec['measured_over_s']:.0f} s, "
        f"mean {rec['mean_ms']:.0f} ms ({phases}); p99 by phase: {phases_p99}; "
        f"{100 * rec['within_target']:.0f} % within {RECONCILE_P99_TARGET_MS:.0f} ms; "
        f"{rec['queue_reads']['whole']:.0f} read the queue whole"
        + (
            "; its thread, mean (p99): "
            + ", ".join(
                f"{state} {ms:.0f} ({rec['split_p99_ms'][state]:.0f})"
                for state, ms in rec["split_mean_ms"].items()
            )
            if rec.get("split_mean_ms")
            else ""
        ),
    )
    table.add_row(
        "heartbeat answer (nodes' side)",
        f"{hb['p50_ms']:.1f}",
        f"{hb['p99_ms']:.1f}",
        f"{hb['per_s']:.0f}/s at an interval of up to {hb['interval_told_s_max']:.1f} s; "
        f"controller's own p50 {hb['server_p50_ms']:.1f} / p99 "
        f"{hb['server_p99_ms']:.1f} ms, mean {hb['server_mean_ms']:.1f} ms"
        + (
            f"; answers that started a run: {hb['starting']['count']}, p50 "
            f"{hb['starting']['p50_ms']:.1f} / p99 {hb['starting']['p99_ms']:.1f} ms, the "
            f"others p50 {hb['others']['p50_ms']:.1f} / p99 {hb['others']['p99_ms']:.1f} ms"
            if "starting" in hb
            else ""
        )
        + (
            f"; {hb['timed_out']} unanswered in {AGENT_TIMEOUT_S:g} s (counted at that)"
            if hb["timed_out"]
            else ""
        )
        + (
            f"; shed (503, counted at their time): {hb['shed']['waited']:.0f} waited too "
            f"long, {hb['shed']['gone']:.0f} after their node gave up"
            if any(hb["shed"].values())
            else ""
        ),
    )
    tail = hb.get("tail")
    if tail and tail["slow"]:
        table.add_row(
            "  its slowest hundredth (p99 and above)",
            "",
            "",
            f"{tail['slow']} heartbeats sent in {tail['seconds']} of {tail['of_seconds']} "
            + (
                f"seconds (heartbeats a second: {tail['per_second']['min']:.0f} to "
                f"{tail['per_second']['max']:.0f}, median {tail['per_second']['p50']:.0f})"
                if tail.get("per_second")
                else "seconds"
            )
            + (
                f"; {tail['during_own_stalls']} of them under way while this process's own "
                f"loop stalled (a tick over {STALL_MS:.0f} ms late)"
                if "during_own_stalls" in tail
                else ""
            )
            + "; the worst seconds: "
            + "; ".join(
                f"{w['second']} s in: {w['slow']} of {w['heartbeats']} heartbeats slow, p50 "
                f"{w['p50_ms']:.0f} / max {w['max_ms']:.0f} ms, {w['reports']} reports"
                for w in tail["worst"]
            ),
        )
    table.add_row(
        "report answer (nodes' side)",
        f"{rep['p50_ms']:.1f}",
        f"{rep['p99_ms']:.1f}",
        f"{rep['count']} reports",
    )
    for read in result["reads"]:
        table.add_row(
            read["phase"],
            f"{read['p50_ms']:.1f}",
            f"{read['p99_ms']:.1f}",
            f"{read['per_s']:.0f} reads/s"
            + (f" of {read['offered_per_s']:.0f}/s sent" if read.get("offered_per_s") else "")
            + f", {100 * read['not_modified_share']:.0f} % 304"
            + (f"; errors {read['errors']}" if read["errors"] else ""),
        )
    console.print(table)
    if "bench_loop" in result:
        loop = result["bench_loop"]
        console.print(
            f"the simulated nodes' event loop (this process): late by p99 "
            f"{loop['lag_p99_ms']:.0f} ms, at most {loop['lag_max_ms']:.0f} ms, "
            f"{loop['stalls_over_50_ms']} times over 50 ms; its garbage collections: "
            f"{loop['collections']}, {loop['collections_ms']:.0f} ms in all, the longest "
            f"{loop['collection_max_ms']:.0f} ms"
        )
    if "code" in result:
        roots = result["code"]["processes_by_root"]
        console.print(
            f"code: {sum(roots.values())} controller processes, importing from "
            + ", ".join(f"{root} ({n})" for root, n in roots.items())
        )
    slow = rec["slow_passes_logged"]
    if slow["count"]:
        console.print(
            f"the controller logged {slow['count']} passes slower than its interval (whole "
            f"run, set-up included): median {slow['p50_s']:.1f} s, longest {slow['max_s']:.1f} "
            f"s; the last: {slow['last']}"
        )
    jobs, ctl = result["jobs"], result["controller"]
    by_state = ", ".join(f"{k} {v:.0f}" for k, v in jobs["by_state_at_end"].items() if v)
    console.print(
        f"jobs: {jobs['placed']} placed, {jobs['runs_succeeded']} runs succeeded; at the end "
        f"{by_state}. Nodes at the end: "
        + ", ".join(f"{k} {v:.0f}" for k, v in result["nodes_by_state_at_end"].items() if v)
    )
    console.print(
        f"controller: CPU {100 * ctl['cpu_share_of_one_core']:.0f} % of one core (its "
        f"reconciler's process {100 * ctl['reconciler_process_cpu_share_of_one_core']:.0f} %, "
        f"its API helpers {100 * ctl['api_helpers_cpu_share_of_one_core']:.0f} %), "
        f"RSS max "
        f"{ctl['rss_mib_max']:.0f} MiB; this bench's own CPU "
        f"{100 * result['bench_client_cpu_share_of_one_core']:.0f} % of one core. Setup: "
        f"{result['setup']['submits_per_s']:.0f} submits/s, nodes registered in "
        f"{result['setup']['register_s']:.1f} s"
    )
    start = result["setup"].get("fleet_start")
    if start is not None:
        console.print(
            f"the fleet's start (left out of the measurement: registration and "
            f"{start['settle_s']:.0f} s of settling, {start['seconds']:.0f} s in "
            f"all): heartbeat p50 {start['heartbeat_p50_ms']:.0f} ms, p99 "
            f"{start['heartbeat_p99_ms']:.0f} ms, {start['heartbeats_timed_out']} unanswered"
        )
    load = result["offered"]
    console.print(
        f"load offered: {load['runs_running_mean']:.0f} runs under way on mean (max "
        f"{load['runs_running_max']}), {load['runs_per_job_placed']:.2f} runs (a node's "
        "part of an attempt) per job placed, "
        f"{load['reports_per_s']:.0f} reports/s and {load['heartbeats_per_s']:.0f} heartbeats/s "
        "answered"
        + (
            f"; at most {o['runs_at_once']} training at once, on a fixed clock, "
            f"{load['runs_waiting_mean']:.0f} waiting their turn on mean (fewest "
            f"{load['runs_waiting_min']})"
            if o.get("runs_at_once")
            else ""
        )
        + (
            f"; runs ended a second: median {ends['p50']:.0f}, most {ends['max']:.0f}, "
            f"{100 * ends['busiest_fifth_share']:.0f} % of them in the busiest fifth of the "
            f"seconds (steps spread {o.get('step_spread', 0):g})"
            if (ends := load.get("runs_ended_per_second"))
            else ""
        )
    )
    machine = result["machine"]
    console.print(
        f"machine: {100 * machine['busy_share']:.0f} % of all cores busy, "
        f"{100 * machine['system_share']:.0f} % in the kernel; PostgreSQL server "
        f"{100 * machine['database_server_share_of_one_core']:.0f} % of one core"
    )
    console.print(f"garbage collections of the API's process (count, time): {_gc_line(ctl)}")
    regs, setup = result["setup"]["registrations"], result["setup"]
    console.print(
        f"registrations (each try waits {setup['register_timeout_s']:g} s, registration key "
        f"{'sent' if setup['registration_key'] else 'not sent'}): {regs['tries']} tries, "
        f"{regs['timed_out']} unanswered, {regs['refused']} refused (409), "
        f"{regs['after_timeout']} nodes registered after a try of theirs went unanswered"
    )
    if result["errors"]:
        console.print(f"errors: {result['errors']}")
    t = result["targets"]
    console.print(
        f"targets (issue, at 1,000 nodes and 10,000 jobs on PostgreSQL): reconcile pass p99 <= "
        f"{t['reconcile_p99_ms']:.0f} ms: {'met' if t['reconcile_p99_met'] else 'NOT met'}; "
        f"heartbeat p99 <= {t['heartbeat_p99_ms']:.0f} ms: "
        f"{'met' if t['heartbeat_p99_met'] else 'NOT met'}"
    )


def _finite(value: Any) -> Any:
    """``value`` with NaN as null, which JSON has."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and value != value:
        return None
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--readers",
        type=int,
        default=1,
        help="polling processes per phase (0: no reads, the fleet's load alone)",
    )
    parser.add_argument(
        "--read-rate",
        type=float,
        help="each reader's reads a second, sent on a fixed schedule whether or not the "
        "reads before were answered, at most "
        f"{READER_CONNECTIONS_MAX} under way; a read's time counts from when it was due "
        "(default: back to back, each read sent when the last is answered)",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=30.0,
        help="seconds the fleet runs after its registrations before the measurement starts "
        "(the fleet's start is reported apart)",
    )
    parser.add_argument(
        "--runs-at-once",
        type=int,
        help="an open loop, the same load for any code: at most N simulated runs train at "
        "once, each step on a fixed clock; the runs assigned beyond them wait their turn "
        "(default: every run trains as soon as it is assigned, each step after its last "
        "report's answer)",
    )
    parser.add_argument(
        "--baseline-code",
        type=Path,
        metavar="DIR",
        help="first run the same load on the controller's code in DIR (a checkout of another "
        "commit: git worktree add DIR REV), then on this tree's",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with a --baseline-*: run the pair this many times, in turn (baseline, this, "
        "this, baseline, ...)",
    )
    parser.add_argument("--steps", type=int, default=20, help="steps of each simulated run")
    parser.add_argument("--step-s", type=float, default=0.5, help="seconds per simulated step")
    parser.add_argument(
        "--step-spread",
        type=float,
        default=Options.step_spread,
        help="each simulated attempt's steps last --step-s times a factor of its own, drawn "
        "from 1 -/+ this, the same mean, so that runs do not end and start in waves (0: every "
        "run the same length)",
    )
    parser.add_argument(
        "--baseline-lockstep",
        action="store_true",
        help="first run the same load with every simulated run the same length (--step-spread 0)",
    )
    parser.add_argument("--pg-admin-url", default=PG_ADMIN_URL, help="makes the database")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--work-dir", type=Path, help="keep the controller's files and log here")
    parser.add_argument(
        "--heartbeats-per-s-max", type=float, help="the controller's heartbeat budget (its pace)"
    )
    parser.add_argument(
        "--register-timeout-s",
        type=float,
        default=REGISTER_TIMEOUT_S,
        help=f"what a registration waits for its answer (agents: {AGENT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--baseline-no-registration-key",
        action="store_true",
        help="first run the same load with registrations that carry no registration key",
    )
    parser.add_argument(
        "--baseline-fixed-interval",
        action="store_true",
        help="first run the same load with every node told the base interval (no pace)",
    )
    parser.add_argument(
        "--baseline-reconciler-thread",
        action="store_true",
        help="first run the same load with the reconciler on a thread of the API's process",
    )
    parser.add_argument(
        "--baseline-no-gc-freeze",
        action="store_true",
        help="first run the same load with every object of the controller's start collected",
    )
    parser.add_argument(
        "--baseline-python-gc-threshold",
        action="store_true",
        help="first run the same load with Python's own threshold for collecting the "
        f"youngest objects ({PYTHON_GC_YOUNG_THRESHOLD})",
    )
    parser.add_argument(
        "--baseline-same",
        action="store_true",
        help="first run the same load with nothing changed: how far two runs of the same "
        "code and settings differ (the bench's spread)",
    )
    parser.add_argument(
        "--baseline-every-round-trip",
        action="store_true",
        help="first run the same load with a ping at every loan of a pooled connection and "
        "each heartbeat a transaction of two statements",
    )
    parser.add_argument(
        "--baseline-heartbeat-synchronous-commit",
        action="store_true",
        help="first run the same load with each heartbeat's commit waiting for PostgreSQL "
        "to flush it to disk, as every commit does by default",
    )
    parser.add_argument(
        "--baseline-shared-threads",
        action="store_true",
        help="first run the same load with heartbeats answered on the API's threads, "
        "beside reports and reads (no threads of their own)",
    )
    parser.add_argument(
        "--baseline-no-shedding",
        action="store_true",
        help="first run the same load with every heartbeat worked on, however long it waited "
        "and whether or not its node still waits for it",
    )
    parser.add_argument(
        "--baseline-short-keep-alive",
        action="store_true",
        help="first run the same load with idle connections closed after 5 s (uvicorn's and "
        "httpx's defaults), so that a node at a longer pace opens one for each heartbeat",
    )
    parser.add_argument(
        "--baseline-bench-collects",
        action="store_true",
        help="first run the same load with the garbage collector of this process (the "
        "simulated fleet's) running as Python runs it, not held while it measures",
    )
    parser.add_argument(
        "--api-processes",
        type=int,
        help="RELAUNCH_API_PROCESSES of the controller: processes that answer the API "
        "(default: the controller's, 1; 2 with --baseline-one-api-process)",
    )
    parser.add_argument(
        "--api-threads",
        type=int,
        help="RELAUNCH_API_THREADS, per process (default: the controller's 40 with one "
        "process, 40 shared out among several, so that their pools stay within "
        "PostgreSQL's 100 connections)",
    )
    parser.add_argument(
        "--gc-young-threshold",
        type=int,
        help="RELAUNCH_GC_YOUNG_THRESHOLD of the controller (default: the controller's)",
    )
    parser.add_argument(
        "--controller-cores",
        type=_cores,
        metavar="LIST",
        help="run the controller's processes on these cores (comma-separated, as taskset "
        "numbers them) and the simulated fleet, its readers and PostgreSQL's server on the "
        "others, as if the controller's host were apart from theirs (default: every process "
        "on every core)",
    )
    parser.add_argument(
        "--baseline-shared-cores",
        action="store_true",
        help="with --controller-cores: first run the same load with every process on every core",
    )
    parser.add_argument(
        "--baseline-one-api-process",
        action="store_true",
        help="first run the same load with the API on one process (40 threads), then on "
        "--api-processes",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.step_spread < 1:
        parser.error("--step-spread must be at least 0 and below 1 (a step takes some time)")
    if args.runs_at_once is not None and args.runs_at_once < 1:
        parser.error("--runs-at-once must be at least 1")
    chosen = [flag for flag in BASELINES if getattr(args, flag)]
    if len(chosen) + (args.baseline_code is not None) > 1:
        parser.error("one --baseline-* at a time")
    if args.rounds < 1 or (args.rounds > 1 and not chosen and args.baseline_code is None):
        parser.error("--rounds N: at least 1, and more only with a --baseline-*")
    if args.baseline_code is not None:
        args.baseline_code = args.baseline_code.resolve()
        if not (args.baseline_code / "service" / "__init__.py").is_file():
            parser.error(f"--baseline-code {args.baseline_code}: no service/ package there")
    if args.controller_cores is not None:
        try:
            split_cores(args.controller_cores, os.sched_getaffinity(0))
        except ValueError as refused:
            parser.error(f"--controller-cores: {refused}")
    elif args.baseline_shared_cores:
        parser.error("--baseline-shared-cores needs --controller-cores: the cores to set apart")
    api_processes = args.api_processes
    if api_processes is None and args.baseline_one_api_process:
        api_processes = 2
    api_threads = args.api_threads
    if api_threads is None and api_processes is not None and api_processes > 1:
        fits = (PG_CONNECTIONS - RECONCILER_CONNECTIONS) // api_processes
        api_threads = max(
            2,
            min(API_THREADS_SHARED // api_processes, fits - API_PROCESS_CONNECTIONS_BESIDE_THREADS),
        )
    if args.db == "postgresql":
        needed = (api_processes or 1) * (
            (api_threads or API_THREADS_SHARED) + API_PROCESS_CONNECTIONS_BESIDE_THREADS
        ) + RECONCILER_CONNECTIONS
        if needed > PG_CONNECTIONS:
            parser.error(
                f"{api_processes or 1} API processes of {api_threads or API_THREADS_SHARED} "
                f"threads may hold {needed} of PostgreSQL's connections, more than its "
                f"{PG_CONNECTIONS}: give fewer --api-processes or --api-threads"
            )
    options = Options(
        nodes=args.nodes,
        jobs=args.jobs,
        db=args.db,
        seconds=args.seconds,
        settle_s=args.settle_s,
        readers=args.readers,
        read_rate=args.read_rate,
        training=Training(steps=args.steps, step_s=args.step_s),
        pg_admin_url=args.pg_admin_url,
        work_dir=args.work_dir,
        heartbeats_per_s_max=args.heartbeats_per_s_max,
        register_timeout_s=args.register_timeout_s,
        api_processes=api_processes,
        api_threads=api_threads,
        gc_young_threshold=args.gc_young_threshold,
        runs_at_once=args.runs_at_once,
        controller_cores=args.controller_cores,
        step_spread=args.step_spread,
    )
    runs: dict[str, dict[str, Any]]
    side_by_side: Callable[[dict[str, dict[str, Any]]], None] | None
    baseline_code: Path | None = args.baseline_code
    if baseline_code is not None or chosen:
        if baseline_code is not None:
            changes = {"code": str(baseline_code)}
            names = (baseline_code.name or str(baseline_code), "this tree")
            side_by_side = _same_load("the controller's code there or here")
        else:
            changes, names, side_by_side = BASELINES[chosen[0]]
        runs = paired(options, changes, names, args.rounds, functools.partial(_write, args.json))
    else:
        runs = {"": run(options)}
        side_by_side = None
    for result in runs.values():
        print_table(result)
    if side_by_side is not None:
        side_by_side(runs)
    _write(args.json, runs[""] if side_by_side is None else runs)


def _cores(text: str) -> tuple[int, ...]:
    """``--controller-cores``: "0" or "0,2", cores numbered as taskset numbers them."""
    try:
        cores = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give core numbers, as 0 or 0,2") from None
    if not cores or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give core numbers, as 0 or 0,2")
    return cores


def _write(path: Path | None, results: dict[str, Any]) -> None:
    """``results`` as JSON to ``path`` (none: nowhere)."""
    if path is not None:
        path.write_text(json.dumps(_finite(results), indent=2) + "\n")


def paired(
    options: Options,
    changes: dict[str, Any],
    names: tuple[str, str],
    rounds: int,
    after_each: Callable[[dict[str, dict[str, Any]]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """The baseline (``options`` with ``changes``) and ``options`` itself, ``rounds`` times,
    in turn (baseline, given; then given, baseline; ...), so that a machine that drifts
    over the runs weighs on both alike. Named ``names``, numbered when ``rounds`` > 1; the
    baseline's runs first. ``after_each`` is given the runs so far after each one (a run
    that fails later loses none of them)."""
    baseline, given = names
    ran: dict[str, list[dict[str, Any]]] = {baseline: [], given: []}

    def named() -> dict[str, dict[str, Any]]:
        if rounds == 1:
            return {name: results[0] for name, results in ran.items() if results}
        return {
            f"{name} ({i})": result
            for name, results in ran.items()
            for i, result in enumerate(results, start=1)
        }

    for round_ in range(rounds):
        order = [(baseline, changes), (given, {})]
        for name, change in order[:: -1 if round_ % 2 else 1]:
            ran[name].append(run(replace(options, **change)))
            if after_each is not None:
                after_each(named())
    return named()


# A figure's label, and how it reads from one run's results.
Row = tuple[str, Callable[[dict[str, Any]], str]]


def print_registrations(runs: dict[str, dict[str, Any]]) -> None:
    """How the fleet's start went, one column per run."""
    rows: list[Row] = [
        ("every node registered in", lambda r: f"{r['setup']['register_s']:.1f} s"),
        ("tries", lambda r: f"{r['setup']['registrations']['tries']}"),
        ("tries unanswered", lambda r: f"{r['setup']['registrations']['timed_out']}"),
        ("tries refused (409)", lambda r: f"{r['setup']['registrations']['refused']}"),
        ("nodes registered after an unanswered try",
         lambda r: f"{r['setup']['registrations']['after_timeout']}"),
        ("heartbeat p50 / p99, nodes' side (ms)",
         lambda r: f"{r['heartbeat']['p50_ms']:.1f} / {r['heartbeat']['p99_ms']:.1f}"),
    ]  # fmt: skip
    _print_columns("the fleet's registrations: the same load, back to back", runs, rows)


def _gen2(pauses: dict[str, float]) -> str:
    return f"{pauses['count']:.0f}, {pauses['total_ms']:.0f}, {pauses['p99_ms']:.0f}"


def _gc_all(pauses: dict[str, dict[str, float]]) -> str:
    count = sum(p["count"] for p in pauses.values())
    return f"{count:.0f}, {sum(p['total_ms'] for p in pauses.values()):.0f}"


def _start_pair(start: dict[str, Any]) -> str:
    return f"{start['heartbeat_p50_ms']:.0f} / {start['heartbeat_p99_ms']:.0f}"


def _reads(result: dict[str, Any], phase: str) -> str:
    for read in result["reads"]:
        if read["phase"] == phase:
            return f"{read['per_s']:.0f}, {read['p99_ms']:.0f}"
    return "-"


def _pair(figures: dict[str, Any], prefix: str = "") -> str:
    return f"{figures[prefix + 'p50_ms']:.1f} / {figures[prefix + 'p99_ms']:.1f}"


# A heartbeat budget no fleet here reaches: every node is told the base interval.
FIXED_INTERVAL_BUDGET = 100_000.0


def print_side_by_side(
    runs: dict[str, dict[str, Any]], title: str = "heartbeat pace: the same load"
) -> None:
    """The figures of the load, one column per run."""
    rows: list[Row] = [
        ("interval told (longest)", lambda r: f"{r['heartbeat']['interval_told_s_max']:.1f} s"),
        ("heartbeat answers /s (503s included)", lambda r: f"{r['heartbeat']['per_s']:.0f}"),
        ("heartbeat p50 / p99, nodes' side (ms)",
         lambda r: f"{r['heartbeat']['p50_ms']:.1f} / {r['heartbeat']['p99_ms']:.1f}"),
        ("heartbeat p50 / p99, controller's (ms)", lambda r: _pair(r["heartbeat"], "server_")),
        (f"unanswered within {AGENT_TIMEOUT_S:g} s", lambda r: f"{r['heartbeat']['timed_out']}"),
        ("shed (503): waited, gone",
         lambda r: f"{r['heartbeat']['shed']['waited']:.0f}, {r['heartbeat']['shed']['gone']:.0f}"),
        ("reconcile pass p50 / p99 (ms)",
         lambda r: f"{r['reconcile']['p50_ms']:.0f} / {r['reconcile']['p99_ms']:.0f}"),
        ("reconcile pass mean (ms)", lambda r: f"{r['reconcile']['mean_ms']:.0f}"),
        ("heartbeats at or above the p99: seconds they were sent in",
         lambda r: _tail_seconds(r["heartbeat"].get("tail"))),
        ("heartbeats sent a second: fewest / median / most",
         lambda r: _per_second(r["heartbeat"].get("tail"))),
        ("heartbeat p50 / p99: answers that started a run, others (ms)",
         lambda r: _split(r["heartbeat"])),
        ("the simulated fleet's loop: late p99 / max (ms), stalls over 50 ms",
         lambda r: _loop(r.get("bench_loop"))),
        ("jobs placed", lambda r: f"{r['jobs']['placed']}"),
        ("runs under way, mean (max)",
         lambda r: f"{r['offered']['runs_running_mean']:.0f} ({r['offered']['runs_running_max']})"),
        ("runs waiting their turn, mean (fewest)", _waiting),
        ("runs per job placed", lambda r: f"{r['offered']['runs_per_job_placed']:.2f}"),
        ("reports answered /s", lambda r: f"{r['offered']['reports_per_s']:.0f}"),
        ("runs succeeded", lambda r: f"{r['jobs']['runs_succeeded']}"),
        ("runs ended a second: median / most; share in the busiest fifth of the seconds",
         _ends),
        ("nodes LOST at the end", lambda r: f"{r['nodes_by_state_at_end']['LOST']:.0f}"),
        ("report p50 / p99, nodes' side (ms)", lambda r: _pair(r["reports"])),
        ("job detail reads/s, p99 (ms)", lambda r: _reads(r, "job detail")),
        ("job detail, If-None-Match: reads/s, p99 (ms)",
         lambda r: _reads(r, "job detail, If-None-Match")),
        ("controller CPU (share of a core)",
         lambda r: f"{100 * r['controller']['cpu_share_of_one_core']:.0f} %"),
        ("of it the reconciler's process",
         lambda r: f"{100 * r['controller']['reconciler_process_cpu_share_of_one_core']:.0f} %"),
        ("of it the API's helper processes",
         lambda r: f"{100 * r['controller']['api_helpers_cpu_share_of_one_core']:.0f} %"),
        ("garbage collections, every generation: count, total (ms)",
         lambda r: _gc_all(r["controller"]["gc_pauses"])),
        ("gen 2 garbage collections: count, total, p99 (ms)",
         lambda r: _gen2(r["controller"]["gc_pauses"]["2"])),
        ("the fleet's start (left out): heartbeat p50 / p99 (ms)",
         lambda r: _start_pair(r["setup"]["fleet_start"])),
        ("PostgreSQL server CPU (share of a core)",
         lambda r: f"{100 * r['machine']['database_server_share_of_one_core']:.0f} %"),
        ("machine busy, of it in the kernel (all cores)",
         lambda r: f"{100 * r['machine']['busy_share']:.0f} %, "
         f"{100 * r['machine']['system_share']:.0f} %"),
    ]  # fmt: skip
    _print_columns(f"{title}, back to back", runs, rows)


def _print_columns(title: str, runs: dict[str, dict[str, Any]], rows: list[Row]) -> None:
    """A table of ``rows``, one column per run."""
    table = Table(title=title)
    table.add_column("figure", justify="left")
    for name in runs:
        table.add_column(name, justify="right")
    for label, cell in rows:
        table.add_row(label, *(cell(r) for r in runs.values()))
    console.print(table)


def _tail_seconds(tail: dict[str, Any] | None) -> str:
    if not tail:
        return "-"
    return f"{tail['slow']} in {tail['seconds']} of {tail['of_seconds']} s"


def _per_second(tail: dict[str, Any] | None) -> str:
    if not tail or not tail.get("per_second"):
        return "-"
    spread = tail["per_second"]
    return f"{spread['min']:.0f} / {spread['p50']:.0f} / {spread['max']:.0f}"


def _split(beats: dict[str, Any]) -> str:
    if "starting" not in beats:
        return "-"
    starting, others = beats["starting"], beats["others"]
    return (
        f"{starting['p50_ms']:.0f} / {starting['p99_ms']:.0f}, "
        f"{others['p50_ms']:.0f} / {others['p99_ms']:.0f}"
    )


def _ends(result: dict[str, Any]) -> str:
    ends = result["offered"].get("runs_ended_per_second")
    if not ends:  # none measured, or a result written before they were
        return "-"
    return f"{ends['p50']:.0f} / {ends['max']:.0f}; {100 * ends['busiest_fifth_share']:.0f} %"


def _waiting(result: dict[str, Any]) -> str:
    load = result["offered"]
    if not result["options"]["runs_at_once"]:
        return "- (closed loop)"
    return f"{load['runs_waiting_mean']:.0f} ({load['runs_waiting_min']})"


def _loop(loop: dict[str, Any] | None) -> str:
    if not loop:
        return "-"
    return (
        f"{loop['lag_p99_ms']:.0f} / {loop['lag_max_ms']:.0f}, {loop['stalls_over_50_ms']}; "
        f"{loop['collections']} collections"
    )


def _same_load(title: str) -> Callable[[dict[str, dict[str, Any]]], None]:
    return functools.partial(print_side_by_side, title=f"{title}: the same load")


# Each --baseline-* flag (as ``args`` names it): what its first run changes in ``Options``,
# the two runs' names, and how they are printed side by side.
BASELINES: dict[
    str, tuple[dict[str, Any], tuple[str, str], Callable[[dict[str, dict[str, Any]]], None]]
] = {
    "baseline_same": (
        {},
        ("first run", "second run"),
        _same_load("nothing changed, the same code and settings twice"),
    ),
    "baseline_no_registration_key": (
        {"registration_key": False},
        ("no registration key", "registration key"),
        print_registrations,
    ),
    "baseline_fixed_interval": (
        {"heartbeats_per_s_max": FIXED_INTERVAL_BUDGET},
        ("fixed interval", "paced"),
        print_side_by_side,
    ),
    "baseline_reconciler_thread": (
        {"reconciler_process": False},
        ("reconciler thread", "reconciler process"),
        _same_load("the reconciler's thread or process"),
    ),
    "baseline_no_gc_freeze": (
        {"gc_freeze": False},
        ("no gc freeze", "gc freeze"),
        _same_load("the start's objects collected or frozen"),
    ),
    "baseline_python_gc_threshold": (
        {"gc_young_threshold": PYTHON_GC_YOUNG_THRESHOLD},
        (f"gc threshold {PYTHON_GC_YOUNG_THRESHOLD}", "controller's gc threshold"),
        _same_load("the youngest objects collected at Python's threshold or the controller's"),
    ),
    "baseline_every_round_trip": (
        {"every_round_trip": True},
        ("every round trip", "fewer round trips"),
        _same_load("round trips to the database"),
    ),
    "baseline_heartbeat_synchronous_commit": (
        {"heartbeat_synchronous_commit": True},
        ("heartbeat waits for the disk", "heartbeat does not"),
        _same_load("a heartbeat's commit flushed to disk before its answer, or not"),
    ),
    "baseline_shared_threads": (
        {"heartbeat_threads": 0},
        ("shared threads", "heartbeats' own"),
        _same_load("heartbeats on threads of their own"),
    ),
    "baseline_no_shedding": (
        {"heartbeat_wait_max_s": 0.0},
        ("no shedding", "shedding"),
        _same_load("heartbeats nobody waits for worked on or shed"),
    ),
    "baseline_short_keep_alive": (
        {"keep_alive_s": 5},
        ("5 s keep-alive", "kept alive"),
        _same_load("idle connections closed after 5 s or kept"),
    ),
    "baseline_bench_collects": (
        {"hold_own_collector": False},
        ("bench collects", "bench's collector held"),
        _same_load("the simulated fleet's own garbage collector running or held"),
    ),
    "baseline_lockstep": (
        {"step_spread": 0.0},
        ("runs of one length", "runs of spread lengths"),
        _same_load("every simulated run the same length, or each its own"),
    ),
    "baseline_shared_cores": (
        {"controller_cores": None},
        ("every core shared", "controller's cores apart"),
        _same_load(
            "the controller on every core, or on cores apart from the fleet's and the database's"
        ),
    ),
    "baseline_one_api_process": (
        {"api_processes": 1, "api_threads": None},
        ("one API process", "API processes"),
        _same_load("the API on one process or several"),
    ),
}


if __name__ == "__main__":
    main()
