"""A recovery's anatomy: how long each phase of a restart or re-form took.

A recovery begins with what ended the workers (a failure, a hang, a node that
left, joined or went missing), and ends with the first training step of the new
rank 0 process. Its moments, in order, and who took each one's time:

- ``fault``: when the fault happened, known only to whoever caused it (a
  benchmark); the controller never knows it;
- ``failed``: the failure recorded: the node of the failed worker (``worker_failed``,
  ``hang_detected``, ``node_missing``) or the controller (``node_left``, ``node_joined``);
- ``rendezvous``: the new rendezvous round complete, by the node of group rank 0;
- ``process_started``, ``imported``, ``process_group``, ``snapshot_loaded``,
  ``first_step``: rank 0's new worker process, by its node's clock (see
  ``worker.runtime.startup``).

A phase is named after the moment that ends it and runs from the previous moment
that is known; a moment nobody reported leaves its phase None and the next phase
covers it. A phase between two clocks (``same_clock`` false) also holds their
difference: nodes' clocks are not in step with each other or with the controller,
and a node's event the controller stamped no earlier than a membership change
(``reports._Applied.timeline_time``) moved too. The phases of one process are on
one clock.

What a recovery is not: the job's first start, with a node that joins before the
first rendezvous (``node_joined`` with cause ``placed``), and a fatal failure, or a
cancel, after which nothing restarts. The worker's moments come from the job's own
code: one outside [the cause - ``MAX_MOMENT_BEFORE``, its event + ``MAX_MOMENT_AFTER``]
is taken as not reported. A phase negative by no more than ``CLOCK_RESOLUTION_S``
(a process's start is known to a clock tick) is 0.0; a larger negative one is shown
as it is.

Pure: ``recoveries`` reads a job's timeline events, oldest first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from contract.events import WorkerStartup

# Timeline kinds that end the workers of an attempt (see ``service.reports``, ``service.nodes``).
NODE_CAUSES = frozenset({"worker_failed", "hang_detected", "node_missing"})
CONTROLLER_CAUSES = frozenset({"node_left", "node_joined"})
CAUSES = NODE_CAUSES | CONTROLLER_CAUSES
# Timeline kinds after which an open recovery never completes.
ENDS = frozenset({"cancelled"})
# Timeline kinds whose payload holds a worker's ``startup``, the most complete first.
STARTUP_KINDS = ("first_step", "resumed", "training_started")

PHASES = (
    # phase, the moment that ends it
    ("detection", "failed"),
    ("rendezvous", "rendezvous"),
    ("process_start", "process_started"),
    ("imports", "imported"),
    ("process_group", "process_group"),
    ("snapshot_load", "snapshot_loaded"),
    ("first_step", "first_step"),
)
# How far a phase may come out negative from the resolution of the clocks alone: the
# kernel records a process's start to a clock tick (``worker.runtime.process_clock``).
CLOCK_RESOLUTION_S = 0.01
# A worker-reported moment is believed from this long before the recovery's cause to
# this long after the controller got the event that carries it.
MAX_MOMENT_BEFORE = timedelta(hours=1)
MAX_MOMENT_AFTER = timedelta(seconds=60)
CONTROLLER = "controller"
OBSERVER = "observer"  # whoever caused the fault


@dataclass(frozen=True)
class TimelineEvent:
    """One event of a job's timeline, as much of it as a recovery needs."""

    kind: str
    time: datetime
    node_id: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Phase:
    name: str
    since: str  # the moment it runs from
    seconds: float | None
    same_clock: bool


@dataclass(frozen=True)
class Recovery:
    """One restart or re-form: its cause, its moments (``moments[name] = (time, clock)``)
    and its phases in order."""

    cause: str
    moments: dict[str, tuple[datetime, str]]
    phases: tuple[Phase, ...]

    @property
    def complete(self) -> bool:
        return "first_step" in self.moments

    @property
    def total_s(self) -> float | None:
        """From the first moment known to the first step, the sum of the phases (None
        before the first step); a phase of the clock's resolution counts as its 0.0."""
        if not self.complete:
            return None
        return sum(p.seconds for p in self.phases if p.seconds is not None)


