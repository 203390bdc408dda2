"""A plain torchrun DDP script for the recovery benchmark (it knows nothing of relaunch).

Rank 0 appends one JSON line per step (wall time, step, world size, pid) to
``--steps-file`` and saves an atomic snapshot every ``--snapshot-every`` steps;
every rank resumes from that snapshot at start.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps-file", required=True)
    parser.add_argument("--snapshot", required=True)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--max-steps", type=int, default=1_000_000)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if os.path.exists(args.snapshot):
        state = torch.load(args.snapshot, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    ddp = DistributedDataParallel(model)
    while step < args.max_steps:
        x = torch.randn(32, 64)
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0:
            with open(args.steps_file, "a") as f:
                f.write(
                    json.dumps({"t": time.time(), "step": step, "world": world, "pid": os.getpid()})
                    + "\n"
                )
            if step % args.snapshot_every == 0:
                tmp = f"{args.snapshot}.tmp"
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "step": step,
                    },
                    tmp,
                )
                os.replace(tmp, args.snapshot)
        time.sleep(args.step_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
