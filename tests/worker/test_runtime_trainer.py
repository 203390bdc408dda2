"""Trainer in one process (world size 1): resume, events, determinism."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.worker.helpers import SEED, assert_same_state, final_state, train
from worker.runtime.config import TrainerConfig
from worker.runtime.env import DistEnv
from worker.runtime.events import EventWriter
from worker.runtime.model_prep import seed_everything
from worker.runtime.snapshot import list_snapshots, manifest_name
from worker.runtime.trainer import Trainer
from worker.tasks import regression, spirals


def test_resume_after_crash_matches_uninterrupted_run(
    tmp_path: Path, read_events: Callable[[Path], list[dict[str, Any]]]
) -> None:
    reference = train(tmp_path / "reference")
    assert reference.finished and reference.step == 24
    assert (tmp_path / "reference" / "final.pt").exists()

    crashed = tmp_path / "crashed"
    events = tmp_path / "events.jsonl"
    stopped = train(
        crashed, events, snapshot_every_steps=4, stop_after_steps=11, snapshot_background=False
    )
    assert not stopped.finished and stopped.step == 11
    assert [s for s, _ in list_snapshots(crashed)] == [8, 11]
    # a crash right after step 11 would have left the step-8 snapshot newest
    (crashed / manifest_name(11)).unlink()
    resumed = train(crashed, events, snapshot_every_steps=4)
    assert resumed.finished and resumed.step == 24
    assert_same_state(final_state(resumed), final_state(reference))

    log = read_events(events)
    started = [e["data"] for e in log if e["kind"] == "started"]
    assert started[0]["resumed_from_step"] is None and started[0]["total_steps"] == 24
    assert started[1]["resumed_from_step"] == 8 and started[1]["total_steps"] == 24
    assert started[1]["world_size"] == 1 and started[1]["restart_count"] == 0
    second_run = log[
        log.index(
            next(e for e in log if e["kind"] == "started" and e["data"]["resumed_from_step"])
        ) :
    ]
    steps = [e["data"]["step"] for e in second_run if e["kind"] == "progress"]
    assert steps == list(range(9, 25)), "continues with the step after the snapshot"
    snapshots = [e["data"] for e in log if e["kind"] == "snapshot"]
    assert all(s["bytes"] > 0 and s["path"].endswith(".pt") for s in snapshots)
    finished = [e["data"] for e in log if e["kind"] == "finished"]
    assert len(finished) == 1 and finished[0]["step"] == 24
    assert finished[0]["output_path"] == str(crashed / "final.pt")


def test_restart_after_finish_trains_nothing(
    tmp_path: Path, read_events: Callable[[Path], list[dict[str, Any]]]
) -> None:
    first = train(tmp_path / "s", output_path=str(tmp_path / "model.pt"))
    events = tmp_path / "events.jsonl"
    again = train(tmp_path / "s", events, output_path=str(tmp_path / "model.pt"))
    assert again.finished and again.step == first.step == 24
    log = read_events(events)
    assert [e["kind"] for e in log] == ["started", "finished"]
    assert log[0]["data"]["resumed_from_step"] == 24 and log[0]["data"]["total_steps"] == 24


def test_regression_loss_falls(
    tmp_path: Path, read_events: Callable[[Path], list[dict[str, Any]]]
) -> None:
    seed_everything(SEED)
    dataset, _, _ = regression.make_dataset(128, features=4, noise=0.1)
    config = TrainerConfig(
        max_epochs=8,
        batch_size=16,
        lr=0.05,
        seed=SEED,
        snapshot_dir=str(tmp_path),
        log_every_steps=1,
    )
    events = tmp_path / "events.jsonl"
    trainer = Trainer(
        nn.Linear(4, 1),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        dataset,
        nn.functional.mse_loss,
        config,
        DistEnv(device="cpu"),
        events=EventWriter(events),
    )
    result = trainer.train()
    losses = [e["data"]["loss"] for e in read_events(events) if e["kind"] == "progress"]
    assert len(losses) == 64
    assert sum(losses[-8:]) < 0.05 * sum(losses[:8])
    assert result.loss is not None and result.loss < 0.1


def test_short_last_batch_is_dropped_for_batchnorm(tmp_path: Path) -> None:
    """65 points in batches of 8 leave a batch of one, which BatchNorm cannot train on."""
    seed_everything(SEED)
    config = TrainerConfig(
        max_epochs=2, batch_size=8, lr=0.01, snapshot_dir=str(tmp_path), drop_last_batch=True
    )
    trainer = Trainer(
        spirals.make_model(4),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
        spirals.make_dataset(65, turns=1.5, noise=0.1),
        nn.functional.cross_entropy,
        config,
        DistEnv(device="cpu"),
    )
    result = trainer.train()
    assert result.finished and result.step == 16