def phases(moments: dict[str, tuple[datetime, str]]) -> tuple[Phase, ...]:
    """The phases between ``moments`` (see the module's docstring); a phase before the
    first moment known has none to run from and is None."""
    out = []
    previous: tuple[str, datetime, str] | None = None
    if "fault" in moments:
        at, clock = moments["fault"]
        previous = ("fault", at, clock)
    for name, moment in PHASES:
        if moment not in moments:
            out.append(Phase(name, previous[0] if previous else "", None, False))
            continue
        at, clock = moments[moment]
        if previous is None:
            out.append(Phase(name, "", None, False))
        else:
            since, then, then_clock = previous
            seconds = (at - then).total_seconds()
            if -CLOCK_RESOLUTION_S <= seconds < 0:
                seconds = 0.0
            out.append(Phase(name, since, seconds, clock == then_clock))
        previous = (moment, at, clock)
    return tuple(out)


def startup_moments(startup: WorkerStartup, clock: str) -> dict[str, tuple[datetime, str]]:
    """The moments a worker reported, on ``clock``."""
    found = {
        "process_started": startup.process_started_at,
        "imported": startup.imported_at,
        "process_group": startup.process_group_at,
        "snapshot_loaded": startup.snapshot_loaded_at,
        "first_step": startup.first_step_at,
    }
    return {name: (_utc(at), clock) for name, at in found.items() if at is not None}


def recoveries(events: Iterable[TimelineEvent]) -> list[Recovery]:
    """Every recovery of a job, oldest first, from its timeline events.

    Events are taken in time order. A cause opens a recovery unless one is open
    (the failures of one incident before its rendezvous are one recovery); the
    first rendezvous after it closes the waiting; the first worker start reported
    after that gives the process's moments. The first start of the job is no recovery.
    """
    found: list[_Open] = []
    for event in sorted(events, key=lambda e: _utc(e.time)):
        current = found[-1] if found else None
        if event.kind in ENDS:
            if current is not None and not current.complete:
                found.pop()
        elif _is_cause(event):
            if current is None or current.rendezvous is not None:
                clock = CONTROLLER if event.kind in CONTROLLER_CAUSES else _node(event)
                found.append(_Open(event.kind, (_utc(event.time), clock)))
        elif event.kind == "rendezvous":
            if current is not None and current.rendezvous is None:
                current.rendezvous = (_utc(event.time), _node(event))
        elif event.kind in STARTUP_KINDS and current is not None and current.rendezvous:
            current.offer(event)
    return [recovery.closed() for recovery in found]


def _is_cause(event: TimelineEvent) -> bool:
    if event.kind not in CAUSES:
        return False
    if event.kind in CONTROLLER_CAUSES and event.data.get("cause") == "placed":
        return False  # a node of the first world, before its first rendezvous
    return not (event.kind == "worker_failed" and event.data.get("fatal") is True)


@dataclass
class _Open:
    cause: str
    failed: tuple[datetime, str]
    rendezvous: tuple[datetime, str] | None = None
    startup: dict[str, tuple[datetime, str]] = field(default_factory=dict)
    # how complete the startup taken is (lower: more): its kind's rank, less its moments
    startup_rank: tuple[int, int] = (len(STARTUP_KINDS), 0)

    @property
    def complete(self) -> bool:
        return "first_step" in self.startup

    def offer(self, event: TimelineEvent) -> None:
        try:
            startup = WorkerStartup.model_validate(event.data.get("startup"))
        except ValidationError:
            return  # an event from a worker that reported no moments
        earliest, latest = self.failed[0] - MAX_MOMENT_BEFORE, _utc(event.time) + MAX_MOMENT_AFTER
        moments = {
            name: moment
            for name, moment in startup_moments(startup, _node(event)).items()
            if earliest <= moment[0] <= latest
        }
        rank = (STARTUP_KINDS.index(event.kind), -len(moments))
        if rank < self.startup_rank:
            self.startup, self.startup_rank = moments, rank

    def closed(self) -> Recovery:
        moments = {"failed": self.failed}
        if self.rendezvous is not None:
            moments["rendezvous"] = self.rendezvous
        moments.update(self.startup)
        return Recovery(self.cause, moments, phases(moments))


def with_fault(recovery: Recovery, fault_at: datetime) -> Recovery:
    """``recovery`` with the moment of its fault, on the observer's clock."""
    moments = {"fault": (_utc(fault_at), OBSERVER), **recovery.moments}
    return Recovery(recovery.cause, moments, phases(moments))


def _node(event: TimelineEvent) -> str:
    return f"node {event.node_id}" if event.node_id is not None else CONTROLLER


def _utc(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def from_rows(rows: Sequence[Any]) -> list[TimelineEvent]:
    """Timeline events from rows with ``kind``, ``time``, ``node_id`` and ``data``."""
    return [TimelineEvent(r.kind, r.time, r.node_id, dict(r.data or {})) for r in rows]
