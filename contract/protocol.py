"""The wire contract between the controller and its node agents.

Plain pydantic models, importable without torch. The controller answers every
heartbeat with the *complete* set of attempts the node should be running now
(level-triggered): an attempt the agent runs that is not in the reply must be
stopped, one in the reply that the agent does not run must be started.

Events travel from a node to the controller as data (``contract.events``),
whether they come from the launcher (rendezvous rounds, worker failures) or
from the training runtime on rank 0 (start, progress, snapshots, finish). Both
write JSON lines to the file named by ``EVENTS_FILE_ENV``; the agent tails it.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from contract.events import RuntimeEvent
from contract.fields import Id, Int32, PlainText, PrintedText

# A controller on this host at its default port (RELAUNCH_PORT): the one-host setup.
DEFAULT_CONTROLLER_URL = "http://127.0.0.1:8080"

# Environment variables the node agent sets for the launcher and its workers.
JOB_ID_ENV = "RELAUNCH_JOB_ID"
ATTEMPT_ID_ENV = "RELAUNCH_ATTEMPT_ID"  # the controller's id of the attempt
ATTEMPT_NUMBER_ENV = "RELAUNCH_ATTEMPT_NUMBER"  # the job's own count: 1, 2, ... (what users see)
NODE_NAME_ENV = "RELAUNCH_NODE_NAME"
SNAPSHOT_DIR_ENV = "RELAUNCH_SNAPSHOT_DIR"
SNAPSHOT_EVERY_STEPS_ENV = "RELAUNCH_SNAPSHOT_EVERY_STEPS"
SNAPSHOT_EVERY_EPOCHS_ENV = "RELAUNCH_SNAPSHOT_EVERY_EPOCHS"
SNAPSHOT_KEEP_ENV = "RELAUNCH_SNAPSHOT_KEEP"
SNAPSHOT_ASYNC_ENV = "RELAUNCH_SNAPSHOT_ASYNC"
EVENTS_FILE_ENV = "RELAUNCH_EVENTS_FILE"
# Each worker touches ``<dir>/local-<LOCAL_RANK>`` as it makes progress (hang detection).
PROGRESS_DIR_ENV = "RELAUNCH_PROGRESS_DIR"
# The controller's URL, or the node's comma-separated list of controllers of one database,
# and the attempt's worker token (``Assignment.worker_token``): rank 0 takes and checks
# its snapshot-writer token there. Never the node's own token.
CONTROLLER_URL_ENV = "RELAUNCH_CONTROLLER_URL"
WORKER_TOKEN_ENV = "RELAUNCH_WORKER_TOKEN"
# Seconds a collective may wait before it fails (``Assignment.collective_timeout_s``);
# the built-in Trainer gives it to ``init_process_group``.
COLLECTIVE_TIMEOUT_ENV = "RELAUNCH_COLLECTIVE_TIMEOUT_S"
# The longest a worker may go without a beat when its timeout is derived from its own
# beats (``hang_timeout_s: auto``), and what such a job is sent as ``hang_timeout_s``.
ADAPTIVE_HANG_CAP_S = 600.0
# "cuda" or "cpu": the device the attempt was placed for (``Assignment.device``). With
# "cuda" the agent also sets CUDA_VISIBLE_DEVICES to the attempt's GPUs on the node, so
# that local rank n is visible device n.
DEVICE_ENV = "RELAUNCH_DEVICE"
CUDA_VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
MAX_GPUS_PER_NODE = 64

Device = Literal["cpu", "cuda"]


class GpuInfo(BaseModel):
    """One GPU of a node, as its agent found it (NVML) or was told (RELAUNCH_AGENT_GPUS)."""

    index: int = Field(ge=0, lt=MAX_GPUS_PER_NODE, description="The GPU's index on its node")
    name: PlainText = Field(default="", max_length=128, description="Its model, as NVML names it")
    uuid: PlainText | None = Field(default=None, max_length=128)
    memory_total_bytes: int | None = Field(default=None, ge=0, le=2**50)


class GpuUsage(BaseModel):
    """One GPU's use when the agent last looked (each heartbeat)."""

    index: int = Field(ge=0, lt=MAX_GPUS_PER_NODE)
    utilization_pct: float | None = Field(default=None, ge=0, le=100)
    memory_used_bytes: int | None = Field(default=None, ge=0, le=2**50)


