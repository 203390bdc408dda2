"""Snapshot benchmark: what saving costs training, synchronous against background writes.

Trains an MLP whose model plus SGD-momentum state is about 100 MB with the real
``Trainer`` (world size 1; gloo on the CPU, NCCL with ``--device cuda``) on
generated data, three ways, interleaved in each repeat so that the machine's noise
hits all three alike:

- ``none``: no periodic snapshot,
- ``sync``: a snapshot every N steps written in the training thread,
- ``async``: the same snapshots copied off and written in the background.

Throughput is timed from the 10th step to the last one, out of rank 0's
per-step progress events: start-up and the final, waited-for save are left
out, so the difference between the runs is the periodic saves. It then times, on the same directory,
one snapshot save (manifest, sha256, fsync) and one verified load, beside a
plain ``torch.save`` of the same state and the raw write speed of the disk
(``os.write`` of as many bytes, then fsync).

With ``--device cuda`` it also measures the training thread's stall when a background
snapshot of a model of ``--stall-gb`` GB (plus as much SGD momentum) is taken off the
GPU: ``capture_state`` (pinned, non-blocking copies, one wait) and the hand-over to
the writer thread, against copying the same state tensor by tensor with ``.cpu()``.
It fails at once where torch sees no CUDA GPU.

    python -m bench.snapshots [--steps 250] [--every 50] [--repeats 3] [--dir DIR]
                              [--device cuda [--stall-gb 1]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import TensorDataset

from contract.protocol import Device
from worker.runtime.config import TrainerConfig
from worker.runtime.env import DistEnv
from worker.runtime.events import EventWriter
from worker.runtime.saver import SnapshotSaver
from worker.runtime.snapshot import TrainingState, load_latest_snapshot, save_snapshot
from worker.runtime.state_capture import capture_state
from worker.runtime.trainer import Trainer

console = Console()
INPUTS, HIDDEN, CLASSES, BATCH = 256, 2048, 10, 64
MODES = ("none", "sync", "async")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(INPUTS, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def make_dataset(steps: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    n = steps * BATCH
    inputs = torch.randn(n, INPUTS, generator=generator)
    return TensorDataset(inputs, torch.randint(0, CLASSES, (n,), generator=generator))


WARMUP_STEPS = 10  # the first steps pay for lazy initialisation; they are not timed


def run(mode: str, steps: int, every: int, directory: Path, device: Device = "cpu") -> float:
    """Steps per second of one training run in ``mode``, from step ``WARMUP_STEPS`` to
    the last step (the final, waited-for save after it is not timed)."""
    config = TrainerConfig(
        max_epochs=1,
        batch_size=BATCH,
        lr=0.01,
        seed=0,
        snapshot_dir=str(directory),
        snapshot_every_steps=None if mode == "none" else every,
        snapshot_every_epochs=0,
        snapshot_background=mode == "async",
        log_every_steps=1,
    )
    events_path = directory.with_suffix(".events.jsonl")
    trainer = Trainer(
        make_model(),
        lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
        make_dataset(steps),
        nn.functional.cross_entropy,
        config,
        DistEnv(device=device),
        events=EventWriter(events_path),
    )
    result = trainer.train()
    assert result.step == steps, result
    if trainer.saver.dropped:
        console.print(f"[yellow]{mode}: {trainer.saver.dropped} saves dropped (one in flight)")
    times = {}
    for line in events_path.read_text().splitlines():
        event = json.loads(line)
        if event["kind"] == "progress":
            times[event["data"]["step"]] = datetime.fromisoformat(event["time"]).timestamp()
    return (steps - WARMUP_STEPS) / (times[steps] - times[WARMUP_STEPS])


def state_snapshot() -> TrainingState:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(4, INPUTS)).sum().backward()
    optimizer.step()  # fills the momentum buffers
    return capture_state(
        model, optimizer, None, step=1, epoch=0, samples_consumed=0, world_size=1, seed=0,
        device=torch.device("cpu"),
    )  # fmt: skip


def raw_write(path: Path, megabytes: int) -> None:
    """``megabytes`` MiB-sized blocks with ``os.write``, then fsync: the disk's own speed."""
    block = os.urandom(1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(megabytes):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)


def io_speeds(directory: Path, repeats: int) -> dict[str, list[float]]:
    """MB/s of a snapshot save, a verified load, a plain torch.save and a raw write."""
    snapshot = state_snapshot()
    speeds: dict[str, list[float]] = {k: [] for k in ("save", "load", "torch_save", "raw")}
    size_mb = 0.0
    for i in range(repeats):
        target = directory / f"io-{i}"
        started = time.perf_counter()
        manifest = save_snapshot(target, snapshot)
        size_mb = manifest.size_bytes / 1e6
        speeds["save"].append(size_mb / (time.perf_counter() - started))

        started = time.perf_counter()
        assert load_latest_snapshot(target) is not None
        speeds["load"].append(size_mb / (time.perf_counter() - started))

        started = time.perf_counter()
        torch.save(snapshot.to_payload(), directory / f"plain-{i}.pt")
        speeds["torch_save"].append(size_mb / (time.perf_counter() - started))

        megabytes = round(manifest.size_bytes / (1 << 20))
        started = time.perf_counter()
        raw_write(directory / f"raw-{i}.bin", megabytes)
        speeds["raw"].append(megabytes * (1 << 20) / 1e6 / (time.perf_counter() - started))
    console.print(f"snapshot size: {size_mb:.1f} MB (model + SGD momentum + RNG states)")
    return speeds


