"""A plain torchrun training script that knows nothing about relaunch.

It is what a user brings: rank and world come from the environment torchrun
sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
read by ``init_process_group("gloo")``. It fits a line with DDP for a few steps,
prints ``done rank=R world=W`` and, given ``--out``, rank 0 writes a JSON result.

    python -m torch.distributed.run --nproc-per-node 2 examples/torchrun_script.py --out r.json
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds slept per step")
    parser.add_argument("--out", help="rank 0 writes a JSON result here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = torch.Generator().manual_seed(100 + rank)  # each rank sees its own points of y = 3x + 1
    loss = torch.zeros(())
    for _ in range(args.steps):
        x = torch.rand(16, 1, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), 3 * x + 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_delay)

    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    if rank == 0 and args.out:
        result = {
            "world_size": world,
            "steps": args.steps,
            "loss": mean_loss.item(),
            "weight": model.module.weight.item(),
            "bias": model.module.bias.item(),
        }
        with open(args.out, "w") as handle:
            json.dump(result, handle)
    print(f"done rank={rank} world={world} local_rank={local_rank} loss={mean_loss.item():.4f}")
    # Every rank reaches the teardown together: a rank that destroys its group while a
    # peer still uses the connection can make gloo abort the peer at exit.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
