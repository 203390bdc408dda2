"""A torchrun DDP script that saves and resumes its own snapshots and reports its progress.

It fits ``y = 3x + 1`` on generated points with DDP over gloo (CPU). What makes
it survive restarts, at the same or another world size:

- ranks come from the environment torchrun sets; the process group reads them;
- rank 0 saves a snapshot (model, optimizer, next epoch, step) at the end of
  every epoch into ``$RELAUNCH_SNAPSHOT_DIR`` (``./snapshots`` outside relaunch),
  atomically: written to a temporary file, fsynced, then renamed over the old one;
- every rank loads it before the DDP wrap and goes on at the saved epoch, and
  ``DistributedSampler.set_epoch`` gives every epoch its own shuffle whatever the
  world size, so a restart with fewer or more workers splits the remaining
  epochs among them;
- ``worker.report`` tells relaunch the step, loss, speed and the resume.

    python -m torch.distributed.run --nproc-per-node 2 examples/ddp_script.py --epochs 5
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from worker import report

logger = logging.getLogger("ddp_script")
SNAPSHOT_NAME = "snapshot.pt"


def snapshot_dir() -> Path:
    return Path(os.environ.get("RELAUNCH_SNAPSHOT_DIR") or "snapshots")


def save_snapshot(path: Path, state: dict[str, Any]) -> None:
    """Replace the snapshot at ``path`` whole: a reader sees the old one or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash of the machine
    finally:
        os.close(directory)


def generated_points(count: int) -> TensorDataset:
    """The same points on every rank: the sampler decides who sees which."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(count, 1, generator=generator)
    y = 3 * x + 1 + 0.01 * torch.randn(count, 1, generator=generator)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--points", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds slept per step")
    parser.add_argument("--report-every", type=int, default=5, help="steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first_epoch, step = 0, 0

    snapshot = snapshot_dir() / SNAPSHOT_NAME
    if snapshot.exists():  # every rank loads it, before the DDP wrap
        state = torch.load(snapshot, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_epoch, step = state["epoch"], state["step"]
        logger.info("rank %d resumes at epoch %d step %d, world %d", rank, first_epoch, step, world)
        report.resumed(step)
    else:
        report.started()

    ddp = DistributedDataParallel(model)
    dataset = generated_points(args.points)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=0
    )
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        window_start, window_steps = time.monotonic(), 0
        for batch, (x, y) in enumerate(loader, start=1):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            window_steps += 1
            time.sleep(args.step_delay)
            if step % args.report_every == 0 or batch == len(loader):  # and at the epoch's end
                mean_loss = loss.detach().clone()
                dist.all_reduce(mean_loss)
                mean_loss /= world
                elapsed = time.monotonic() - window_start
                rate = window_steps * args.batch_size * world / elapsed
                report.step(
                    step,
                    epoch=epoch,
                    loss=mean_loss.item(),
                    samples_per_s=rate,
                    metrics={"weight": model.weight.item(), "bias": model.bias.item()},
                )
                window_start, window_steps = time.monotonic(), 0
        if rank == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,  # the next epoch to run: a finished one is not replayed
                "step": step,
            }
            save_snapshot(snapshot, state)
            logger.info("saved snapshot after epoch %d at step %d", epoch, step)

    logger.info(
        "done rank=%d world=%d step=%d weight=%.3f bias=%.3f",
        rank,
        world,
        step,
        model.weight.item(),
        model.bias.item(),
    )
    # Every rank reaches the teardown together: a rank that destroys its group while a
    # peer still uses the connection can make gloo abort the peer at exit.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
