"""The controller's one settings object, validated at start and passed in."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from cryptography.fernet import Fernet
from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contract.paths import is_url

# Connections beyond the API's threads: one for the reconciler (on a thread of the API's
# process, or, in a child process, a pool of its own), the rest a margin.
RESERVED_CONNECTIONS = 4


def _default_data_dir() -> Path:
    return Path.home() / ".relaunch"


def _default_controller_id() -> str:
    """Unique per process: two controllers on one host must never share an id."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class ControllerSettings(BaseSettings):
    """Every field reads ``RELAUNCH_<FIELD>``; the database also reads ``DATABASE_URL``."""

    model_config = SettingsConfigDict(env_prefix="RELAUNCH_", extra="ignore")

    data_dir: Path = Field(default_factory=_default_data_dir)
    database_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("DATABASE_URL", "RELAUNCH_DATABASE_URL"),
        description="SQLAlchemy URL; default: a SQLite file in data_dir",
    )
    database_wait_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="How long the controller waits at start for the database to answer",
    )
    host: str = Field(
        default="127.0.0.1",
        description="Address the API listens on; loopback unless you choose otherwise",
    )
    port: int = Field(default=8080, ge=0, le=65535)
    api_threads: int = Field(
        default=40,
        ge=1,
        le=1000,
        description="Threads that run the API's routes; the database pool is sized to "
        "match (this many connections, as many as heartbeat_threads, and a few more for "
        "the reconciler)",
    )
    database_ping_after_idle_s: float = Field(
        default=1.0,
        ge=0,
        le=3600,
        description="A pooled PostgreSQL connection idle longer than this is pinged before "
        "use, and replaced if the server closed it; one used again sooner is not (a "
        "statement on a connection closed meanwhile is answered 503 and the pool "
        "reconnects); 0 pings at every use",
    )
    api_processes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Processes that answer the API on its port: the controller and this "
        "many less one helpers, each with its own event loop, threads and database pool "
        "(api_threads and heartbeat_threads are per process). Helpers pass wakes and "
        "/metrics to the controller, which alone migrates and runs the reconciler. More "
        "than one helps where one process's event loop is the bottleneck and cores are free",
    )
    heartbeat_one_statement: bool = Field(
        default=True,
        description="On PostgreSQL, record a node's heartbeat and read its assignments in "
        "one statement, committed by itself; false: in a transaction of two, as on SQLite",
    )
    heartbeat_synchronous_commit: bool = Field(
        default=False,
        description="On PostgreSQL, whether a heartbeat's one statement "
        "(heartbeat_one_statement) waits for the server to flush its commit to disk. It "
        "writes only when its node was heard from (its GPUs' use, the interval it was told, "
        "and that its registration key is spent), which the node's next heartbeat writes "
        "again: a crash of the server may lose those of its last three wal_writer_delay "
        "(600 ms by default), within any node timeout; a failover to a standby may lose what "
        "had not reached it. Off, a heartbeat does not wait for the disk, nor queue behind a "
        "slow flush; every other write "
        "(memberships, tokens, reports, jobs) waits for it as before. Its connections are a "
        "pool of their own, of one per heartbeat thread (none with heartbeat_threads 0: "
        "heartbeats then share the main pool, and wait). Set it true behind a pooler that "
        "lends server connections a transaction at a time (PgBouncer's transaction mode): "
        "there a session's setting stays with the server connection, whoever borrows it next",
    )
    heartbeat_threads: int = Field(
        default=8,
        ge=0,
        le=1000,
        description="Threads that answer only nodes' heartbeats, beside the API's threads, "
        "so that a heartbeat never waits for a thread behind reports and reads (each "
        "database pool grows by as many connections); 0: heartbeats share the API's threads",
    )
    heartbeat_wait_max_s: float = Field(
        default=4.0,
        ge=0,
        le=600,
        description="A heartbeat that waited longer than this for one of heartbeat_threads "
        "(from when it reached the controller), or whose node closed the connection "
        "meanwhile, is answered 503 with Retry-After and not worked on: its node has given "
        "up on it or is about to (agents wait 5 s); its node is still recorded as heard "
        "from. Keeps an overloaded controller answering the heartbeats still waited for. "
        "Only with heartbeat_threads above 0; 0: every heartbeat is worked on",
    )
    keep_alive_s: int = Field(
        default=75,
        ge=1,
        le=3600,
        description="Seconds an idle HTTP connection is kept open for the client's next "
        "request: longer than agents keep theirs (60 s) and than the heartbeat pace, so "
        "that a heartbeat does not open a connection (and, through a TLS proxy, a "
        "handshake) each time",
    )
    credential_cache_s: float = Field(
        default=5.0,
        ge=0,
        le=60,
        description="Seconds a checked API token is trusted without asking the database "
        "again: a token revoked on another controller, or in the database, stops working "
        "within this time (on the controller that revoked it, at once); 0 checks every request",
    )

    snapshot_root: str | None = Field(
        default=None,
        max_length=1024,
        description="Root of per-job snapshot directories, shared by every node: a path "
        "(default: data_dir/snapshots) or an fsspec URL such as s3://bucket/relaunch",
    )

    heartbeat_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="How often agents heartbeat while the fleet is small enough "
        "(heartbeats_per_s_max); a larger fleet is told a longer interval",
    )
    heartbeats_per_s_max: float = Field(
        default=100.0,
        ge=1,
        le=100_000,
        description="The heartbeats a second the nodes together may send: each reply tells "
        "its node to wait max(heartbeat_interval_s, ALIVE nodes / this) before the next "
        "(at most 60 s), and a node's timeout grows by twice what its interval exceeds "
        "heartbeat_interval_s",
    )
    node_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="Silence after which a node told heartbeat_interval_s is lost; one "
        "told a longer interval gets twice the difference on top",
    )
    reconcile_interval_s: float = Field(default=0.5, gt=0, le=60)
    reconcile_max_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="The most of the CPU time reconciler passes take: after a pass the loop "
        "rests long enough for that (within a third of the lease and a stall's margin), "
        "and a submit's wake waits for the rest, a registration's does not; a pass and the "
        "API share one interpreter lock",
    )
    reconciler_process: bool = Field(
        default=True,
        description="Run the reconciler's passes in a child process of the controller, so "
        "that they do not take the interpreter lock from the API's threads; false: on a "
        "thread of the API's process (also the case for an in-memory SQLite database)",
    )
    reconciler_nice: int = Field(
        default=-10,
        ge=-20,
        le=0,
        description="Added to the controller's nice value for its reconciler's process: "
        "below 0, a pass gets a core before the API's requests when the host is short of "
        "them. Lowering a nice value needs root (or CAP_SYS_NICE); without it the process "
        "goes as low as RLIMIT_NICE allows (systemd's LimitNICE, compose's ulimits: nice) "
        "or keeps the controller's, and says which once in the log",
    )
    gc_freeze: bool = Field(
        default=True,
        description="Once the controller has started, move every object it holds then "
        "(modules, classes, tables: about 150,000) out of reach of Python's garbage "
        "collector, so that a full collection, during which no request runs, does not "
        "scan them again and again; in the reconciler's process too",
    )
    gc_young_threshold: int = Field(
        default=20_000,
        ge=100,
        le=10_000_000,
        description="In the controller's processes, how many more objects Python's "
        "garbage collector lets there be before it scans its youngest generation (the "
        "first number of gc.set_threshold; Python's own is 700). A request's objects "
        "live as long as the request: scanned every 700, they are found alive mid-request "
        "and moved to the older generations, whose scans are the long pauses during "
        "which no request runs",
    )
    share_gpu_nodes_across_users: bool = Field(
        default=False,
        description="Let CUDA jobs of different users share a node (each on GPUs of its "
        "own). CUDA_VISIBLE_DEVICES is no isolation: a job can use and read the memory of "
        "every GPU of its node. Only for one trusted organisation; by default a CUDA job "
        "shares a node only with CUDA jobs of the same user",
    )

    controller_id: str = Field(
        default_factory=_default_controller_id,
        min_length=1,
        max_length=255,
        description="Names this controller in the leader lease (default: host-pid-random)",
    )
    leader_lease_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="How long the acting controller's lease lasts without renewal (it renews "
        "it once a quarter of it has passed); a standby controller on the same database takes "
        "over at most this long after the leader dies",
    )

    enrolment_token: SecretStr | None = Field(
        default=None,
        description="A secret every node agent may show to register (for a demo or a "
        "trusted network); each registered node then gets a token of its own. In "
        "production leave it unset and give each node a per-node enrolment token "
        "(relaunch nodes token create). Unset: only per-node tokens admit nodes",
    )
    metrics_token: SecretStr | None = Field(
        default=None,
        description="A secret that lets a scraper read /metrics ('Authorization: Bearer "
        "<token>') and nothing else. Unset: /metrics answers an admin's API token only",
    )
    secrets_key_file: Path | None = Field(
        default=None,
        description="File of the keys that encrypt jobs' env values at rest (one Fernet key a "
        "line, the first encrypts); default: data_dir/secrets.key, made at first start, and "
        "only with SQLite: controllers sharing another database must all be given the same key",
    )
    secrets_keys: SecretStr | None = Field(
        default=None,
        description="Comma-separated Fernet keys, before those of secrets_key_file: the first "
        "encrypts, every one decrypts (list the new key first to rotate)",
    )
    max_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest request body the API reads; a larger one is refused with 413",
    )
    default_max_active_jobs: int = Field(
        default=16,
        ge=1,
        le=100_000,
        description="Jobs a user may have not yet finished, unless set for the user",
    )
    default_max_nodes: int = Field(
        default=64,
        ge=1,
        le=1_000_000,
        description="Nodes a user's unfinished jobs may hold together (their MAX nnodes), "
        "unless set for the user",
    )

    rdzv_last_call_timeout_s: int = Field(default=2, ge=0, le=600)
    rdzv_join_timeout_s: int = Field(default=600, ge=1, le=86400)
    rdzv_keep_alive_interval_s: int = Field(default=2, ge=1, le=60)
    rdzv_keep_alive_max_attempt: int = Field(default=3, ge=1, le=100)

    @field_validator("enrolment_token", "metrics_token")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 24:
            raise ValueError("must be at least 24 characters; make one with secrets.token_urlsafe")
        return value

    @field_validator("secrets_keys")
    @classmethod
    def _fernet_keys(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return value
        texts = [t.strip() for t in value.get_secret_value().split(",") if t.strip()]
        if not texts:
            raise ValueError("holds no key")
        for number, text in enumerate(texts, start=1):
            try:
                Fernet(text.encode("ascii"))
            except (ValueError, UnicodeError):
                raise ValueError(
                    f"key {number} is not a Fernet key (32 url-safe base64-encoded bytes, as "
                    "`relaunch admin new-secrets-key` prints)"
                ) from None
        return value

    @model_validator(mode="after")
    def _fill_defaults(self) -> ControllerSettings:
        if self.leader_lease_s < 3 * self.reconcile_interval_s:
            raise ValueError(
                f"leader_lease_s ({self.leader_lease_s:g}) must be at least three reconcile "
                f"intervals ({3 * self.reconcile_interval_s:g}), or the leader loses its lease "
                "between two renewals"
            )
        if self.node_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"node_timeout_s ({self.node_timeout_s:g}) must be at least twice "
                f"heartbeat_interval_s ({2 * self.heartbeat_interval_s:g}): the silence a node "
                "is allowed must cover a missed heartbeat, and the first wait after its pace "
                "lengthened (the old interval and up to the new one)"
            )
        if self.database_url is None:
            self.database_url = f"sqlite:///{self.data_dir / 'relaunch.db'}"
        if self.snapshot_root is None:
            self.snapshot_root = str(self.data_dir / "snapshots")
        return self

    @property
    def db_url(self) -> str:
        assert self.database_url is not None  # filled by the validator
        return self.database_url

    @property
    def database_connections(self) -> int:
        """Enough that no route thread ever waits for a connection: one for each (the
        API's and the heartbeats'), and ``RESERVED_CONNECTIONS`` for the reconciler's
        thread."""
        return self.api_threads + self.heartbeat_threads + RESERVED_CONNECTIONS

    @property
    def database_is_sqlite(self) -> bool:
        return self.db_url.startswith("sqlite")

    @property
    def snapshots(self) -> str:
        assert self.snapshot_root is not None  # filled by the validator
        return self.snapshot_root.rstrip("/") or "/"

    @property
    def snapshots_are_local(self) -> bool:
        return not is_url(self.snapshots)
