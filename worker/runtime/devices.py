"""Which device a worker computes on, and the check that every local rank has one.

The node agent says, for each attempt, what the attempt was placed for in
``RELAUNCH_DEVICE`` (``contract.protocol.DEVICE_ENV``): ``cpu`` or ``cuda``. For
``cuda`` it also sets ``CUDA_VISIBLE_DEVICES`` to exactly the attempt's GPUs on
the node, one per local rank, so that local rank n computes on visible device n.

The rule (``worker.runtime.env.device_for`` applies it):

- ``cpu``: the CPU (and gloo), even where CUDA is available.
- ``cuda``: ``cuda:<local_rank>``. At least ``LOCAL_WORLD_SIZE`` devices must be
  visible, else ``DeviceShortage``: NCCL needs a GPU of its own for each rank, and
  no restart on the same node can show the process more GPUs.
- not set (plain torchrun, srun, no launcher): CUDA if available, else the CPU.

This module imports no torch until a device count is asked for, so the bootstrap
can check before the job's program runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from contract.protocol import CUDA_VISIBLE_DEVICES_ENV, DEVICE_ENV, Device

LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
DEVICES: tuple[Device, ...] = ("cpu", "cuda")


class DeviceShortage(RuntimeError):
    """Fewer CUDA devices are visible than the node's local ranks need, one each.

    Fatal: the launcher classifies it as a start-up error (``worker.launch``), so the
    job fails at once instead of spending its restarts on the same shortage.
    """


def requested_device(environ: Mapping[str, str] = os.environ) -> Device | None:
    """``RELAUNCH_DEVICE`` as the agent set it; None where it is unset or empty.

    Raises ``ValueError`` naming the variable for anything but ``cpu`` or ``cuda``."""
    raw = (environ.get(DEVICE_ENV) or "").strip()
    if not raw:
        return None
    for device in DEVICES:
        if raw == device:
            return device
    raise ValueError(f"environment variable {DEVICE_ENV}={raw!r} is neither 'cpu' nor 'cuda'")


def check_device_count(
    visible: int, local_world_size: int, environ: Mapping[str, str] = os.environ
) -> None:
    """Raise ``DeviceShortage`` unless ``visible`` devices give each of the
    ``local_world_size`` local ranks its own. The message names the count, what
    ``CUDA_VISIBLE_DEVICES`` said and how many ranks need a device."""
    if visible >= local_world_size:
        return
    shown = environ.get(CUDA_VISIBLE_DEVICES_ENV)
    raise DeviceShortage(
        f"{visible} CUDA device(s) visible ({CUDA_VISIBLE_DEVICES_ENV}="
        f"{'unset' if shown is None else repr(shown)}) but {local_world_size} local rank(s) "
        f"need one each ({DEVICE_ENV}=cuda); a restart on this node cannot fix it"
    )


def check_visible_devices(
    environ: Mapping[str, str] = os.environ, device_count: Callable[[], int] | None = None
) -> None:
    """Before a worker's program runs: with ``RELAUNCH_DEVICE=cuda``, raise
    ``DeviceShortage`` unless ``device_count()`` (default ``torch.cuda.device_count``)
    is at least ``LOCAL_WORLD_SIZE`` (1 where unset). Does nothing otherwise, and
    imports no torch then.

    Counting devices does not create a CUDA context where NVML can count them (torch
    asks NVML first), so a forked warm worker may call it; the zygote never does."""
    if requested_device(environ) != "cuda":
        return
    raw = (environ.get(LOCAL_WORLD_SIZE_ENV) or "").strip() or "1"
    try:
        local_world_size = int(raw)
    except ValueError:
        name = LOCAL_WORLD_SIZE_ENV
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count
    check_device_count(device_count(), local_world_size, environ)
