"""Runtime events: what the launcher and rank 0 tell the controller, one model per kind.

An event is one JSON object, ``{"time": ..., "kind": "...", "data": {...}}``,
written as one line to the attempt's events file, read by the node agent and
sent to the controller in its reports. ``data`` is the payload of the kind
(``RendezvousComplete`` for ``"rendezvous"``, ...): each field is bounded as
the controller's database needs it and optional, with the default the
controller reads for a field left out. Keys a payload does not know are ignored,
so a newer node may send more.

An event that does not validate is refused where it is parsed: the agent drops
its line (logged), the controller refuses the report (422).
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from contract.fields import (
    ByteCount,
    Count,
    FiniteOrNone,
    Int32,
    PlainText,
    PrintedText,
    Sha256OrNone,
)

# An event line stays under this size, so that it is appended whole with one write;
# no text of an event a node wrote is longer.
MAX_LINE_BYTES = 4096
Text = Annotated[PrintedText, Field(max_length=MAX_LINE_BYTES)]


class EventKind(StrEnum):
    """What a runtime event reports.

    From the launcher (any node): RENDEZVOUS, WORKER_FAILED, HANG, LAUNCHER_EXIT,
    ZYGOTE, COLD_START.
    From the training runtime (rank 0 only): STARTED, PROGRESS, SNAPSHOT,
    SNAPSHOT_FAILED, SNAPSHOT_SKIPPED, FINISHED.
    """

    RENDEZVOUS = "rendezvous"
    WORKER_FAILED = "worker_failed"
    LAUNCHER_EXIT = "launcher_exit"
    HANG = "hang"
    STARTED = "started"
    PROGRESS = "progress"
    SNAPSHOT = "snapshot"
    SNAPSHOT_FAILED = "snapshot_failed"
    SNAPSHOT_SKIPPED = "snapshot_skipped"
    FINISHED = "finished"
    ZYGOTE = "zygote"
    COLD_START = "cold_start"


class EventData(BaseModel):
    """The payload of one kind of event; ``kind`` names it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: ClassVar[EventKind]


class RendezvousComplete(EventData):
    """A rendezvous round ended: this node's workers have their ranks."""

    kind = EventKind.RENDEZVOUS
    world_size: Count | None = None
    group_rank: Count | None = None  # this node's rank among the nodes
    group_world_size: Count | None = None  # nodes in the round
    restart_count: Count | None = None  # restarts of the workers in this launcher


class WorkerFailed(EventData):
    """A worker process failed; ``fatal`` when the job must fail without a restart."""

    kind = EventKind.WORKER_FAILED
    local_rank: Count | None = None
    global_rank: Count | None = None
    exitcode: Int32 | None = None
    message: Text = ""
    # "crash" | "hang" | "fatal_exit_code" | "startup_error" | "peer_lost" | "membership_change"
    cause: Text = Field(default="crash", min_length=1, max_length=64)
    fatal: bool = False


# Causes of a worker's end that are no failure of the job, so cost no restart: its
# collective broke because a peer went away ("peer_lost"), or its node agent ended it
# because the controller dropped a member of the attempt ("membership_change").
UNCHARGED_CAUSES = frozenset({"peer_lost", "membership_change"})


class HangDetected(EventData):
    """A worker made no progress for ``timeout_s``; it is ended and the workers restart.

    ``rule`` says where ``timeout_s`` came from: ``fixed`` (the spec's number) or
    ``adaptive`` (derived from the worker's beats); ``derivation`` says how, in words.
    ``teardown``: the worker had begun its teardown and then used almost no CPU for
    ``timeout_s`` (``worker.hang.TeardownWatch``); it is ended as finished, and nothing
    restarts.
    """

    kind = EventKind.HANG
    local_rank: Count | None = None
    global_rank: Count | None = None
    idle_s: FiniteOrNone = None
    timeout_s: FiniteOrNone = None
    rule: Literal["fixed", "adaptive", "teardown"] | None = None
    derivation: Annotated[PrintedText, Field(max_length=300)] | None = None
    # The hung workers were all that still ran on their node, and another node's workers
    # had all finished: they are ended, nothing restarts, and the node ends as finished.
    peers_finished: bool = False


class LauncherExited(EventData):
    """The launcher is about to exit; the agent's exit report carries the outcome."""

    kind = EventKind.LAUNCHER_EXIT
    outcome: Literal["succeeded", "failed", "closed"] | None = None
    exitcode: Int32 | None = None
    message: Text = ""
    fatal: bool = False


class ZygoteChanged(EventData):
    """The launcher's warm zygote (``worker.warm``): ``ready`` to fork workers (after
    ``import_s`` seconds of start, holding ``rss_bytes`` of memory), ``lost`` (it died;
    another is started) or ``unavailable`` (workers start cold from now). ``spare``: it is
    the node's spare zygote, loaded before the job was placed; ``spare_passed_over``: why
    the node's spare could not be this job's, so that this one was started for it."""

    kind = EventKind.ZYGOTE
    state: Literal["ready", "lost", "unavailable"] | None = None
    pid: Count | None = None
    import_s: FiniteOrNone = None
    rss_bytes: ByteCount | None = None
    message: Text = ""
    spare: bool = False
    spare_passed_over: Text = ""


class ColdStarted(EventData):
    """A worker was started as a new interpreter, not forked from the zygote; ``reason``
    says why."""

    kind = EventKind.COLD_START
    local_rank: Count | None = None
    reason: Text = ""


