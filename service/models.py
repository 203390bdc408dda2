"""Tables. The schema is made only by the Alembic migrations in ``migrations/``."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from functools import cached_property
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
    cast,
    literal,
    text,
)
from sqlalchemy.orm import (
    DeclarativeBase,
    InstrumentedAttribute,
    Mapped,
    mapped_column,
    relationship,
)
from sqlalchemy.sql.elements import BindParameter, Label
from sqlalchemy.types import TypeDecorator

from service.secrets import public_spec
from service.spec import JobSpec
from service.states import AttemptState, JobState, MemberState, NodeState

# An empty JSON list, for rows made before a list column existed.
_EMPTY_LIST = text("'[]'")

# SQLite keeps integer primary keys only as INTEGER; other databases get BIGINT.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def _state_column(enum_cls: type[StrEnum]) -> Enum:
    """A VARCHAR holding the enum's value; rows load as the enum type."""
    return Enum(
        enum_cls,
        native_enum=False,
        length=16,
        values_callable=lambda members: [m.value for m in members],
    )


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: Any, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UTCDateTime(), dict[str, Any]: JSON}


class Role(StrEnum):
    """What a user may do: ``user`` acts on its own jobs, ``admin`` on every job and user."""

    ADMIN = "admin"
    USER = "user"


class User(Base):
    """Someone who submits jobs. Limits left empty take the controller's defaults."""

    __tablename__ = "users"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[Role] = mapped_column(_state_column(Role))
    max_active_jobs: Mapped[int | None] = mapped_column(Integer)
    max_nodes: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime]


class ApiToken(Base):
    """A user's bearer token, kept only as the sha256 of its text."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    label: Mapped[str] = mapped_column(String(64))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]

    user: Mapped[User] = relationship()


class IdempotencyKey(Base):
    """A submit's Idempotency-Key: the same user, key and body give back the same job.

    ``body_sha256`` is keyed (``service.jobs.spec_digests``): the body holds env values."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("user_id", "key"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(255))
    body_sha256: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime]


def table_of(model: type[Base]) -> Table:
    """``model``'s table, for a plain Core statement (an INSERT without the ORM's bulk
    machinery)."""
    return model.metadata.tables[model.__tablename__]


def json_text(column: InstrumentedAttribute[Any]) -> Label[str]:
    """A JSON column read as its text, for a caller that parses each distinct value once
    rather than every row's (the driver would parse each)."""
    return cast(column, Text).label(column.key)


def parse_stored_spec(stored: dict[str, Any]) -> JobSpec:
    """A job's stored ``spec`` as a ``JobSpec``: the env's names, each value empty."""
    return JobSpec.model_validate(public_spec(stored))


def _partial_index(name: str, where: str, *columns: str) -> Index:
    """An index of only the rows ``where`` holds (a partial index on both databases). A
    read it serves compares with ``inline`` values: a value sent beside the statement
    does not show the planner that the read wants only those rows (PostgreSQL's generic
    plan of a prepared statement; SQLite's plans)."""
    return Index(name, *columns, postgresql_where=text(where), sqlite_where=text(where))


def inline(value: str) -> BindParameter[str]:
    """``value`` written into the statement as it is executed (``_partial_index``)."""
    return literal(str(value), String, literal_execute=True)


