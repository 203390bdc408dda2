"""The launcher's environment, read once, and process-group set-up.

torchrun (and relaunch's node agent, which runs torchrun) tells each worker who
it is through environment variables. ``DistEnv`` reads them; a process started
without a launcher gets the single-process defaults (rank 0 of a world of 1).

Which launcher, by precedence (``Launcher``):

1. torchrun's variables win: ``WORLD_SIZE`` set means torchrun (or relaunch, or a
   task's ``--nproc``, which sets the same variables) started this process, and
   ``SLURM_*`` is not read at all. A launcher that itself runs inside a Slurm
   allocation passes the allocation's ``SLURM_*`` on to its workers; they still
   take torchrun's.
2. Slurm's win over nothing: without ``WORLD_SIZE``, ``SLURM_PROCID`` and
   ``SLURM_NTASKS`` mean ``srun`` started this task (see ``worker.runtime.slurm``
   for the variables read and how the tasks agree on an address and port).
3. Neither: a single process.

Which device, by ``RELAUNCH_DEVICE`` (the node agent's, see ``worker.runtime.devices``):
``cpu`` is the CPU and gloo even where CUDA is available; ``cuda`` is
``cuda:<local_rank>`` and NCCL, with a GPU visible for every local rank; unset, CUDA
where available, else the CPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum

import torch
import torch.distributed as dist

from contract.protocol import COLLECTIVE_TIMEOUT_ENV, Device
from worker.runtime.devices import check_device_count, requested_device
from worker.runtime.slurm import is_srun_task, slurm_task

logger = logging.getLogger(__name__)

RANK_ENV = "RANK"
LOCAL_RANK_ENV = "LOCAL_RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
GROUP_RANK_ENV = "GROUP_RANK"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"

# The process group's timeout when the launcher gives none (``JobSpec.collective_timeout_s``
# reaches workers as RELAUNCH_COLLECTIVE_TIMEOUT_S); torch's own is 30 min for gloo.
DEFAULT_PG_TIMEOUT = timedelta(minutes=5)


def _timeout_var(environ: Mapping[str, str], name: str, default: timedelta) -> timedelta:
    raw = (environ.get(name) or "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None
    if not 0 < seconds < float("inf"):
        raise ValueError(f"environment variable {name} must be a positive number, got {raw!r}")
    return timedelta(seconds=seconds)


def _int_var(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


class Launcher(Enum):
    """What started this process, by the precedence in the module docstring."""

    NONE = "none"
    TORCHRUN = "torchrun"
    SLURM = "slurm"


@dataclass(frozen=True)
class DistEnv:
    """Who this worker is, as the launcher said.

    Holds: ``0 <= rank < world_size``, ``0 <= local_rank < local_world_size``,
    ``restart_count >= 0``, ``collective_timeout > 0``. ``launcher`` says who started
    this process; under any but ``NONE`` (``launched``) it expects a process group of
    ``world_size`` at ``MASTER_ADDR``/``MASTER_PORT`` (torchrun) or at
    ``master_addr``/``master_port`` (Slurm, where both are always set).
    ``collective_timeout`` is what one collective may wait for its peers. ``device``
    is what the node agent placed the attempt for (``RELAUNCH_DEVICE``); None where
    nobody said (``device_for``).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    restart_count: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: Launcher = Launcher.NONE
    collective_timeout: timedelta = DEFAULT_PG_TIMEOUT
    device: Device | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"{WORLD_SIZE_ENV} must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"{RANK_ENV}={self.rank} is outside [0, {self.world_size})")
        if self.local_world_size < 1:
            raise ValueError(f"{LOCAL_WORLD_SIZE_ENV} must be >= 1, got {self.local_world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"{LOCAL_RANK_ENV}={self.local_rank} is outside [0, {self.local_world_size})"
            )
        if self.group_rank < 0:
            raise ValueError(f"{GROUP_RANK_ENV} must be >= 0, got {self.group_rank}")
        if self.restart_count < 0:
            raise ValueError(f"{RESTART_COUNT_ENV} must be >= 0, got {self.restart_count}")
        if self.collective_timeout <= timedelta(0):
            raise ValueError(f"the collective timeout must be > 0, got {self.collective_timeout}")
        if self.launcher is Launcher.SLURM and (self.master_addr is None or not self.master_port):
            raise ValueError("a Slurm task needs its master address and port")

    @property
    def launched(self) -> bool:
        return self.launcher is not Launcher.NONE

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> DistEnv:
        """Read the launcher's variables, torchrun's before Slurm's (module docstring);
        a missing one takes its single-process default.

        Raises ``ValueError`` naming the variable when one is not an integer or the
        values contradict each other (e.g. ``RANK`` >= ``WORLD_SIZE``).
        """
        launched = bool(environ.get(WORLD_SIZE_ENV, "").strip())
        if not launched and is_srun_task(environ):
            return cls._from_slurm(environ)
        world_size = _int_var(environ, WORLD_SIZE_ENV, 1)
        master_port_raw = environ.get(MASTER_PORT_ENV)
        return cls(
            rank=_int_var(environ, RANK_ENV, 0),
            local_rank=_int_var(environ, LOCAL_RANK_ENV, 0),
            world_size=world_size,
            local_world_size=_int_var(environ, LOCAL_WORLD_SIZE_ENV, world_size if launched else 1),
            group_rank=_int_var(environ, GROUP_RANK_ENV, 0),
            restart_count=_int_var(environ, RESTART_COUNT_ENV, 0),
            master_addr=environ.get(MASTER_ADDR_ENV) or None,
            master_port=_int_var(environ, MASTER_PORT_ENV, 0) if master_port_raw else None,
            launcher=Launcher.TORCHRUN if launched else Launcher.NONE,
            collective_timeout=_timeout_var(environ, COLLECTIVE_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT),
            device=requested_device(environ),
        )

    @classmethod
    def _from_slurm(cls, environ: Mapping[str, str]) -> DistEnv:
        task = slurm_task(environ)
        return cls(
            rank=task.rank,
            local_rank=task.local_rank,
            world_size=task.world_size,
            local_world_size=task.local_world_size,
            group_rank=task.node_rank,
            master_addr=task.master_addr,
            master_port=task.master_port,
            launcher=Launcher.SLURM,
            collective_timeout=_timeout_var(environ, COLLECTIVE_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT),
            device=requested_device(environ),
        )


