"""A job's spec: what to run and how, as strict, bounded plain data.

The controller stores it as submitted and parses it with ``JobSpec``; nothing
here knows of databases, the API or where the job runs.
"""

from __future__ import annotations

import functools
import re
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from contract.protocol import ADAPTIVE_HANG_CAP_S, RestartPolicy
from contract.tasks import TASKS, task_args

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# Names relaunch or the elastic launcher set for every worker; a job may not override them.
_RESERVED_ENV = re.compile(
    r"^(RELAUNCH_.*|TORCHELASTIC_.*|MASTER_ADDR|MASTER_PORT|RANK|LOCAL_RANK|WORLD_SIZE|"
    r"LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_WORLD_SIZE|ROLE_NAME|"
    r"TORCH_DISABLE_SHARE_RDZV_TCP_STORE)$"
)
MAX_NODES = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def check_node_path(field: str, value: str, what: str) -> str:
    """``value`` as a path every node can use alike: absolute, without NUL or ``..``.

    Raises ValueError naming ``field``; ``what`` says in a few words what the path is."""
    if not value.startswith("/"):
        raise ValueError(f"{field!r} must be absolute ({what})")
    if "\x00" in value:
        raise ValueError(f"{field!r} must not contain NUL characters")
    if ".." in PurePosixPath(value).parts:
        raise ValueError(f"{field!r} must not contain '..'; give the real path")
    return value


class TaskSpec(_Strict):
    """A built-in task by name, with its parameters."""

    name: str = Field(description=f"One of: {', '.join(sorted(TASKS))}", max_length=64)
    params: dict[str, Any] = Field(default_factory=dict, max_length=64)

    @model_validator(mode="after")
    def _known_task(self) -> Self:
        task_args(self.name, self.params)  # raises ValueError saying what is wrong
        return self


class ScriptSpec(_Strict):
    """A user program written for torchrun: a script path on the nodes, or a module."""

    path: str | None = Field(
        default=None,
        max_length=4096,
        description="Absolute path of a Python script that exists on every node",
    )
    module: str | None = Field(
        default=None, max_length=256, description="A module to run as `python -m`"
    )
    args: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list, max_length=256)

    @field_validator("args")
    @classmethod
    def _bounded_args(cls, args: list[str]) -> list[str]:
        for arg in args:
            if len(arg) > 4096:
                raise ValueError("each argument must be at most 4096 characters")
            if "\x00" in arg:
                raise ValueError("arguments must not contain NUL characters")
        return args

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        if (self.path is None) == (self.module is None):
            raise ValueError("give exactly one of 'path' and 'module'")
        if self.path is not None:
            check_node_path("path", self.path, "a script that exists on every node")
        if self.module is not None and not _MODULE_NAME.match(self.module):
            raise ValueError(f"'module' is not a dotted Python module name: {self.module!r}")
        return self


class SnapshotPolicy(_Strict):
    """When rank 0 saves a snapshot; with neither set, after every epoch."""

    every_steps: int | None = Field(default=None, ge=1, le=10**9)
    every_epochs: int | None = Field(default=None, ge=1, le=10**6)
    keep: int = Field(
        default=2,
        ge=1,
        le=1000,
        description="Snapshots kept; an older one is removed only after a newer one is "
        "committed. Keep at least 2 to survive a damaged newest snapshot.",
    )
    background: bool = Field(
        default=True, description="Write snapshots in a background thread while training goes on"
    )


