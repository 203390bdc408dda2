"""Linear regression on generated data, the DDP tutorial's task with a known answer.

Data: ``y = X·w_true + b_true + noise`` with ``X`` standard normal, generated
in-process from a fixed data seed (the same on every rank and every run; the
``--seed`` flag only changes init and data order). A ``Linear`` model trained
with SGD (momentum 0.9) on MSE should bring the loss down to about
``noise**2`` and ``w`` close to ``w_true``; the final evaluation logs both.

Run: ``python -m torch.distributed.run --nproc-per-node 2 -m worker.tasks.regression``,
``python -m worker.tasks.regression --nproc 2`` (``mp.spawn``), ``srun -n 2 python -m
worker.tasks.regression`` or plainly ``python -m worker.tasks.regression`` (world size 1).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

from contract.tasks import RegressionParams
from worker.tasks.cli import TaskParts, run_task

logger = logging.getLogger(__name__)

DATA_SEED = 2048


def make_dataset(
    samples: int, features: int, noise: float, seed: int = DATA_SEED
) -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """``(dataset of (x, y), w_true, b_true)``; identical for identical arguments."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    w_true = torch.randn(features, 1, generator=generator)
    b_true = torch.randn(1, generator=generator)
    targets = inputs @ w_true + b_true + noise * torch.randn(samples, 1, generator=generator)
    return TensorDataset(inputs, targets), w_true, b_true


def build(params: RegressionParams) -> TaskParts:
    dataset, w_true, b_true = make_dataset(params.samples, params.features, params.noise)
    model = nn.Linear(params.features, 1)

    def evaluate(trained: nn.Module) -> None:
        inputs, targets = dataset.tensors
        with torch.no_grad():
            mse = nn.functional.mse_loss(trained(inputs), targets).item()
        if not isinstance(trained, nn.Linear):
            raise TypeError(f"expected the trained nn.Linear, got {type(trained).__name__}")
        w_error = (trained.weight.detach().T - w_true).norm().item()
        b_error = (trained.bias.detach() - b_true).abs().item()
        logger.info(
            "final MSE %.5f (noise floor %.5f); |w - w_true| %.4f, |b - b_true| %.4f",
            mse,
            params.noise**2,
            w_error,
            b_error,
        )

    return TaskParts(
        model=model,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=params.lr, momentum=0.9),
        dataset=dataset,
        loss_fn=nn.functional.mse_loss,
        evaluate=evaluate,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_task("regression", RegressionParams, build, argv)


if __name__ == "__main__":
    sys.exit(main())