class NodeRegister(BaseModel):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    address: PlainText = Field(min_length=1, max_length=255)
    slots: int = Field(ge=1, le=1024)
    pid: int = Field(ge=0, le=2**31 - 1)
    gpus: list[GpuInfo] = Field(
        default_factory=list,
        max_length=MAX_GPUS_PER_NODE,
        description="The node's GPUs, indices distinct; empty on a CPU node",
    )
    gpu_driver: PlainText | None = Field(default=None, max_length=64)
    cuda_version: PlainText | None = Field(default=None, max_length=32)
    cpus: int | None = Field(
        default=None, ge=1, le=65536, description="The cores the agent's workers may use"
    )

    @field_validator("gpus")
    @classmethod
    def _distinct_indices(cls, gpus: list[GpuInfo]) -> list[GpuInfo]:
        indices = [g.index for g in gpus]
        if len(set(indices)) != len(indices):
            raise ValueError(f"GPU indices must be distinct, got {sorted(indices)}")
        return gpus

    node_token: str | None = Field(
        default=None,
        max_length=128,
        description="The token this node got when it last registered, if it kept it: "
        "needed to register under the name of a node that is ALIVE (an agent that "
        "restarted takes its place back)",
    )
    registration_key: str | None = Field(
        default=None,
        min_length=32,
        max_length=128,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="A random key the agent sends with every try of one registration: a "
        "retry whose first try was registered but whose answer was lost gets the node back "
        "with a new token, instead of a 409 until the node is lost",
    )


class NodeRegistered(BaseModel):
    node_id: int
    heartbeat_interval_s: float
    node_token: str = Field(
        description="This node's credential for heartbeats, reports and leave; a new "
        "registration replaces it"
    )


class Entrypoint(BaseModel):
    """Exactly one of ``module`` and ``script``; ``args`` follow it."""

    module: str | None = None
    script: str | None = None
    args: list[str] = Field(default_factory=list)


class RendezvousConfig(BaseModel):
    """Settings of torch's dynamic rendezvous, which the controller serves
    (``contract.rendezvous``) under ``rdzv_id`` to the attempt's member nodes."""

    rdzv_id: str
    last_call_timeout_s: int = 2
    join_timeout_s: int = 600
    keep_alive_interval_s: int = 2
    keep_alive_max_attempt: int = 3


class RestartPolicy(BaseModel):
    """How the launcher restarts failed workers; the job's budget itself is kept by the
    controller, ``max_restarts`` here only bounds a launcher cut off from it."""

    max_restarts: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    fatal_exit_codes: list[int] = Field(default_factory=list)
    restarts_before: int = 0  # the job's restart count when this attempt was assigned

    def delay_s(self, restart_number: int) -> float:
        """Seconds to wait before the job's ``restart_number``-th restart (1-based).

        The first restart is immediate; each one after waits twice as long as
        the one before, from ``backoff_s`` up to ``backoff_max_s``.
        """
        if restart_number <= 1 or self.backoff_s <= 0:
            return 0.0
        return float(min(self.backoff_max_s, self.backoff_s * 2.0 ** min(restart_number - 2, 30)))


class Assignment(BaseModel):
    """One attempt of a job that this node must take part in."""

    attempt_id: int
    job_id: int
    attempt_number: int | None = Field(
        default=None,
        description="The job's own number of this attempt (1, 2, ...), the one users see; "
        "attempt_id is the controller's id for it",
    )
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    hang_timeout_s: float | None = Field(
        default=None,
        description="Seconds without a progress beat after which a worker is hung; None: "
        "never. With hang_timeout_adaptive, the most the derived timeout may be (a node "
        "that does not know adaptive timeouts uses it as a fixed one)",
    )
    hang_timeout_adaptive: bool = Field(
        default=False,
        description="Derive each worker's hang timeout from its own beat intervals "
        "(worker.hang), up to hang_timeout_s",
    )
    collective_timeout_s: float | None = Field(
        default=None,
        description="What the built-in Trainer gives init_process_group as its timeout "
        "(RELAUNCH_COLLECTIVE_TIMEOUT_S); None: its own default",
    )
    rendezvous: RendezvousConfig
    entrypoint: Entrypoint
    env: dict[str, str] = Field(default_factory=dict)
    snapshot_dir: str
    working_dir: str | None = Field(
        default=None,
        description="The job's working directory, which must exist on the node; None: the "
        "node uses the snapshot directory if it is a path, else the attempt's own directory",
    )
    snapshot_every_steps: int | None = None
    snapshot_every_epochs: int | None = None
    snapshot_keep: int = 2
    snapshot_async: bool = True
    worker_token: str | None = Field(
        default=None,
        description="The secret this node's workers of the attempt show the controller (the "
        "snapshot fence); sent while the node does not yet run the attempt",
    )
    member_id: int | None = Field(
        default=None,
        description="The controller's id of this node's membership of the attempt: a node "
        "that left the attempt and joins it again gets a new one, and runs the attempt again",
    )
    membership_generation: int = Field(
        default=0,
        ge=0,
        description="How many members the attempt has lost so far. When it moves while the "
        "node runs the attempt, the node ends its workers so that they re-form at once "
        "without the lost members (a collective waiting on a frozen or cut-off peer cannot "
        "be relied on to fail)",
    )
    active_members: int | None = Field(
        default=None,
        ge=0,
        description="How many nodes are members of the attempt now: a node whose workers "
        "already formed with no more nodes than this has nothing to re-form",
    )
    memberships: int | None = Field(
        default=None,
        ge=0,
        description="How many memberships the attempt has had, ended ones included: it grows "
        "by one with each node that joins. A node that joined after the workers formed may "
        "stand in for one that is gone, so equal counts say nothing then",
    )
    device: Device = Field(
        default="cpu",
        description="What the attempt was placed for: 'cuda' on GPUs (nproc_per_node of them "
        "on each node, ``gpus``), 'cpu' on a whole node",
    )
    gpus: list[int] = Field(
        default_factory=list,
        max_length=MAX_GPUS_PER_NODE,
        description="The indices of this node's GPUs that the attempt holds, one per local "
        "rank; the agent makes them the workers' CUDA_VISIBLE_DEVICES. Empty for 'cpu'",
    )


