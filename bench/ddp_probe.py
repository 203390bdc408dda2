"""A plain torchrun DDP script for the recovery benchmark (it knows nothing of relaunch).

Rank 0 appends one JSON line per step (wall time, step, world size, pid) to
``--steps-file`` and saves an atomic snapshot every ``--snapshot-every`` steps;
every rank resumes from that snapshot at start. Before its first step rank 0 also
writes the moments of its start: when its process was created, when its imports
were done, when it joined the process group, and when it had built its model and
optimizer and loaded the snapshot (the only relaunch code it runs is
``process_clock``, the standard library's reading of ``/proc``, under both
launchers alike). Its first step includes the DDP wrap.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from worker.runtime.process_clock import process_started_at


def main() -> None:
    imported_at = time.time()
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps-file", required=True)
    parser.add_argument("--snapshot", required=True)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--max-steps", type=int, default=1_000_000)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    process_group_at = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(args.steps_file, "a") as f:  # who runs each rank, for the bench to find it
        f.write(json.dumps({"t": time.time(), "rank": rank, "world": world, "pid": os.getpid()}))
        f.write("\n")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    snapshot_loaded_at = None
    if os.path.exists(args.snapshot):
        state = torch.load(args.snapshot, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        snapshot_loaded_at = time.time()
    if rank == 0:
        startup = {
            "process_started": process_started_at(),
            "imported": imported_at,
            "process_group": process_group_at,
            "snapshot_loaded": snapshot_loaded_at,
        }
        with open(args.steps_file, "a") as f:
            line = {"t": time.time(), "world": world, "pid": os.getpid(), "startup": startup}
            f.write(json.dumps(line) + "\n")
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
