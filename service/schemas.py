"""The REST contract: what clients send and receive. Separate from the tables."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contract.fields import PlainText
from contract.protocol import Device
from service.models import Role
from service.spec import JobSpec
from service.states import AttemptState, JobState, MemberState, NodeState


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobCreate(JobSpec):
    """The body of a submit request."""


class _FromRow(BaseModel):
    """A response read straight from a table row's attributes."""

    model_config = ConfigDict(from_attributes=True)


class MemberPublic(BaseModel):
    node_id: int
    node_name: str
    state: MemberState
    joined_at: datetime
    left_at: datetime | None
    exit_code: int | None
    gpus: list[int] = Field(
        default_factory=list,
        description="The node's GPUs the membership holds, one per local rank (cuda only)",
    )


class AttemptPublic(BaseModel):
    id: int
    number: int
    rdzv_id: str
    state: AttemptState
    device: Device = Field(default="cpu", description="What the attempt was placed for")
    world_size: int | None
    created_at: datetime
    ended_at: datetime | None
    result: str
    members: list[MemberPublic]


REDACTED = "<redacted>"


class JobPublic(BaseModel):
    id: int
    name: str
    owner: str | None = Field(description="The user who submitted the job")
    state: JobState
    spec: JobSpec = Field(
        description=f"As submitted, except that environment values read {REDACTED!r}: "
        "they may hold secrets, so the API never sends them back"
    )
    min_nodes: int
    max_nodes: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempt_count: int
    restart_count: int
    membership_changes: int
    waiting_since: datetime | None
    world_size: int | None
    last_step: int | None
    total_steps: int | None
    last_loss: float | None
    step_time_s: float | None = Field(
        default=None,
        description="Mean time of one step between the last two progress reports of the "
        "running attempt",
    )
    message: str
    last_snapshot_at: datetime | None = Field(
        default=None, description="When rank 0 last committed a snapshot"
    )


class NodesNow(BaseModel):
    """The nodes as the job is read: its message says which case keeps it waiting but
    names no count (so that it is not rewritten whenever the counts move)."""

    alive: int = Field(description="ALIVE nodes")
    idle: int = Field(
        description="ALIVE nodes that no attempt holds (a node with GPUs that an attempt "
        "holds some of is not idle)"
    )


class JobDetail(JobPublic):
    device: Device | None = Field(
        default=None,
        description="The device of the newest attempt, as placed (spec.device resolved); "
        "None before the first",
    )
    attempts: list[AttemptPublic]
    nodes_now: NodesNow | None = Field(
        default=None, description="While the job is PENDING or WAITING: the nodes now"
    )


class JobsPublic(BaseModel):
    items: list[JobPublic]
    total: int
    limit: int
    offset: int


class EventPublic(_FromRow):
    id: int
    time: datetime
    kind: str
    message: str
    attempt_id: int | None
    node_id: int | None
    data: dict[str, Any]


class EventsPublic(BaseModel):
    items: list[EventPublic]


class PhasePublic(_FromRow):
    """One phase of a recovery: from the moment ``since`` to the one it is named after;
    ``same_clock`` false when the two moments were taken by different clocks (two
    nodes, or a node and the controller), whose difference the seconds then hold too."""

    name: str
    since: str
    seconds: float | None
    same_clock: bool


class RecoveryPublic(BaseModel):
    """One restart or re-form of a job: what caused it, when each of its moments was
    (and whose clock took it: ``controller``, ``node N``), and its phases in order."""

    cause: str
    moments: dict[str, datetime]
    clocks: dict[str, str]
    phases: list[PhasePublic]
    total_s: float | None


class RecoveriesPublic(BaseModel):
    items: list[RecoveryPublic]


class MetricPublic(_FromRow):
    id: int
    time: datetime
    attempt_id: int
    step: int
    epoch: int
    loss: float | None
    samples_per_s: float | None
    world_size: int
    named: dict[str, float | None] | None = Field(
        default=None, description="The script's own named scalars of this report, if any"
    )


class MetricsPublic(BaseModel):
    items: list[MetricPublic]


class LogPublic(_FromRow):
    id: int
    time: datetime
    attempt_id: int
    attempt_number: int = Field(description="The job's own number of the attempt (1, 2, ...)")
    node_id: int
    node_name: str
    local_rank: int | None
    global_rank: int | None = Field(
        default=None, description="The worker's rank in the job; None for the launcher's lines"
    )
    stream: str
    line: str


class LogsPublic(BaseModel):
    items: list[LogPublic]


