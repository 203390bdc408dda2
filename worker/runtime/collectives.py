"""The few collectives the trainer runs besides DDP's own.

Each function here is a collective: every rank of the default process group
must call it at the same point, or the group hangs until its timeout.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from worker.runtime.snapshot import TrainingState

logger = logging.getLogger(__name__)


def mean_across_ranks(value: float, device: torch.device) -> float:
    """The mean of ``value`` over all ranks."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor.item()) / dist.get_world_size()


def agree_on_snapshot(local: TrainingState | None) -> TrainingState | None:
    """The snapshot with the highest step that any rank found, on every rank.

    Ranks may read different snapshot directories (one per node): after a restart
    rank 0 may sit on a node holding an older snapshot or none. All ranks share
    the steps they found; if they differ, the lowest rank holding the highest one
    broadcasts its copy. ``None`` on every rank when no rank found one.
    """
    steps: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(steps, local.step if local is not None else -1)
    best = max(steps)
    if best < 0:
        return None
    if all(step == best for step in steps):
        return local
    source = steps.index(best)
    payload = local.to_payload() if local is not None and dist.get_rank() == source else None
    box: list[Any] = [payload]
    dist.broadcast_object_list(box, src=source)
    if dist.get_rank() == 0:
        logger.info("ranks found snapshot steps %s; using rank %d's step %d", steps, source, best)
    return TrainingState.from_payload(box[0])
