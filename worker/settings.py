"""Settings of one node agent, validated once at start and passed in.

Every field can be set from the environment with the prefix ``RELAUNCH_AGENT_``
(``RELAUNCH_AGENT_CONTROLLER_URL``, ``RELAUNCH_AGENT_NAME``, ...).
"""

from __future__ import annotations

import os
import re
import socket
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from contract.job_users import DEFAULT_JOB_UID_BASE
from contract.protocol import DEFAULT_CONTROLLER_URL, MAX_GPUS_PER_NODE
from worker.failover import controller_urls

NODE_NAME_PATTERN = r"^[A-Za-z0-9._-]+$"


def default_node_name() -> str:
    """This host's name, reduced to the characters a node name may hold."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:128]
    return name or "node"


def parse_gpu_selection(value: object) -> tuple[int, ...] | None:
    """RELAUNCH_AGENT_GPUS as the indices it selects: None (unset or blank) for every GPU
    NVML finds, ``()`` for ``none``, else the distinct indices of a comma-separated list.

    ``ValueError`` for anything else: a word, a negative or repeated index, one past
    ``MAX_GPUS_PER_NODE``."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        if text.lower() == "none":
            return ()
        parts: list[object] = [part.strip() for part in text.split(",")]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise ValueError(f"expected 'none' or GPU indices such as 0,2,3, got {value!r}")
    indices = []
    for part in parts:
        if isinstance(part, bool) or not (
            isinstance(part, int) or (isinstance(part, str) and part.isdigit())
        ):
            raise ValueError(
                f"expected 'none' or GPU indices such as 0,2,3 (unset: every GPU NVML "
                f"finds), got {value!r}"
            )
        index = int(part)
        if index >= MAX_GPUS_PER_NODE:
            raise ValueError(f"GPU index {index} is beyond the {MAX_GPUS_PER_NODE} a node may have")
        indices.append(index)
    if len(set(indices)) != len(indices):
        raise ValueError(f"GPU indices must be distinct, got {value!r}")
    return tuple(sorted(indices))


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, which a cgroup's cpuset sets)."""
    return len(os.sched_getaffinity(0))


