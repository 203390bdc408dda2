"""Helpers for the worker tests: a small snapshot, a short training run, and an attempt
that is never started."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from contract.protocol import Assignment, Device, Entrypoint, RendezvousConfig
from service.reconciler import Reconciler
from tests.service.helpers import Cluster, heartbeat, register, submit
from worker.attempt import Attempt
from worker.runtime.config import TrainerConfig
from worker.runtime.env import DistEnv
from worker.runtime.events import EventWriter
from worker.runtime.model_prep import seed_everything
from worker.runtime.rng import RngState
from worker.runtime.snapshot import TrainingState
from worker.runtime.trainer import Trainer, TrainResult
from worker.settings import AgentSettings
from worker.tasks import spirals

SEED = 3


def train(
    snapshot_dir: Path, events: Path | None = None, device: Device = "cpu", **overrides: Any
) -> TrainResult:
    """Spirals (BatchNorm + Adam) on 64 points: 8 steps per epoch, 3 epochs, on
    ``device`` (the CPU unless a GPU test asks for CUDA)."""
    seed_everything(SEED)
    dataset = spirals.make_dataset(64, turns=1.5, noise=0.1)
    model = spirals.make_model(8)
    fields: dict[str, Any] = {
        "max_epochs": 3,
        "batch_size": 8,
        "lr": 0.01,  # the Adam below uses it
        "seed": SEED,
        "snapshot_dir": str(snapshot_dir),
        "log_every_steps": 1,
        **overrides,
    }
    trainer = Trainer(
        model,
        lambda ps: torch.optim.Adam(ps, lr=fields["lr"]),
        dataset,
        nn.functional.cross_entropy,
        TrainerConfig(**fields),
        DistEnv(device=device),
        events=EventWriter(events),
    )
    return trainer.train()


def final_state(result: TrainResult) -> dict[str, torch.Tensor]:
    assert result.output_path is not None
    state: dict[str, torch.Tensor] = torch.load(result.output_path, weights_only=True)
    return state


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)


def make_snapshot(step: int) -> TrainingState:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return TrainingState(
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        step=step,
        epoch=step // 10,
        samples_consumed=(step % 10) * 8,
        world_size=2,
        seed=11,
        rng=RngState.capture(),
        scheduler_state={"last_epoch": step},
        extra={"attempt_id": "7"},
    )


def an_assignment(**fields: Any) -> Assignment:
    """Attempt 12 of job 3 on one node, 2 workers of ``pkg.train``; ``fields`` change it."""
    return Assignment.model_validate(
        {
            "attempt_id": 12,
            "job_id": 3,
            "min_nodes": 1,
            "max_nodes": 1,
            "nproc_per_node": 2,
            "rendezvous": RendezvousConfig(rdzv_id="job-3"),
            "entrypoint": Entrypoint(module="pkg.train"),
            "snapshot_dir": "/snap/3",
            **fields,
        }
    )


def unstarted_attempt(tmp_path: Path, settings: AgentSettings) -> Attempt:
    """Attempt 5 of job 3, never started: only its events file and its stop are used."""
    unstarted = an_assignment(
        attempt_id=5,
        nproc_per_node=1,
        entrypoint=Entrypoint(module="unused"),
        snapshot_dir=str(tmp_path / "snapshots"),
    )
    attempt = Attempt(unstarted, settings)
    attempt.events_path.parent.mkdir(parents=True)
    return attempt


@dataclass
class LiveController:
    """The real controller app served over HTTP on loopback (without its reconciler
    thread), ``api`` to call it as the tests' parties, and its reconciler to step."""

    api: Cluster
    url: str
    reconciler: Reconciler


def placed(live: LiveController, nodes: list[str], nnodes: str) -> tuple[str, list[str]]:
    """A job placed on ``nodes``: its rendezvous id and each node's token."""
    ids = [register(live.api, name) for name in nodes]
    submit(live.api, nnodes)
    live.reconciler.run_once()
    [assignment] = heartbeat(live.api, ids[0])
    return assignment["rendezvous"]["rdzv_id"], [live.api.node_tokens[i] for i in ids]
