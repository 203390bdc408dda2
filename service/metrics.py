"""The controller's Prometheus metrics: one registry per app, served at ``/metrics``.

Two kinds, and the difference matters when several controllers share a database:

- Process metrics, this controller's own: how long its reconciler passes, heartbeat
  answers and API requests take, the snapshots reported to it, its CPU and memory
  (``process_*``). Each controller has its own; add them up (or compare them) across
  controllers in PromQL.
  A controller that answers the API on several processes (``RELAUNCH_API_PROCESSES``)
  serves them added up over its processes, from any of them: each helper sends its
  counts and histograms to the controller every second (``HelperShares``).
- Cluster metrics, read from the database at scrape time: jobs and nodes by state, the
  restarts and membership changes summed over every job. Every controller reports the
  same values; take ``max`` across controllers, never ``sum``.

No label names a job, a user or a node, and none takes an unbounded set of values: the
API's label is the route's path template (``/api/v1/jobs/{job_id}``), never the path.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import InstrumentedAttribute, Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contract.events import SnapshotSaved
from service.db import transaction
from service.gc_pauses import GcPauses
from service.models import Job, Node
from service.states import JobState, NodeState

logger = logging.getLogger(__name__)

# Seconds: from a fast heartbeat (a few ms) to a reconciler pass that is far too slow; finer
# about the targets (a heartbeat in 50 ms, a pass in 100 ms), whose p99 is read off these.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.5, 1, 2.5, 5, 10, 30,
)  # fmt: skip
# Snapshot sizes, 1 MiB to 1 TiB in powers of four.
SNAPSHOT_BYTES_BUCKETS = tuple(float(2**20 * 4**k) for k in range(11))
SNAPSHOT_SECONDS_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# The route label of a request that matched no route: a scan of random paths must not
# make a series per path.
UNMATCHED_ROUTE = "<unmatched>"


LEADER = "relaunch_controller_leader"
LEADER_HELP = "1 while this controller holds the leader lease (its reconciler acts), else 0"


class ReconcilerMetrics:
    """The metrics of the reconciler's passes, in ``registry``: the controller's own, or,
    where the reconciler runs in a process of its own, that process's, whose samples
    reach the controller's ``/metrics`` through ``Relayed``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reconcile_pass = Histogram(
            "relaunch_reconcile_pass_seconds",
            "Time of one reconciler pass of the leading controller: read the database, "
            "plan, apply every action",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.reconcile_phase = Histogram(
            "relaunch_reconcile_phase_seconds",
            "Time of each phase of a pass: lease (renew it, once a quarter of it has passed), "
            "fleet (read the nodes and the placed jobs), queue (read as much of the queue as the "
            "pass needs), plan (decide), apply (the actions, in transactions of their own or in "
            "batches)",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.reconcile_split = Histogram(
            "relaunch_reconcile_pass_split_seconds",
            "Where a pass's time went, as Linux's scheduler counts it for the thread that "
            "runs it: running (on a CPU), runnable (ready, waiting for a CPU the host's other "
            "processes held), blocked (asleep: waiting on the database, a lock or Python's "
            "interpreter lock); none where the kernel does not say",
            ["state"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.reconcile_actions = Counter(
            "relaunch_reconcile_actions",
            "Actions the reconciler decided, by kind (PlaceJob, MarkNodeLost, ...)",
            ["action"],
            registry=registry,
        )
        self.reconcile_queue_reads = Counter(
            "relaunch_reconcile_queue_reads",
            "Passes by how much of the queue of PENDING jobs they read: whole, or only its "
            "head (up to where the jobs read fill the free nodes, and the new jobs)",
            ["read"],
            registry=registry,
        )
        self.leader = Gauge(LEADER, LEADER_HELP, registry=registry)


class Relayed(Collector):
    """Metrics collected in another process and sent here (``update``), served as last
    received; until the first, and after that process is gone, only
    ``relaunch_controller_leader`` 0."""

    def __init__(self) -> None:
        self._metrics: list[Metric] = []
        self.not_leading()

    def update(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def not_leading(self) -> None:
        """The process that sent them is gone: its counts with it, and it leads nothing."""
        self._metrics = [GaugeMetricFamily(LEADER, LEADER_HELP, value=0)]

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)


API_PROCESSES = "relaunch_api_processes"


class HelperShares:
    """What the API's helper processes (``service.api_processes``) last sent of their
    own counters and histograms, by helper; ``merged`` adds them to this process's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_helper: dict[int, list[Metric]] = {}
        # What helpers that have exited had counted: kept, so that no sum ever falls
        # (``rate`` would read a fall as a reset, and count everything again).
        self._retired: list[Metric] = []

    def update(self, helper: int, metrics: list[Metric]) -> None:
        with self._lock:
            self._by_helper[helper] = metrics

    def forget(self, helper: int) -> None:
        """The helper has exited: its last share is kept with the others that did."""
        with self._lock:
            last = self._by_helper.pop(helper, None)
            if last is not None:
                self._retired = _merge(self._retired, [last])

    def merged(self, own: Iterable[Metric]) -> list[Metric]:
        """``own`` with every helper's share added: samples of one name and labels are
        summed (``_created``: the earliest), and the number of processes that answer
        the API (this one and the helpers that sent) is ``relaunch_api_processes``."""
        with self._lock:
            helpers = list(self._by_helper.values())
            retired = self._retired
        processes = GaugeMetricFamily(
            API_PROCESSES,
            "Processes answering the API: this controller's own and its helpers "
            "(RELAUNCH_API_PROCESSES) that have sent their metrics",
            value=1 + len(helpers),
        )
        return [*_merge(own, [retired, *helpers]), processes]


def shared_by_helper(metrics: Iterable[Metric]) -> list[Metric]:
    """What a helper sends of its metrics: relaunch's counters and histograms, which add
    up over processes (not gauges, nor the process's own ``process_*``)."""
    return [m for m in metrics if m.name.startswith("relaunch_") and m.type != "gauge"]


def _merge(own: Iterable[Metric], shares: list[list[Metric]]) -> list[Metric]:
    """``own`` with ``shares`` added, as new families (none of them is changed)."""
    families: dict[str, Metric] = {}
    for family in itertools.chain(own, *shares):
        into = families.get(family.name)
        if into is None:
            families[family.name] = _copy(family)
        elif into.type == family.type:
            _add(into, family)
    return list(families.values())


def _copy(family: Metric) -> Metric:
    copied = Metric(family.name, family.documentation, family.type, family.unit)
    copied.samples = list(family.samples)
    return copied


def _add(into: Metric, family: Metric) -> None:
    where = {(s.name, tuple(sorted(s.labels.items()))): i for i, s in enumerate(into.samples)}
    for sample in family.samples:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        at = where.get(key)
        if at is None:
            where[key] = len(into.samples)
            into.samples.append(sample)
            continue
        was = into.samples[at]
        if sample.name.endswith("_created"):
            value = min(was.value, sample.value)
        else:
            value = was.value + sample.value
        into.samples[at] = was._replace(value=value)


class _Families(Collector):
    """What ``generate_latest`` reads: families already collected."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class ControllerMetrics:
    """Every metric of one controller process, in a registry of its own (two apps in one
    process, as in the tests, do not share counts). In an API helper (``exposed_by``),
    ``/metrics`` is the controller's, which adds the helpers' shares (``helpers``)."""

    def __init__(
        self,
        read_factory: sessionmaker[Session] | None = None,
        *,
        reconciler_here: bool = True,
        exposed_by: Callable[[], bytes] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.helpers = HelperShares()
        self._exposed_by = exposed_by
        # The reconciler's metrics as its child process last sent them, when it runs in one.
        self.relayed = Relayed()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.reconciler: ReconcilerMetrics | None = None
        if reconciler_here:
            self.reconciler = ReconcilerMetrics(self.registry)
        else:
            self.registry.register(self.relayed)
        self.heartbeat = Histogram(
            "relaunch_heartbeat_seconds",
            "Time to answer one node heartbeat, from the request to the reply's last byte",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.shed = Counter(
            "relaunch_requests_shed_total",
            "Requests answered 503 without being worked on, by lane (heartbeat) and reason: "
            "gone (the client closed the connection) or waited (longer than the lane's bound)",
            ["lane", "reason"],
            registry=self.registry,
        )
        self.request = Histogram(
            "relaunch_http_request_seconds",
            "Time to answer an HTTP request, by route template, method and status class",
            ["route", "method", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.snapshot_bytes = Histogram(
            "relaunch_snapshot_bytes",
            "Size of the snapshots that nodes reported saved",
            buckets=SNAPSHOT_BYTES_BUCKETS,
            registry=self.registry,
        )
        self.snapshot_seconds = Histogram(
            "relaunch_snapshot_seconds",
            "Time the nodes took to save the snapshots they reported",
            buckets=SNAPSHOT_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.gc_pauses = GcPauses(self.registry, LATENCY_BUCKETS)
        if read_factory is not None:
            self.registry.register(ClusterCollector(read_factory))

    def observe_snapshots(self, saved: Iterable[SnapshotSaved]) -> None:
        for snapshot in saved:
            self.snapshot_bytes.observe(snapshot.bytes)
            if snapshot.seconds is not None:
                self.snapshot_seconds.observe(snapshot.seconds)

    def exposition(self) -> bytes:
        """The text format of every metric, as scraped: this process's with the API
        helpers' added, or, in a helper, the controller's answer."""
        if self._exposed_by is not None:
            return self._exposed_by()
        return generate_latest(_Families(self.helpers.merged(self.registry.collect())))

    def shares(self) -> list[Metric]:
        """What a helper sends the controller (``shared_by_helper``)."""
        return shared_by_helper(self.registry.collect())


class ClusterCollector(Collector):
    """Jobs and nodes by state and the sums over jobs, read at scrape time: two grouped
    counts and one sum over indexed columns, however many jobs there are.

    A database that does not answer costs no failed scrape: the families are left out
    and ``relaunch_database_up`` says 0.
    """

    def __init__(self, read_factory: sessionmaker[Session]) -> None:
        self._factory = read_factory

    def describe(self) -> Iterable[Metric]:
        return []  # read at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "relaunch_database_up", "1 if the database answered this scrape's queries, else 0"
        )
        try:
            with transaction(self._factory) as session:
                jobs = _counts(session, Job.state)
                nodes = _counts(session, Node.state)
                restarts, changes = session.execute(
                    select(
                        func.coalesce(func.sum(Job.restart_count), 0),
                        func.coalesce(func.sum(Job.membership_changes), 0),
                    )
                ).one()
        except SQLAlchemyError as exc:
            logger.warning("metrics: the database did not answer: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        by_job_state = GaugeMetricFamily(
            "relaunch_jobs", "Jobs by state (every job the database holds)", labels=["state"]
        )
        for job_state in JobState:
            by_job_state.add_metric([job_state.value], jobs.get(job_state, 0))
        yield by_job_state
        by_node_state = GaugeMetricFamily("relaunch_nodes", "Nodes by state", labels=["state"])
        for node_state in NodeState:
            by_node_state.add_metric([node_state.value], nodes.get(node_state, 0))
        yield by_node_state
        yield CounterMetricFamily(
            "relaunch_job_restarts",
            "Restarts charged to jobs' budgets, summed over every job",
            value=int(restarts),
        )
        yield CounterMetricFamily(
            "relaunch_job_membership_changes",
            "Membership changes (nodes that left or joined a running attempt), summed over "
            "every job; not restarts",
            value=int(changes),
        )


def _counts(session: Session, state: InstrumentedAttribute[Any]) -> dict[Any, int]:
    """How many rows have each value of ``state``."""
    rows = session.execute(select(state, func.count()).group_by(state))
    return {value: count for value, count in rows}


# Where ``RequestMetrics`` notes when a request reached the app (``time.monotonic``).
ARRIVED = "relaunch.arrived"


class RequestMetrics:
    """Times every HTTP request into ``relaunch_http_request_seconds``, labelled by the
    route's path template; heartbeats also into ``relaunch_heartbeat_seconds``.

    ``api_prefix`` is the prefix the API's routers are included under, and
    ``heartbeat_route`` the heartbeat's template with it."""

    def __init__(
        self, app: ASGIApp, metrics: ControllerMetrics, api_prefix: str, heartbeat_route: str
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.api_prefix = api_prefix
        self.heartbeat_route = heartbeat_route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        scope[ARRIVED] = time.monotonic()
        status = 500  # what the client gets if the app raises before it answers

        async def noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_status)
        finally:
            elapsed = time.perf_counter() - start
            route = route_template(scope, self.api_prefix)
            self.metrics.request.labels(route, scope["method"], f"{status // 100}xx").observe(
                elapsed
            )
            if route == self.heartbeat_route:
                self.metrics.heartbeat.observe(elapsed)


def route_template(scope: Scope, api_prefix: str) -> str:
    """The path template of the route that served ``scope`` (the router puts the route
    there as it matches), or ``UNMATCHED_ROUTE``.

    A route of a router included under ``api_prefix`` may know its path without the
    prefix (FastAPI keeps the router's own route); the prefix is put back."""
    path = getattr(scope.get("route"), "path", None)
    if not isinstance(path, str) or not path:
        return UNMATCHED_ROUTE
    if scope["path"].startswith(api_prefix + "/") and not path.startswith(api_prefix + "/"):
        return api_prefix + path
    return path