class WorkerStartup(BaseModel):
    """When rank 0's worker process reached each step of its start, by its node's clock.

    ``process_started_at`` is when the process was created (the kernel's record of
    it), ``imported_at`` when the worker's first code ran after importing torch,
    then ``process_group_at`` (the process group joined), ``snapshot_loaded_at``
    (resumed from a snapshot) and ``first_step_at`` (the first optimizer step done).
    A moment the worker did not see is None (a script that loads no snapshot, or
    joins the process group itself).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    process_started_at: datetime | None = None
    imported_at: datetime | None = None
    process_group_at: datetime | None = None
    snapshot_loaded_at: datetime | None = None
    first_step_at: datetime | None = None


class TrainingStarted(EventData):
    """Training (re)started; ``resumed_from_step`` is None when it starts from scratch.

    ``startup`` holds the moments of the process's start seen so far (no first step).
    """

    kind = EventKind.STARTED
    world_size: Count | None = None
    restart_count: Count | None = None
    resumed_from_step: Count | None = None
    total_steps: Count | None = None
    startup: WorkerStartup | None = None


# Named scalar metrics of one progress report: a few short names, each a number.
MAX_NAMED_METRICS = 16
MetricName = Annotated[PlainText, Field(min_length=1, max_length=64)]


class TrainingProgress(EventData):
    """Where training is: ``step_time_s`` is the mean time of the steps since the last
    report; ``metrics`` are the script's own named scalars (a value that is not finite
    reads as none)."""

    kind = EventKind.PROGRESS
    step: Count = 0
    epoch: Count = 0
    loss: FiniteOrNone = None
    samples_per_s: FiniteOrNone = None
    world_size: Count = 0
    step_time_s: FiniteOrNone = None
    metrics: dict[MetricName, FiniteOrNone] = Field(
        default_factory=dict, max_length=MAX_NAMED_METRICS
    )
    # Only on the first report of a worker process: its start, first step included.
    startup: WorkerStartup | None = None


class SnapshotSaved(EventData):
    """A snapshot was committed (its manifest written) at ``path``."""

    kind = EventKind.SNAPSHOT
    step: Count = 0
    epoch: Count = 0
    world_size: Count | None = None
    path: Text = ""
    bytes: ByteCount = 0
    sha256: Sha256OrNone = None
    seconds: FiniteOrNone = None
    background: bool = False


class SnapshotFailed(EventData):
    """A save was abandoned; training goes on."""

    kind = EventKind.SNAPSHOT_FAILED
    step: Count | None = None
    error: Text = ""


class SnapshotSkipped(EventData):
    """A snapshot did not verify on resume and was passed over."""

    kind = EventKind.SNAPSHOT_SKIPPED
    step: Count | None = None
    reason: Text = ""


class TrainingFinished(EventData):
    kind = EventKind.FINISHED
    step: Count | None = None
    loss: FiniteOrNone = None
    output_path: Text = ""


class _Event(BaseModel):
    time: datetime


class RendezvousEvent(_Event):
    kind: Literal[EventKind.RENDEZVOUS]
    data: RendezvousComplete = Field(default_factory=RendezvousComplete)


class WorkerFailedEvent(_Event):
    kind: Literal[EventKind.WORKER_FAILED]
    data: WorkerFailed = Field(default_factory=WorkerFailed)


class HangEvent(_Event):
    kind: Literal[EventKind.HANG]
    data: HangDetected = Field(default_factory=HangDetected)


class LauncherExitEvent(_Event):
    kind: Literal[EventKind.LAUNCHER_EXIT]
    data: LauncherExited = Field(default_factory=LauncherExited)


class StartedEvent(_Event):
    kind: Literal[EventKind.STARTED]
    data: TrainingStarted = Field(default_factory=TrainingStarted)


class ProgressEvent(_Event):
    kind: Literal[EventKind.PROGRESS]
    data: TrainingProgress = Field(default_factory=TrainingProgress)


class SnapshotEvent(_Event):
    kind: Literal[EventKind.SNAPSHOT]
    data: SnapshotSaved = Field(default_factory=SnapshotSaved)


class SnapshotFailedEvent(_Event):
    kind: Literal[EventKind.SNAPSHOT_FAILED]
    data: SnapshotFailed = Field(default_factory=SnapshotFailed)


class SnapshotSkippedEvent(_Event):
    kind: Literal[EventKind.SNAPSHOT_SKIPPED]
    data: SnapshotSkipped = Field(default_factory=SnapshotSkipped)


class FinishedEvent(_Event):
    kind: Literal[EventKind.FINISHED]
    data: TrainingFinished = Field(default_factory=TrainingFinished)


class ZygoteEvent(_Event):
    kind: Literal[EventKind.ZYGOTE]
    data: ZygoteChanged = Field(default_factory=ZygoteChanged)


class ColdStartEvent(_Event):
    kind: Literal[EventKind.COLD_START]
    data: ColdStarted = Field(default_factory=ColdStarted)


RuntimeEvent = Annotated[
    RendezvousEvent
    | WorkerFailedEvent
    | HangEvent
    | LauncherExitEvent
    | StartedEvent
    | ProgressEvent
    | SnapshotEvent
    | SnapshotFailedEvent
    | SnapshotSkippedEvent
    | FinishedEvent
    | ZygoteEvent
    | ColdStartEvent,
    Field(discriminator="kind"),
]

_RUNTIME_EVENT: TypeAdapter[RuntimeEvent] = TypeAdapter(RuntimeEvent)


def runtime_event(data: EventData, time: datetime | None = None) -> RuntimeEvent:
    """The event of ``data``'s kind that carries it, at ``time`` (default: now, UTC)."""
    return _RUNTIME_EVENT.validate_python(
        {"time": time or datetime.now(UTC), "kind": data.kind, "data": data}
    )


def parse_event(line: str | bytes) -> RuntimeEvent:
    """One event from its JSON; ``pydantic.ValidationError`` if it is not a valid one."""
    return _RUNTIME_EVENT.validate_json(line)