def device_for(env: DistEnv) -> torch.device:
    """The device this rank computes on, by ``env.device`` (the module docstring's rule).

    - ``"cpu"``: the CPU, whatever GPUs the process sees.
    - ``"cuda"``: ``cuda:<local_rank>``; raises ``DeviceShortage`` unless at least
      ``local_world_size`` devices are visible (none are without CUDA).
    - None: ``cuda:<local_rank modulo the visible GPUs>`` when CUDA is available,
      else the CPU. A launcher that binds GPUs to tasks (``srun --gpus-per-task=1``,
      ``--gpu-bind``, a per-task ``CUDA_VISIBLE_DEVICES``) shows each process fewer
      GPUs than its node's tasks, often just its own as ``cuda:0``; the local rank
      alone would name one it cannot see.
    """
    if env.device == "cpu":
        return torch.device("cpu")
    if env.device == "cuda":
        check_device_count(torch.cuda.device_count(), env.local_world_size)
        return torch.device("cuda", env.local_rank)
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(env: DistEnv, timeout: timedelta | None = None) -> torch.device:
    """Join the default process group and return the device this rank computes on.

    The device is ``device_for(env)`` (raising ``DeviceShortage`` where ``cuda`` was
    asked for and a local rank has no GPU). CUDA: nccl, after
    ``torch.cuda.set_device(device)``. CPU: gloo. Under
    torchrun the group comes from the ``env://`` variables; under Slurm from a
    TCPStore that rank 0 serves at ``master_addr:master_port``; without a
    launcher a private single-process gloo group is built on a loopback TCPStore
    with a free port, so the same DDP code runs either way.
    ``timeout`` (default: ``env.collective_timeout``) bounds every collective: a
    peer that froze is noticed after it. gloo raises in the waiting collective;
    NCCL's watchdog tears the process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, set
    by the node agent unless the job's env sets it).
    Raises ``RuntimeError`` if a process group already exists.
    """
    if timeout is None:
        timeout = env.collective_timeout
    if dist.is_initialized():
        raise RuntimeError("the default process group is already initialized")
    device = device_for(env)
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    if env.launcher is Launcher.SLURM:
        assert env.master_addr is not None and env.master_port is not None  # __post_init__
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            world_size=env.world_size,
            is_master=env.rank == 0,
            timeout=timeout,
        )
        dist.init_process_group(
            backend=backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
    elif env.launcher is Launcher.TORCHRUN:
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
    else:
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    logger.info(
        "joined process group: backend=%s rank=%d world_size=%d device=%s restart_count=%d "
        "collective timeout=%gs",
        backend,
        env.rank,
        env.world_size,
        device,
        env.restart_count,
        timeout.total_seconds(),
    )
    return device


def shutdown_distributed() -> None:
    """Destroy the default process group if there is one (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