def _default_work_dir(data: dict[str, Any]) -> Path:
    name = str(data.get("name", default_node_name()))
    if os.geteuid() == 0:  # root's home is closed to the jobs' users
        return Path("/var/lib/relaunch-agent") / name
    return Path.home() / ".relaunch" / "agent" / name


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RELAUNCH_AGENT_", extra="ignore")

    controller_url: str = Field(
        default=DEFAULT_CONTROLLER_URL,
        description="Base URL of the controller, e.g. http://controller.internal:8080, or of "
        "several controllers of one database separated by commas (the agent, its launchers "
        "and its workers go to the next when one does not answer); the default is a "
        "controller on this host at its default port",
    )
    enrolment_token: SecretStr | None = Field(
        default=None,
        min_length=1,
        description="The controller's RELAUNCH_ENROLMENT_TOKEN; read from the environment "
        "only, never from the command line. enrolment_token_file is safer: a process's "
        "initial environment stays readable in /proc/<pid>/environ",
    )
    enrolment_token_file: Path | None = Field(
        default=None,
        description="A file holding the enrolment token (mode 0600 or stricter); "
        "used instead of enrolment_token",
    )
    isolation: Literal["user", "none"] = Field(
        default="user",
        description="'user': each job's workers run as uid = gid = job_uid_base + job id "
        "(the agent must run as root); 'none': as the agent's user, for one trusted tenant",
    )
    job_uid_base: int = Field(
        default=DEFAULT_JOB_UID_BASE,
        ge=1000,
        le=2**31 - 2,
        description="Job N runs as uid and gid job_uid_base + N ('user' isolation)",
    )
    name: str = Field(
        default_factory=default_node_name,
        min_length=1,
        max_length=128,
        pattern=NODE_NAME_PATTERN,
        description="Stable name of this node; also names its work dir",
    )
    address: str = Field(
        default="127.0.0.1",
        min_length=1,
        max_length=255,
        description="Address other nodes use to reach this one (torchrun --local-addr); "
        "'auto': what this host's name resolves to, as in a container",
    )
    slots: int = Field(default=1, ge=1, le=1024)
    warm_workers: bool = Field(
        default=True,
        description="Fork each worker from a zygote that has imported torch (worker.warm); "
        "false: start every worker as a new interpreter",
    )
    spare_launcher: bool = Field(
        default=False,
        description="With warm_workers: keep one launcher interpreter with torch's elastic "
        "agent already imported and hand it the next attempt, so that an attempt's start "
        "does not wait for those imports; costs about 290 MiB per node",
    )
    work_dir: Path = Field(
        default_factory=_default_work_dir,
        description="Per-node state: attempt dirs, pid ledger (default ~/.relaunch/agent/<name>; "
        "as root /var/lib/relaunch-agent/<name>)",
    )
    gpus: Annotated[tuple[int, ...] | None, NoDecode] = Field(
        default=None,
        description="The GPUs this agent offers: unset, every GPU NVML finds; 'none', no GPU; "
        "'0,2,3', those of NVML's indices only (an index NVML does not find stops the agent). "
        "Without NVML (no NVIDIA driver) listed indices are trusted as GPUs of unknown model, "
        "which also lets a CPU-only test cluster pretend to have GPUs",
    )
    cpus: int = Field(
        default_factory=usable_cpus,
        ge=1,
        le=65536,
        description="The cores this agent's workers may use, which sizes their thread pools "
        "(OMP_NUM_THREADS); default: the cores this process may run on. Give each of several "
        "agents on one host its share",
    )
    report_interval_s: float = Field(default=0.5, gt=0, le=60)
    stop_grace_s: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="SIGTERM-to-SIGKILL grace when the agent stops an attempt",
    )

    @field_validator("controller_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return ",".join(controller_urls(value))

    @field_validator("gpus", mode="before")
    @classmethod
    def _parse_gpus(cls, value: object) -> tuple[int, ...] | None:
        return parse_gpu_selection(value)

    @field_validator("address")
    @classmethod
    def _resolve_auto_address(cls, value: str) -> str:
        if value != "auto":
            return value
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError as exc:
            raise ValueError(
                f"address 'auto' needs this host's name to resolve ({exc}); give the address"
            ) from exc

    @field_validator("work_dir")
    @classmethod
    def _expand_work_dir(cls, value: Path) -> Path:
        return value.expanduser()

    @model_validator(mode="after")
    def _read_token_file(self) -> AgentSettings:
        if self.enrolment_token_file is not None:
            self.enrolment_token = SecretStr(read_token_file(self.enrolment_token_file))
        if self.enrolment_token is None:
            raise ValueError(
                "the enrolment token is missing: set RELAUNCH_AGENT_ENROLMENT_TOKEN_FILE "
                "(a 0600 file) or RELAUNCH_AGENT_ENROLMENT_TOKEN"
            )
        return self

    @property
    def token(self) -> str:
        """The enrolment token (the validator made sure there is one)."""
        if self.enrolment_token is None:
            raise ValueError("no enrolment token")
        return self.enrolment_token.get_secret_value()

    @property
    def alive_file(self) -> Path:
        """Touched by the agent's loop every second; the container health check reads it."""
        return self.work_dir / "agent.alive"

    @property
    def worker_shutdown_timeout_s(self) -> int:
        """What torch's elastic agent waits between SIGTERM and SIGKILL of its workers.

        Shorter than ``stop_grace_s`` so the launcher can finish its own
        shutdown before the node agent resorts to SIGKILL.
        """
        return max(1, int(self.stop_grace_s) - 1)


def read_token_file(path: Path) -> str:
    """The token in ``path``, stripped; ``ValueError`` if group or others may read the file
    or it holds nothing."""
    path = path.expanduser()
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the enrolment token file {path}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"the enrolment token file {path} is open to group or others "
            f"(mode {stat.S_IMODE(mode):04o}); run chmod 600 {path}"
        )
    token = text.strip()
    if not token:
        raise ValueError(f"the enrolment token file {path} is empty")
    return token