# The queue (PENDING jobs) oldest first: every reconciler pass reads its head, a page at a
# time, and the jobs in it that do not yet say why they wait (submitted since the last
# pass). By state alone each such read fetched and sorted, or filtered, the whole queue.
# Each index leads with the columns its read compares, although its rows all hold the same
# values there: SQLite, lacking statistics, otherwise prefers the index by state.
QUEUE = "state = 'PENDING'"
UNEXPLAINED = "state = 'PENDING' AND message = ''"
ACTIVE = "state = 'ACTIVE'"


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        _partial_index("ix_jobs_queue", QUEUE, "state", "created_at", "id"),
        _partial_index("ix_jobs_unexplained", UNEXPLAINED, "state", "message", "created_at", "id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    # Empty only for jobs submitted before users existed; only admins see those.
    owner_id: Mapped[int | None] = mapped_column(
        ForeignKey("users.id", name="fk_jobs_owner_id_users"), index=True
    )
    spec: Mapped[dict[str, Any]]
    state: Mapped[JobState] = mapped_column(_state_column(JobState), index=True)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    attempt_count: Mapped[int] = mapped_column(Integer, default=0)
    restart_count: Mapped[int] = mapped_column(Integer, default=0)
    membership_changes: Mapped[int] = mapped_column(Integer, default=0)
    waiting_since: Mapped[datetime | None]
    # A WAITING job is not placed again before this (restart back-off).
    not_before: Mapped[datetime | None]
    last_step: Mapped[int | None] = mapped_column(Integer)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    last_loss: Mapped[float | None] = mapped_column(Float)
    world_size: Mapped[int | None] = mapped_column(Integer)
    message: Mapped[str] = mapped_column(Text, default="")

    owner: Mapped[User | None] = relationship()
    attempts: Mapped[list[Attempt]] = relationship(
        back_populates="job", order_by="Attempt.number", cascade="all, delete-orphan"
    )

    @cached_property
    def job_spec(self) -> JobSpec:
        """``spec`` as a ``JobSpec``, parsed once per loaded row (a job's spec never
        changes after submit). Shared by every reader of the row: do not modify it.

        Its ``env`` has the names only, each value empty: the values, encrypted at
        rest, are read with ``service.secrets.open_env``."""
        return parse_stored_spec(self.spec)


class Attempt(Base):
    """One launch of a job: one c10d rendezvous id over a set of member nodes."""

    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("job_id", "number"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    rdzv_id: Mapped[str] = mapped_column(String(64), unique=True)
    state: Mapped[AttemptState] = mapped_column(_state_column(AttemptState), index=True)
    world_size: Mapped[int | None] = mapped_column(Integer)
    started_count: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    result: Mapped[str] = mapped_column(Text, default="")
    # "cpu" or "cuda", as placed (``JobSpec.device`` resolved); every member runs on it.
    device: Mapped[str] = mapped_column(String(8), default="cpu", server_default="cpu")

    job: Mapped[Job] = relationship(back_populates="attempts")
    members: Mapped[list[AttemptMember]] = relationship(
        back_populates="attempt", cascade="all, delete-orphan"
    )


class AttemptMember(Base):
    """A node's part in an attempt; a node that left and came back gets a new row."""

    __tablename__ = "attempt_members"
    __table_args__ = (
        Index("ix_attempt_members_attempt_node", "attempt_id", "node_id"),
        # The ACTIVE memberships, which every reconciler pass reads (``active_holds``):
        # a few per node, among every membership there ever was.
        _partial_index("ix_attempt_members_active", ACTIVE, "id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"), index=True)
    state: Mapped[MemberState] = mapped_column(_state_column(MemberState))
    joined_at: Mapped[datetime]
    left_at: Mapped[datetime | None]
    exit_code: Mapped[int | None] = mapped_column(Integer)
    # The newest timeline event id of the attempt when this node last reported a
    # completed rendezvous round (any group rank): a charged failure it reports while it
    # has reported no round since the attempt's last ``restarting`` event is of the round
    # that restart ended (``service.reports``). NULL: no round reported yet.
    round_reported_after: Mapped[int | None] = mapped_column(BigInteger)
    # sha256 of the secret the node's workers show to the controller (the snapshot fence);
    # a new one is issued whenever the node is sent the assignment before it runs it.
    worker_token_hash: Mapped[str | None] = mapped_column(String(64), unique=True)
    # The indices of the node's GPUs this membership holds, one per local rank (CUDA only).
    gpus: Mapped[list[int]] = mapped_column(JSON, default=list, server_default=_EMPTY_LIST)

    attempt: Mapped[Attempt] = relationship(back_populates="members")
    node: Mapped[Node] = relationship()


class RendezvousState(Base):
    """The rendezvous state of one attempt, as torch's launchers wrote it.

    ``state`` is opaque to the controller: it is stored and returned, never read.
    ``version`` is the fencing token of compare-and-set: it grows by one at every
    write, so a launcher that read an older state cannot overwrite a newer one.
    """

    __tablename__ = "rendezvous_states"

    attempt_id: Mapped[int] = mapped_column(
        ForeignKey("attempts.id", ondelete="CASCADE"), primary_key=True
    )
    state: Mapped[bytes] = mapped_column(LargeBinary)
    version: Mapped[int] = mapped_column(BigInteger)


class RendezvousKey(Base):
    """One key of an attempt's rendezvous store; the value is opaque bytes."""

    __tablename__ = "rendezvous_keys"
    __table_args__ = (UniqueConstraint("attempt_id", "key"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(512))
    value: Mapped[bytes] = mapped_column(LargeBinary)


class SnapshotWriter(Base):
    """A job's count of snapshot writers: each new rank 0 takes the next number, and
    only the holder of the newest may commit a snapshot (``worker.runtime.fence``)."""

    __tablename__ = "snapshot_writers"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    token: Mapped[int] = mapped_column(BigInteger)


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    address: Mapped[str] = mapped_column(String(255))
    slots: Mapped[int] = mapped_column(Integer)
    pid: Mapped[int] = mapped_column(Integer)
    state: Mapped[NodeState] = mapped_column(_state_column(NodeState), index=True)
    registered_at: Mapped[datetime]
    last_heartbeat_at: Mapped[datetime]
    # The interval its last reply told it to wait before the next heartbeat
    # (``service.heartbeats.Pace``); NULL: the controller's heartbeat_interval_s.
    heartbeat_interval_s: Mapped[float | None] = mapped_column(Float)
    # sha256 of the token issued at the node's last registration; its agent's credential.
    token_hash: Mapped[str | None] = mapped_column(String(64), unique=True)
    # sha256 of the key its last registration carried (``NodeRegister.registration_key``):
    # a retry of that registration, whose answer was lost, takes the node back with it.
    registration_key_hash: Mapped[str | None] = mapped_column(String(64))
    # What its agent said at its last registration: ``contract.protocol.GpuInfo`` dumps.
    gpus: Mapped[list[dict[str, Any]]] = mapped_column(
        JSON, default=list, server_default=_EMPTY_LIST
    )
    # Its last heartbeat's ``contract.protocol.GpuUsage`` dumps.
    gpu_usage: Mapped[list[dict[str, Any]]] = mapped_column(
        JSON, default=list, server_default=_EMPTY_LIST
    )
    gpu_driver: Mapped[str | None] = mapped_column(String(64))
    cuda_version: Mapped[str | None] = mapped_column(String(32))
    cpus: Mapped[int | None] = mapped_column(Integer)

    @property
    def gpu_indices(self) -> list[int]:
        return sorted(int(g["index"]) for g in self.gpus)


class JobEvent(Base):
    """One line of a job's timeline."""

    __tablename__ = "job_events"
    # By job: the timeline's pages. By attempt: what a report reads of its attempt's
    # timeline (its last membership change, its node's rendezvous round), on every report
    # that carries events; without it each was a scan of every job's events.
    __table_args__ = (
        Index("ix_job_events_job_id_id", "job_id", "id"),
        Index("ix_job_events_attempt_id_id", "attempt_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int | None] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id"))
    time: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class Snapshot(Base):
    """A snapshot that rank 0 committed (manifest written), as its manifest describes it."""

    __tablename__ = "snapshots"
    __table_args__ = (Index("ix_snapshots_job_id_step", "job_id", "step"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str | None] = mapped_column(String(64))
    world_size: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime]


class Metric(Base):
    """A progress report of rank 0."""

    __tablename__ = "metrics"
    __table_args__ = (Index("ix_metrics_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    time: Mapped[datetime]
    step: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    samples_per_s: Mapped[float | None] = mapped_column(Float)
    world_size: Mapped[int] = mapped_column(Integer)
    # The script's own named scalars (``worker.report.step(metrics=...)``), if any.
    named: Mapped[dict[str, float | None] | None] = mapped_column(JSON)


class LogEntry(Base):
    """One line a worker (or its launcher) wrote on a node.

    A worker's line has its local rank and, from nodes that report it, its
    global rank; the launcher's own lines have neither.
    """

    __tablename__ = "log_lines"
    __table_args__ = (Index("ix_log_lines_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"))
    time: Mapped[datetime]
    local_rank: Mapped[int | None] = mapped_column(Integer)
    global_rank: Mapped[int | None] = mapped_column(Integer)
    stream: Mapped[str] = mapped_column(String(8))
    line: Mapped[str] = mapped_column(Text)

    attempt: Mapped[Attempt] = relationship()
    node: Mapped[Node] = relationship()

    @property
    def attempt_number(self) -> int:
        """The job's own number of the attempt, as users see it."""
        return self.attempt.number

    @property
    def node_name(self) -> str:
        return self.node.name


class ControllerLease(Base):
    """Who may act: the one controller whose reconciler places, re-forms and fails jobs.

    One row per lease name, made by the migration. ``term`` grows by one at
    every change of holder; it is the fencing token an action checks.
    """

    __tablename__ = "controller_leases"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    term: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime]
    renewed_at: Mapped[datetime]


class EnrolmentToken(Base):
    """A per-node enrolment token an admin made: a credential to register a node.

    Kept only as the sha256 of its text. It admits a registration while it is
    not revoked, not expired and, when ``single_use``, not used; when
    ``node_name`` is set, only under that name. ``used_at`` is the first use of
    a single-use token (set by compare-and-set, so one use wins) and the last
    use of a reusable one.
    """

    __tablename__ = "enrolment_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    node_name: Mapped[str | None] = mapped_column(String(128))
    single_use: Mapped[bool] = mapped_column(Boolean)
    expires_at: Mapped[datetime]
    used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    created_at: Mapped[datetime]
    created_by: Mapped[int | None] = mapped_column(
        ForeignKey("users.id", name="fk_enrolment_tokens_created_by_users", ondelete="SET NULL")
    )
