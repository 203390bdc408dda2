"""A job for tests: trains on samples that carry their own ids and records, per rank,
the (epoch, sample id) of every sample it trained on, in ``<out>/rank-<R>.jsonl``.

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        tests/worker/sample_ids_job.py --out DIR --snapshots DIR [--stop-after-steps S]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from worker.runtime.config import TrainerConfig
from worker.runtime.trainer import Trainer

SAMPLES = 96
BATCH = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--snapshots", required=True)
    parser.add_argument("--stop-after-steps", type=int)
    args = parser.parse_args()

    ids = torch.arange(SAMPLES, dtype=torch.float32)
    dataset = TensorDataset(ids.unsqueeze(1) / SAMPLES, ids)
    seen: list[tuple[int, int]] = []
    holder: dict[str, Trainer] = {}

    def loss_fn(output: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        epoch = holder["trainer"].epoch
        seen.extend((epoch, int(i)) for i in target_ids.tolist())
        return output.pow(2).mean()

    config = TrainerConfig(
        max_epochs=3,
        batch_size=BATCH,
        lr=0.01,
        seed=5,
        snapshot_dir=args.snapshots,
        snapshot_every_steps=1,
        snapshot_every_epochs=None,
        stop_after_steps=args.stop_after_steps,
    )
    trainer = Trainer(
        nn.Linear(1, 1), lambda ps: torch.optim.SGD(ps, lr=0.01), dataset, loss_fn, config
    )
    holder["trainer"] = trainer
    rank = trainer.rank
    trainer.train()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"rank-{rank}.jsonl", "a") as handle:
        for epoch, sample in seen:
            handle.write(json.dumps([epoch, sample]) + "\n")


if __name__ == "__main__":
    main()
