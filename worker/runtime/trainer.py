"""``Trainer``: a DDP training loop that snapshots, resumes exactly and reports.

Shaped like the PyTorch DDP tutorial's trainer: public ``train()``, private
``_run_epoch``, ``_run_batch``, ``_save_snapshot`` and ``_load_snapshot``. What
must hold across a restart (same seed):

- The newest snapshot is loaded into the model and optimizer *before* the DDP
  wrap, and training continues with the step after it: no finished step or epoch
  is run again, and a resumed epoch skips exactly the samples already consumed.
- Data order depends only on the seed, the epoch and the consumed count (see
  ``sampler``); RNG states are restored from the snapshot. At the same world
  size a resumed run therefore computes what an uninterrupted one computes.
- Every rank runs the same collectives in the same order; rank-0-only code
  (snapshot writes, events, the final model) contains none.

BatchNorm becomes SyncBatchNorm on CUDA only (see ``model_prep``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from contract.events import (
    SnapshotFailed,
    SnapshotSaved,
    SnapshotSkipped,
    TrainingFinished,
    TrainingProgress,
    TrainingStarted,
)
from contract.paths import is_url
from worker import report
from worker.runtime import startup
from worker.runtime.collectives import agree_on_snapshot, mean_across_ranks
from worker.runtime.config import TrainerConfig
from worker.runtime.env import DistEnv, device_for, init_distributed, shutdown_distributed
from worker.runtime.events import EventWriter
from worker.runtime.fence import writer_token_from_environ
from worker.runtime.model_prep import (
    LossFn,
    OptimizerFactory,
    SchedulerFactory,
    prepare_model,
    seed_everything,
    wrap_ddp,
)
from worker.runtime.progress import beat, beating
from worker.runtime.sampler import ResumableDistributedSampler, steps_left
from worker.runtime.saver import SnapshotSaver, copy_off
from worker.runtime.snapshot import Manifest, atomic_torch_save, load_latest_snapshot
from worker.runtime.state_capture import capture_state, restore_state

__all__ = ["LossFn", "OptimizerFactory", "TrainResult", "Trainer", "TrainerConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    """How ``train()`` ended; ``finished`` is false when ``stop_after_steps`` cut it short."""

    step: int
    epoch: int
    loss: float | None
    finished: bool
    output_path: str | None


class Trainer:
    """Trains ``model`` on ``dataset`` with DDP over the launcher's world.

    ``dataset`` yields ``(input, target)`` pairs; ``loss_fn(model(input), target)``
    is the loss. ``optimizer`` is an optimizer over ``model.parameters()`` or a
    factory taking the parameters. Joins the process group if none exists (and
    then destroys it when ``train()`` returns). Rank 0 writes snapshots, the final
    model and the events; ``events`` overrides ``RELAUNCH_EVENTS_FILE`` there.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        dataset: Dataset,
        loss_fn: LossFn,
        config: TrainerConfig,
        env: DistEnv | None = None,
        *,
        scheduler_factory: SchedulerFactory | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        events: EventWriter | None = None,
    ) -> None:
        self.config = config
        # The Trainer reports its own steps; optimizer steps are not counted as well.
        report.manual_steps()
        self.env = env if env is not None else DistEnv.from_environ()
        self._owns_process_group = not dist.is_initialized()
        if self._owns_process_group:
            self.device = init_distributed(self.env)
            startup.mark(startup.Moment.PROCESS_GROUP)
        else:
            self.device = device_for(self.env)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if self.rank == 0:
            self.events = events if events is not None else EventWriter.from_environ()
            # Taken before loading: from now on an older rank 0 can no longer commit.
            self._writer = writer_token_from_environ()
        else:
            self.events = EventWriter.disabled()
            self._writer = None
        seed_everything(config.seed)

        self.model = model = prepare_model(model, self.device)
        if isinstance(optimizer, torch.optim.Optimizer):
            self.optimizer = optimizer
        else:
            self.optimizer = optimizer(model.parameters())
        self.scheduler = scheduler_factory(self.optimizer) if scheduler_factory else None
        self.scaler = grad_scaler
        self.loss_fn = loss_fn
        self.saver = SnapshotSaver(
            config.snapshot_dir,
            keep=config.snapshot_keep,
            background=config.snapshot_background,
            before_commit=self._check_writer,
            fault=self._crash_drill,
            on_saved=self._snapshot_saved,
            on_failed=self._snapshot_failed,
        )

        self.step = 0
        self.epoch = 0
        self.samples_consumed = 0
        self.resumed_from_step: int | None = None
        self._last_snapshot_step: int | None = None
        self._last_loss: float | None = None
        self._startup_sent = False  # the first progress report carries the start's moments
        self._window_start = time.monotonic()  # throughput since the last progress report
        self._window_samples = 0
        self._load_snapshot()
        beat()

        self.ddp = wrap_ddp(model, self.device)
        self.dataset = dataset
        self.sampler = ResumableDistributedSampler(
            dataset, num_replicas=self.world_size, rank=self.rank, seed=config.seed
        )
        self.loader = DataLoader(
            dataset,
            batch_size=config.batch_size,
            sampler=self.sampler,
            drop_last=config.drop_last_batch,
            generator=torch.Generator().manual_seed(config.seed),  # keeps global RNG untouched
        )

    def train(self) -> TrainResult:
        """Run the remaining epochs; return how far training got."""
        try:
            result = self._train()
            if self._owns_process_group and self.world_size > 1:
                # Where rank 0's process hosts the store (srun, --nproc), it must not
                # leave while another rank still talks to it.
                dist.barrier()
            return result
        finally:
            self.events.close()
            if self._owns_process_group:
                shutdown_distributed()

    def _train(self) -> TrainResult:
        cfg = self.config
        self.events.emit(
            TrainingStarted(
                world_size=self.world_size,
                restart_count=self.env.restart_count,
                resumed_from_step=self.resumed_from_step,
                total_steps=self._total_steps(),
                startup=startup.startup(),
            )
        )
        if self.rank == 0:
            logger.info(
                "training from step %d, epoch %d of %d, world size %d",
                *(self.step, self.epoch, cfg.max_epochs, self.world_size),
            )
        self._window_start = time.monotonic()
        while self.epoch < cfg.max_epochs and not self._stop_requested():
            self._run_epoch(self.epoch)
        if self._stop_requested() and self.epoch < cfg.max_epochs:
            self._save_snapshot(wait=True)
            if self.rank == 0:
                logger.info("stopping after step %d as asked (stop_after_steps)", self.step)
            return TrainResult(self.step, self.epoch, self._last_loss, False, None)
        # The last save and the final model can take long; every rank waits for rank 0
        # here without stepping. The collectives are bounded by the collective timeout.
        with beating():
            self._save_snapshot(wait=True)
            loss = (
                mean_across_ranks(self._last_loss, self.device)
                if self._last_loss is not None
                else None
            )
            output = cfg.final_output_path
            if self.rank == 0:
                state = copy_off(self.model.state_dict())
                atomic_torch_save(state, output, self._check_writer)
                self.events.emit(
                    TrainingFinished(step=self.step, loss=loss, output_path=str(output))
                )
                logger.info("finished at step %d, loss %s; model in %s", self.step, loss, output)
            dist.barrier()
        return TrainResult(self.step, self.epoch, loss, True, output)

    def _check_writer(self) -> None:
        """Refuse to commit a file unless this is the job's newest rank 0 (see ``fence``)."""
        if self._writer is not None:
            self._writer.check()

    def _crash_drill(self, point: str, step: int) -> None:
        """Drill: SIGKILL this process at ``point`` of the first save at or after step
        ``snapshot_crash_step``, once per job (a marker file in a local snapshot
        directory remembers it, and names the step)."""
        cfg = self.config
        if cfg.snapshot_crash_at != point or is_url(cfg.snapshot_dir):
            return
        if cfg.snapshot_crash_step is None or step < cfg.snapshot_crash_step:
            return
        directory = Path(cfg.snapshot_dir)
        if list(directory.glob(f".crashed-{point}-*")):
            return
        (directory / f".crashed-{point}-{step}").touch()
        logger.warning("drill: killing rank 0 at %s of the step-%d save", point, step)
        os.kill(os.getpid(), signal.SIGKILL)

    def _freeze_drill(self) -> None:
        cfg = self.config
        if cfg.freeze_at_step != self.step or cfg.freeze_rank != self.rank:
            return
        marker = Path(cfg.snapshot_dir) / f".froze-at-step-{self.step}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        logger.warning("drill: freezing at step %d (freeze_at_step)", self.step)
        while True:
            time.sleep(1.0)

    def _stop_requested(self) -> bool:
        stop = self.config.stop_after_steps
        return stop is not None and self.step >= stop

    def _run_epoch(self, epoch: int) -> None:
        cfg = self.config
        self.sampler.set_epoch(epoch, consumed=self.samples_consumed)
        batches = len(self.loader)
        self.ddp.train()
        for index, (inputs, targets) in enumerate(self.loader):
            loss = self._run_batch(inputs, targets)
            self.step += 1
            startup.mark(startup.Moment.FIRST_STEP)
            beat()
            self._freeze_drill()
            self._last_loss = loss
            samples = len(inputs) * self.world_size  # every rank's batch has this size
            self._window_samples += samples
            if index + 1 == batches:
                self.epoch, self.samples_consumed = epoch + 1, 0
            else:
                self.samples_consumed += samples
            if self.step % cfg.log_every_steps == 0:
                self._report_progress(epoch, loss)
            if cfg.snapshot_every_steps and self.step % cfg.snapshot_every_steps == 0:
                self._save_snapshot()
            if self._stop_requested():
                return
            if cfg.step_delay_s > 0:
                time.sleep(cfg.step_delay_s)
        if batches == 0:
            self.epoch, self.samples_consumed = epoch + 1, 0
        if cfg.snapshot_every_epochs and self.epoch % cfg.snapshot_every_epochs == 0:
            self._save_snapshot()

    def _run_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss = self.loss_fn(self.ddp(inputs), targets)
            loss.backward()
            self.optimizer.step()
        else:
            with torch.autocast(self.device.type, enabled=self.scaler.is_enabled()):
                loss = self.loss_fn(self.ddp(inputs), targets)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        return float(loss.item())

    def _report_progress(self, epoch: int, loss: float) -> None:
        mean_loss = mean_across_ranks(loss, self.device)
        now = time.monotonic()
        rate = self._window_samples / max(now - self._window_start, 1e-9)
        self._window_start, self._window_samples = now, 0
        if self.rank != 0:
            return
        self.events.emit(
            TrainingProgress(
                step=self.step,
                epoch=epoch,
                loss=mean_loss,
                samples_per_s=round(rate, 1),
                world_size=self.world_size,
                startup=None if self._startup_sent else startup.startup(),
            )
        )
        self._startup_sent = True
        logger.info("step %d epoch %d loss %.5f %.0f samples/s", self.step, epoch, mean_loss, rate)

    def _total_steps(self) -> int:
        """Steps at the end of training if the world size stays as it is now."""
        return self.step + steps_left(
            len(self.dataset),  # type: ignore[arg-type]
            self.epoch,
            self.samples_consumed,
            self.config.max_epochs,
            self.world_size,
            self.config.batch_size,
            drop_last_batch=self.config.drop_last_batch,
        )

    def _save_snapshot(self, wait: bool = False) -> None:
        """Rank 0 copies the state after ``self.step`` and hands it to the saver; no
        collectives in here. With ``wait``, the save is on storage when this returns."""
        if self.rank != 0:
            self._last_snapshot_step = self.step
        elif wait or self._last_snapshot_step != self.step:
            with beating():  # a long save in the foreground is progress too
                if self._last_snapshot_step != self.step:
                    self._submit_snapshot(wait)
                if wait:
                    self.saver.wait()
        beat()

    def _submit_snapshot(self, wait: bool) -> None:
        if wait:
            self.saver.wait()  # a save still in flight first, so this one is not dropped
        elif self.saver.drop_if_busy(self.step):
            return  # not copied: the next save is due (a copy off the GPU is not free)
        snapshot = capture_state(
            self.model,
            self.optimizer,
            self.scheduler,
            scaler=self.scaler,
            step=self.step,
            epoch=self.epoch,
            samples_consumed=self.samples_consumed,
            world_size=self.world_size,
            seed=self.config.seed,
            device=self.device,
        )
        if self.saver.submit(snapshot):  # a dropped one is not taken: the next save is due
            self._last_snapshot_step = self.step

    def _snapshot_saved(self, manifest: Manifest, seconds: float, background: bool) -> None:
        path = self.saver.storage.path_of(manifest.file)
        self.events.emit(
            SnapshotSaved(
                step=manifest.step,
                epoch=manifest.epoch,
                world_size=manifest.world_size,
                path=path,
                bytes=manifest.size_bytes,
                sha256=manifest.sha256,
                seconds=round(seconds, 3),
                background=background,
            )
        )
        logger.info(
            "snapshot at step %d (epoch %d): %s, %d bytes, sha256 %s, %.2f s%s",
            *(manifest.step, manifest.epoch, path, manifest.size_bytes, manifest.sha256[:12]),
            seconds,
            " in the background" if background else "",
        )

    def _snapshot_failed(self, step: int, error: str) -> None:
        self.events.emit(SnapshotFailed(step=step, error=error))

    def _snapshot_skipped(self, step: int, reason: str) -> None:
        self.events.emit(SnapshotSkipped(step=step, reason=reason))

    def _load_snapshot(self) -> None:
        """Load the newest snapshot any rank can see into model, optimizer and RNG.

        Collective: ranks agree on the newest snapshot any of them can read.
        """
        found = load_latest_snapshot(self.config.snapshot_dir, on_skip=self._snapshot_skipped)
        snapshot = agree_on_snapshot(found[0] if found is not None else None)
        if snapshot is None:
            if self.rank == 0:
                logger.info("no snapshot in %s: starting fresh", self.config.snapshot_dir)
            return
        if snapshot.seed != self.config.seed and self.rank == 0:
            logger.warning("snapshot seed %d differs from seed %d", snapshot.seed, self.config.seed)
        restore_state(
            snapshot, self.model, self.optimizer, self.scheduler, self.device, self.scaler
        )
        self.step = self._last_snapshot_step = snapshot.step
        self.resumed_from_step = snapshot.step
        startup.mark(startup.Moment.SNAPSHOT_LOADED)
        self.epoch = snapshot.epoch
        self.samples_consumed = snapshot.samples_consumed
        if self.rank == 0:
            logger.info(
                "resumed from snapshot step %d (epoch %d, %d samples consumed, saved at world "
                "size %d)",
                snapshot.step,
                snapshot.epoch,
                snapshot.samples_consumed,
                snapshot.world_size,
            )
