"""Two interleaved spirals, classified by a small MLP with BatchNorm.

Data: points on two spirals of ``turns`` turns, one the other rotated by half a
turn, jittered by ``noise``, generated in-process from a fixed data seed. The
classes cannot be split by a line, so the MLP must bend its boundary around the
arms; the final evaluation logs the accuracy on all points.

BatchNorm: on CUDA the trainer turns it into SyncBatchNorm (statistics over the
global batch). On CPU torch 2.13 has no SyncBatchNorm, so each rank normalizes
with its own batch and DDP broadcasts rank 0's running statistics (see
``worker.runtime.trainer``).

Run: ``python -m torch.distributed.run --nproc-per-node 2 -m worker.tasks.spirals``.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

from contract.tasks import SpiralsParams
from worker.tasks.cli import TaskParts, run_task

logger = logging.getLogger(__name__)

DATA_SEED = 4096


def make_dataset(samples: int, turns: float, noise: float, seed: int = DATA_SEED) -> TensorDataset:
    """``samples`` points ``(x, label)``: half on each spiral, radius in (0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(samples) % 2
    # sqrt spreads points evenly along the arm instead of crowding the centre
    radius = torch.rand(samples, generator=generator).sqrt().clamp_min(0.05)
    angle = radius * turns * 2 * math.pi + labels * math.pi
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    points = points + noise * radius.unsqueeze(1) * torch.randn(samples, 2, generator=generator)
    return TensorDataset(points, labels)


def make_model(hidden: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(2, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, 2),
    )


def build(params: SpiralsParams) -> TaskParts:
    dataset = make_dataset(params.samples, params.turns, params.noise)

    def evaluate(trained: nn.Module) -> None:
        points, labels = dataset.tensors
        with torch.no_grad():
            logits = trained(points)
        loss = nn.functional.cross_entropy(logits, labels).item()
        accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
        logger.info(
            "final loss %.4f, accuracy %.1f%% on %d points", loss, 100 * accuracy, len(labels)
        )

    return TaskParts(
        model=make_model(params.hidden),
        optimizer=lambda ps: torch.optim.Adam(ps, lr=params.lr),
        dataset=dataset,
        loss_fn=nn.functional.cross_entropy,
        evaluate=evaluate,
        drop_last_batch=True,  # a short last batch could hold one point: BatchNorm needs two
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_task("spirals", SpiralsParams, build, argv)


if __name__ == "__main__":
    sys.exit(main())
