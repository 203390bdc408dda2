"""Between a live training run and a ``TrainingState``: what is captured, what is restored."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from contract.protocol import ATTEMPT_ID_ENV, JOB_ID_ENV
from worker.runtime.rng import RngState
from worker.runtime.saver import copy_off
from worker.runtime.snapshot import TrainingState


def capture_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    *,
    scaler: torch.amp.GradScaler | None = None,
    step: int,
    epoch: int,
    samples_consumed: int,
    world_size: int,
    seed: int,
    device: torch.device,
    environ: Mapping[str, str] = os.environ,
) -> TrainingState:
    """A snapshot of the run after ``step``; ``model`` must be the unwrapped module.

    Every tensor is a private CPU copy (``saver.copy_off``, once for the whole state,
    so the GPU is waited for once): training may go on changing the live ones while
    the snapshot is written. ``extra`` records the
    job and attempt that wrote it, when the agent set them.
    """
    ids = (("job_id", JOB_ID_ENV), ("attempt_id", ATTEMPT_ID_ENV))
    # One copy_off for all of it: every GPU copy is queued first, then one wait.
    model_state, optimizer_state, scheduler_state, scaler_state = copy_off(
        (
            model.state_dict(),
            optimizer.state_dict(),
            scheduler.state_dict() if scheduler is not None else None,
            scaler.state_dict() if scaler is not None else None,
        )
    )
    return TrainingState(
        model_state=model_state,
        optimizer_state=optimizer_state,
        scheduler_state=scheduler_state,
        scaler_state=scaler_state,
        step=step,
        epoch=epoch,
        samples_consumed=samples_consumed,
        world_size=world_size,
        seed=seed,
        rng=RngState.capture(device),
        extra={key: environ[var] for key, var in ids if var in environ},
    )


def restore_state(
    snapshot: TrainingState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    device: torch.device,
    scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Load ``snapshot`` into the unwrapped ``model``, ``optimizer``, ``scheduler``,
    AMP ``scaler`` and the RNGs.

    Raises what ``load_state_dict`` raises when the shapes do not fit."""
    model.load_state_dict(snapshot.model_state)
    optimizer.load_state_dict(snapshot.optimizer_state)
    if scheduler is not None and snapshot.scheduler_state is not None:
        scheduler.load_state_dict(snapshot.scheduler_state)
    if scaler is not None and snapshot.scaler_state is not None:
        scaler.load_state_dict(snapshot.scaler_state)
    snapshot.rng.restore(device)