class NodeGpuPublic(BaseModel):
    """One GPU of a node: what its agent reported at registration, and its use at the
    node's last heartbeat (None when not reported)."""

    index: int
    name: str
    uuid: str | None = None
    memory_total_bytes: int | None = None
    utilization_pct: float | None = None
    memory_used_bytes: int | None = None
    held: bool = Field(default=False, description="Held by a running attempt's member")
    job_id: int | None = Field(
        default=None, description="The job holding it, if the caller's (or the caller is admin)"
    )


class NodePublic(BaseModel):
    id: int
    name: str
    address: str
    slots: int
    state: NodeState
    registered_at: datetime
    last_heartbeat_at: datetime
    busy: bool = Field(description="Serving a running attempt")
    attempt_id: int | None = Field(
        default=None,
        description="The attempt it serves, if the job is the caller's (of several on a "
        "node that CUDA jobs share, the oldest of the caller's)",
    )
    job_id: int | None = Field(default=None, description="The job of that attempt")
    zygote_rss_bytes: int | None = Field(
        default=None,
        description="Memory of the warm zygote it runs for that attempt (when it was ready)",
    )
    cpus: int | None = Field(default=None, description="The cores its agent's workers may use")
    gpu_driver: str | None = None
    cuda_version: str | None = None
    gpus: list[NodeGpuPublic] = Field(
        default_factory=list, description="Its GPUs by index; empty on a CPU node"
    )


class NodesPublic(BaseModel):
    items: list[NodePublic]
    total: int
    limit: int
    offset: int


class SnapshotPublic(_FromRow):
    id: int
    attempt_id: int
    step: int
    epoch: int
    path: str
    bytes: int
    sha256: str | None
    world_size: int | None
    created_at: datetime


class SnapshotsPublic(BaseModel):
    items: list[SnapshotPublic]


class Health(BaseModel):
    status: str
    database: str
    controller: str = Field(description="This controller's id in the leader lease")
    role: Literal["leader", "standby"] = Field(
        description="leader: this controller places and re-forms jobs; standby: it serves the "
        "API and takes over when the leader's lease expires"
    )
    leader: str | None = Field(description="The controller that holds the lease now, if any")


class Problem(BaseModel):
    """Why a request was refused, in words that say what to fix."""

    detail: str


class UserCreate(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    role: Role = Role.USER
    max_active_jobs: int | None = Field(
        default=None, ge=1, le=100_000, description="Default: RELAUNCH_DEFAULT_MAX_ACTIVE_JOBS"
    )
    max_nodes: int | None = Field(
        default=None, ge=1, le=1_000_000, description="Default: RELAUNCH_DEFAULT_MAX_NODES"
    )


class UserPublic(_FromRow):
    id: int
    name: str
    role: Role
    max_active_jobs: int | None
    max_nodes: int | None
    created_at: datetime


class UsersPublic(BaseModel):
    items: list[UserPublic]
    total: int
    limit: int
    offset: int


class TokenCreate(_Strict):
    label: PlainText = Field(
        default="", max_length=64, description="What the token is for, e.g. 'laptop' or 'ci'"
    )


class TokenPublic(_FromRow):
    """A token as listed: never its text, which only its creation shows."""

    id: int
    user_id: int
    label: str
    created_at: datetime
    revoked_at: datetime | None


class TokensPublic(BaseModel):
    items: list[TokenPublic]


class TokenCreated(BaseModel):
    token: TokenPublic
    secret: str = Field(description="The token's text, shown this once; only its hash is kept")


class UserCreated(BaseModel):
    user: UserPublic
    token: TokenCreated


class EnrolmentTokenCreate(_Strict):
    node_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Admit only a node of this name (default: any name)",
    )
    expires_in_s: int = Field(
        default=24 * 3600,
        ge=60,
        le=366 * 24 * 3600,
        description="Seconds until the token expires (default: one day)",
    )
    single_use: bool = Field(
        default=True, description="Admit one registration only (default); false: until it expires"
    )


class EnrolmentTokenPublic(_FromRow):
    """A per-node enrolment token as listed: never its text, which only its creation shows."""

    id: int
    node_name: str | None
    single_use: bool
    expires_at: datetime
    used_at: datetime | None
    revoked_at: datetime | None
    created_at: datetime
    created_by: int | None


class EnrolmentTokensPublic(BaseModel):
    items: list[EnrolmentTokenPublic]


class EnrolmentTokenCreated(BaseModel):
    token: EnrolmentTokenPublic
    secret: str = Field(
        description="The token's text, shown this once; only its hash is kept. The node's "
        "agent uses it as its RELAUNCH_AGENT_ENROLMENT_TOKEN"
    )