class JobSpec(_Strict):
    """What to run and how: plain data that knows nothing of where it runs."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    task: TaskSpec | None = None
    script: ScriptSpec | None = None
    nnodes: str = Field(
        default="1",
        description="Number of nodes as 'N' or 'MIN:MAX'",
        examples=["1:2"],
        max_length=16,
    )
    nproc_per_node: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Worker processes on each node; for a job placed on GPUs, the GPUs it "
        "takes on each node (one per worker)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="Where the workers run. 'cuda': on nproc_per_node GPUs of each node, "
        "which the same user's other CUDA jobs may share but no CPU job; 'cpu': on whole "
        "nodes. 'auto': decided whenever an attempt is placed: 'cuda' if at least min_nodes "
        "alive nodes each have nproc_per_node GPUs then, free or not (the job waits for "
        "free GPUs), else 'cpu'",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="Worker failures the job may restart from, counted for the whole job; "
        "membership changes (nodes leaving or joining) do not count",
    )
    restart_backoff_s: float = Field(
        default=1.0,
        ge=0,
        le=600,
        description="The first restart is immediate; restart n waits this * 2^(n-2) seconds",
    )
    restart_backoff_max_s: float = Field(default=30.0, ge=0, le=3600)
    fatal_exit_codes: list[int] = Field(
        default_factory=list,
        max_length=64,
        description="Worker exit codes that fail the job at once instead of restarting it",
    )
    wait_for_nodes_s: float = Field(
        default=600.0,
        gt=0,
        le=7 * 24 * 3600,
        description="How long a job that has fewer than MIN nodes left waits for nodes "
        "before it fails",
    )
    hang_timeout_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | Literal["auto"] | None = (
        Field(
            default="auto",
            description="A worker that beat (made progress) and then beats no more for this "
            "long is hung: its stack is dumped into the logs and the workers restart. "
            "'auto': derived from the worker's own beats, max(30 s, 10 x the median "
            "interval between its beats, 2 x the longest), at most "
            f"{ADAPTIVE_HANG_CAP_S:g} s, and {ADAPTIVE_HANG_CAP_S:g} s until 5 intervals are "
            "known. A number: that many seconds. null: never",
        )
    )
    collective_timeout_s: float = Field(
        default=300.0,
        ge=10,
        le=24 * 3600,
        description="How long one collective of the built-in tasks may wait for its peers "
        "before it fails and the workers restart (the process group's timeout)",
    )
    snapshot: SnapshotPolicy = Field(default_factory=SnapshotPolicy)
    working_dir: str | None = Field(
        default=None,
        max_length=4096,
        description="Absolute path of a directory that exists on every node: the workers' "
        "current directory. Default: the job's snapshot directory when the snapshot root is "
        "a path shared by the nodes, else the attempt's directory on each node",
    )
    env: dict[Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=4096)]] = (
        Field(
            default_factory=dict,
            max_length=64,
            description="Environment of the job's workers. The values may be secrets: the API "
            "never sends them back",
        )
    )

    @field_validator("nnodes", mode="before")
    @classmethod
    def _nnodes_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) else value

    @field_validator("nnodes")
    @classmethod
    def _nnodes_range(cls, value: str) -> str:
        parse_nnodes(value)
        return value

    @field_validator("fatal_exit_codes")
    @classmethod
    def _exit_codes(cls, codes: list[int]) -> list[int]:
        for code in codes:
            if not 1 <= code <= 255:
                raise ValueError(f"fatal exit code {code} is not an exit status (1 to 255)")
        return sorted(set(codes))

    @field_validator("working_dir")
    @classmethod
    def _working_dir(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return check_node_path("working_dir", value, "a directory that exists on every node")

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key, val in env.items():
            if not _ENV_NAME.match(key):
                raise ValueError(f"environment name {key!r} is not a valid variable name")
            if _RESERVED_ENV.match(key):
                raise ValueError(f"environment name {key!r} is set by relaunch; remove it")
            if len(val) > 4096 or "\x00" in val:
                raise ValueError(f"environment value of {key!r} is too long or has NUL")
        return env

    @model_validator(mode="after")
    def _one_program(self) -> Self:
        if (self.task is None) == (self.script is None):
            raise ValueError("give exactly one of 'task' (a built-in task) and 'script'")
        return self

    def restart_policy(self, restarts_before: int = 0) -> RestartPolicy:
        """The launcher's restart rules for this job, after ``restarts_before`` restarts."""
        return RestartPolicy(
            max_restarts=self.max_restarts,
            backoff_s=self.restart_backoff_s,
            backoff_max_s=self.restart_backoff_max_s,
            fatal_exit_codes=self.fatal_exit_codes,
            restarts_before=restarts_before,
        )

    def hang_timeout(self) -> tuple[float | None, bool]:
        """(seconds, adaptive) for the nodes: with ``auto``, the cap and True."""
        if self.hang_timeout_s == "auto":
            return ADAPTIVE_HANG_CAP_S, True
        return self.hang_timeout_s, False

    @property
    def min_nodes(self) -> int:
        return parse_nnodes(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        return parse_nnodes(self.nnodes)[1]


@functools.lru_cache(maxsize=256)
def parse_nnodes(value: str) -> tuple[int, int]:
    """``"2"`` → (2, 2); ``"1:3"`` → (1, 3). Raises ValueError saying what is wrong.

    Remembers its last answers: the reconciler asks for every queued job's bounds
    each pass, and a queue holds few distinct ``nnodes``."""
    parts = value.split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"nnodes must be 'N' or 'MIN:MAX' with whole numbers, got {value!r}")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1:
        raise ValueError("nnodes MIN must be at least 1")
    if hi < lo:
        raise ValueError(f"nnodes MAX ({hi}) must not be below MIN ({lo})")
    if hi > MAX_NODES:
        raise ValueError(f"nnodes MAX must be at most {MAX_NODES}")
    return lo, hi
