"""Start a world of processes on this machine without a launcher (``mp.spawn``).

``spawn_workers(fn, nproc, args)`` runs ``fn(*args)`` in ``nproc`` processes started
by ``torch.multiprocessing.spawn``. Before ``fn`` runs, each child gets the variables
torchrun would have set for one node of ``nproc`` workers (``worker_environ``):
``RANK`` = ``LOCAL_RANK`` = its index, ``WORLD_SIZE`` = ``LOCAL_WORLD_SIZE`` =
``nproc``, ``GROUP_RANK`` 0, ``MASTER_ADDR`` 127.0.0.1 and a ``MASTER_PORT`` that was
free when the parent looked. So ``DistEnv.from_environ`` reads a child exactly as it
reads a torchrun worker, and everything after that is the same code.

``fn`` and ``args`` are pickled to the children: ``fn`` must be importable by name
(a module-level function). The port is found by binding to port 0 and closing;
another process could take it before rank 0 binds it, and the run then fails at
start with "address already in use". There is no restart: a child that fails ends
the others and ``spawn_workers`` raises.

A child whose ``fn`` returned ends at once, status 0, once its logs and standard
streams are flushed: the interpreter's teardown is skipped, in which torch 2.13's
gloo can abort the process ("terminate called without an active exception", seen in
this project's CI), failing a world whose work was done. ``fn`` must therefore leave
nothing running that it has not waited for (the built-in tasks wait for their last
snapshot before they return).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from worker.ending import exit_now

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listened on at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def worker_environ(local_rank: int, nproc: int, master_port: int) -> dict[str, str]:
    """torchrun's variables for worker ``local_rank`` of ``nproc`` on one node."""
    if not 0 <= local_rank < nproc:
        raise ValueError(f"local rank {local_rank} is outside [0, {nproc})")
    return {
        "RANK": str(local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(master_port),
    }


def _child(
    local_rank: int, fn: Callable[..., Any], nproc: int, master_port: int, args: tuple[Any, ...]
) -> None:
    os.environ.update(worker_environ(local_rank, nproc, master_port))
    fn(*args)
    exit_now(0)  # no teardown: see the module's docstring


def spawn_workers(fn: Callable[..., Any], nproc: int, args: tuple[Any, ...] = ()) -> None:
    """Run ``fn(*args)`` in ``nproc`` spawned workers and wait for all of them.

    Raises ``ValueError`` if ``nproc < 1``; ``torch.multiprocessing.ProcessRaisedException``
    when a worker raised, ``ProcessExitedException`` when one exited non-zero (or was
    killed), after the others were ended.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    mp.spawn(_child, args=(fn, nproc, free_port(), args), nprocs=nproc, join=True)