class RunningAttempt(BaseModel):
    attempt_id: Id
    launcher_pid: Int32 | None = None
    processes: Int32 = 0


class Heartbeat(BaseModel):
    running: list[RunningAttempt] = Field(default_factory=list, max_length=10_000)
    gpus: list[GpuUsage] = Field(default_factory=list, max_length=MAX_GPUS_PER_NODE)


class HeartbeatReply(BaseModel):
    assignments: list[Assignment] = Field(default_factory=list)
    heartbeat_interval_s: float | None = Field(
        default=None,
        gt=0,
        description="How long to wait before the next heartbeat: longer as the fleet grows "
        "(absent from a controller that does not pace its nodes: keep the last interval)",
    )


class LogLine(BaseModel):
    """One output line; a worker's carries its local rank and, when known, its global rank."""

    time: datetime
    local_rank: Int32 | None = None
    global_rank: Int32 | None = None
    stream: Literal["stdout", "stderr"] = "stdout"
    line: PrintedText = Field(max_length=8192)


# The launcher's exit code when it came to a rendezvous that another node's launcher had
# closed by ending (torch closes an id for good whenever a launcher ends other than by a
# signal): a node that joins just as a job finishes. Its exit is ``closed``, not a failure.
RENDEZVOUS_CLOSED_EXIT = 75


class AttemptExit(BaseModel):
    """How the launcher process of an attempt ended on this node.

    ``stopped``: the agent ended it because the controller no longer wants it;
    ``clean`` then says that no process of the attempt is left on the node.
    ``fatal``: the launcher gave up on an error that a restart cannot fix.
    ``closed``: the launcher came to the attempt's rendezvous after it had closed (another
    node's launcher ended, which closes it for everyone): its workers never started, and
    what became of the attempt is for the other nodes to report.
    """

    outcome: Literal["succeeded", "failed", "stopped", "closed"]
    exit_code: Int32 | None = None
    message: PrintedText = Field(default="", max_length=65536)
    clean: bool = True
    fatal: bool = False


class AttemptReport(BaseModel):
    attempt_id: Id
    member_id: Id | None = Field(
        default=None,
        description="The membership this run of the attempt serves (Assignment.member_id): "
        "a node that left an attempt and joined it again reports its old run apart from the "
        "new one. None: the node's newest membership of the attempt",
    )
    logs: list[LogLine] = Field(default_factory=list, max_length=5000)
    events: list[RuntimeEvent] = Field(default_factory=list, max_length=5000)
    exit: AttemptExit | None = None


class ReportAccepted(BaseModel):
    accepted: bool


class StopReason(StrEnum):
    """Why an attempt is over for a node, as the controller says when it refuses a report."""

    FENCED = "fenced"  # the attempt went on without this node, or was replaced
    CANCELLED = "cancelled"  # the job's owner (or an admin) cancelled the job


class ReportRefused(BaseModel):
    """The body of a 409 answer to a report: the attempt is over for this node; stop it.

    A controller older than ``reason`` sends ``detail`` alone, which reads as fenced.
    """

    detail: str = ""
    reason: StopReason = StopReason.FENCED


class NodeLeave(BaseModel):
    """An agent that is stopping (SIGTERM: ``docker stop``, a scale-down) says so."""

    reason: PlainText = Field(default="the node agent stopped", max_length=200)


class NodeLeft(BaseModel):
    left: bool = Field(description="False if the node was no longer ALIVE (LOST or LEFT)")