STALL_WIDTH = 8192  # a square Linear layer of this width holds 256 MiB of fp32 weights


def _blocking_copy(value: Any) -> Any:
    """The state copied tensor by tensor with ``.cpu()``: what the stall is compared with."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _blocking_copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_blocking_copy(item) for item in value)
    return value


def gpu_stall(directory: Path, repeats: int, gigabytes: float) -> dict[str, list[float]]:
    """Seconds the training thread waits per background snapshot of a model of about
    ``gigabytes`` GB on ``cuda:0`` (plus its SGD momentum), and per plain ``.cpu()``
    copy of the same state. The GPU is idle when each timing starts."""
    device = torch.device("cuda", 0)
    layers = max(1, round(gigabytes * 1e9 / (STALL_WIDTH * STALL_WIDTH * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Linear(STALL_WIDTH, STALL_WIDTH, device=device) for _ in range(layers))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    inputs = torch.randn(64, STALL_WIDTH, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(inputs).square().mean().backward()
        optimizer.step()

    size_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    console.print(f"GPU stall: {layers} layers, model {size_gb:.2f} GB + as much momentum")
    saver = SnapshotSaver(directory / "stall", keep=1, background=True)
    stalls: dict[str, list[float]] = {"pinned": [], "blocking": []}
    for repeat in range(repeats + 1):  # the first one warms the pinned host allocator
        step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        snapshot = capture_state(
            model, optimizer, None, step=repeat, epoch=0, samples_consumed=0, world_size=1,
            seed=0, device=device,
        )  # fmt: skip
        saver.submit(snapshot)
        pinned = time.perf_counter() - started
        del snapshot
        saver.wait()  # the write itself is not the training thread's

        step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        copied = _blocking_copy((model.state_dict(), optimizer.state_dict()))
        blocking = time.perf_counter() - started
        del copied
        label = "warm-up" if repeat == 0 else f"repeat {repeat}"
        console.print(f"{label}: pinned {pinned:.3f} s, blocking .cpu() {blocking:.3f} s")
        if repeat > 0:
            stalls["pinned"].append(pinned)
            stalls["blocking"].append(blocking)
    return stalls


def require_cuda() -> None:
    """Fail with the reason where ``--device cuda`` cannot run."""
    if torch.cuda.is_available():
        return
    built = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}"
    raise SystemExit(
        f"--device cuda needs a CUDA GPU: torch {torch.__version__} (built {built}) sees none"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250, help="training steps per run")
    parser.add_argument("--every", type=int, default=50, help="snapshot every N steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where snapshots go (default: a temp dir)")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where training runs"
    )
    parser.add_argument(
        "--stall-gb", type=float, default=1.0, help="with --device cuda: the stall's model size"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        require_cuda()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        console.print(
            f"{args.steps} steps of batch {BATCH}, snapshot every {args.every} steps, "
            f"{args.repeats} repeats, in {root}, torch threads {torch.get_num_threads()}, "
            f"on {args.device}"
        )
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            order = MODES[repeat % 3 :] + MODES[: repeat % 3]  # no mode always goes first
            for mode in order:
                rate = run(mode, args.steps, args.every, root / f"{mode}-{repeat}", args.device)
                rates[mode].append(rate)
                console.print(f"repeat {repeat + 1} {mode}: {rate:.2f} steps/s")
        speeds = io_speeds(root, args.repeats)
        stalls = gpu_stall(root, args.repeats, args.stall_gb) if args.device == "cuda" else None

    base = statistics.median(rates["none"])
    table = Table(title="Training throughput (median of repeats)")
    for column in ("snapshots", "steps/s", "overhead vs none", "runs"):
        table.add_column(column)
    for mode in MODES:
        median = statistics.median(rates[mode])
        overhead = "-" if mode == "none" else f"{100 * (base - median) / base:+.1f} %"
        runs = ", ".join(f"{r:.2f}" for r in rates[mode])
        table.add_row(mode, f"{median:.2f}", overhead, runs)
    console.print(table)

    io = Table(title="Storage throughput, MB/s (median; loads read a warm page cache)")
    for column in ("operation", "MB/s", "runs"):
        io.add_column(column)
    labels = {
        "raw": "raw write + fsync (same disk)",
        "torch_save": "plain torch.save (no fsync, no checksum)",
        "save": "relaunch save (sha256, fsync, rename, manifest)",
        "load": "relaunch load (read, sha256, torch.load)",
    }
    for key, label in labels.items():
        io.add_row(
            label,
            f"{statistics.median(speeds[key]):.0f}",
            ", ".join(f"{s:.0f}" for s in speeds[key]),
        )
    console.print(io)

    if stalls is not None:
        stall = Table(title="Training thread's stall per snapshot off the GPU (median, s)")
        for column in ("copy", "seconds", "runs"):
            stall.add_column(column)
        names = {
            "pinned": "capture_state + hand-over (pinned, non-blocking, one wait)",
            "blocking": "tensor by tensor .cpu() (for comparison)",
        }
        for key, label in names.items():
            stall.add_row(
                label,
                f"{statistics.median(stalls[key]):.3f}",
                ", ".join(f"{s:.3f}" for s in stalls[key]),
            )
        console.print(stall)


if __name__ == "__main__":
    main()
