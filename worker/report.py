"""What a training script tells relaunch: its step, loss, speed, named metrics, its resume.

Usage, from any rank of a script run as a relaunch job::

    from worker import report

    report.resumed(step)            # after loading your own snapshot
    report.step(step, loss=loss, samples_per_s=rate, metrics={"acc": acc})

Only rank 0's reports are sent (``RANK`` 0, or no ``RANK``); on the other ranks,
and outside relaunch (no ``RELAUNCH_EVENTS_FILE``), every call only beats the
hang-detection progress, if that is on. Importing this module pulls in neither
torch nor the controller.

Without any call, the worker bootstrap counts optimizer steps by itself (see
``worker.runtime.step_counter``). The first ``step`` report of a process turns
that count off, so a script's own steps are never counted twice; ``resumed``
does not, and the count goes on from the step it names.

A report that cannot be written is logged and dropped: reporting never stops
training. Values out of range raise ``ValueError`` (a negative step, more than
``MAX_NAMED_METRICS`` metrics, a name longer than 64 characters).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TypeVar

from pydantic import ValidationError

from contract.events import MAX_NAMED_METRICS, TrainingProgress, TrainingStarted
from worker.runtime import startup
from worker.runtime.events import EventWriter
from worker.runtime.progress import beat

__all__ = ["MAX_NAMED_METRICS", "manual_steps", "resumed", "started", "step"]

_Payload = TypeVar("_Payload", TrainingProgress, TrainingStarted)


class Reporter:
    """This process's reports: one writer (rank 0's only) and whether the script reports
    its own steps."""

    def __init__(self) -> None:
        self._writer: EventWriter | None = None
        self.explicit_steps = False
        self.resumed_from_step: int | None = None
        self._startup_sent = False

    @property
    def writer(self) -> EventWriter:
        if self._writer is None:
            rank = os.environ.get("RANK", "0").strip() or "0"
            enabled = rank == "0"
            self._writer = EventWriter.from_environ() if enabled else EventWriter.disabled()
        return self._writer

    @property
    def enabled(self) -> bool:
        return self.writer.enabled

    def emit_progress(
        self,
        step: int,
        *,
        epoch: int = 0,
        loss: float | None = None,
        samples_per_s: float | None = None,
        step_time_s: float | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        beat()
        if not self.enabled:
            return
        progress = _validated(
            TrainingProgress,
            step=step,
            epoch=epoch,
            loss=loss,
            samples_per_s=samples_per_s,
            step_time_s=step_time_s,
            world_size=_world_size(),
            metrics=dict(metrics or {}),
            startup=None if self._startup_sent else startup.startup(),
        )
        # sent until it holds the first step: a script may report before its first step
        if progress.startup is not None and progress.startup.first_step_at is not None:
            self._startup_sent = True
        self.writer.emit(progress)


_reporter = Reporter()


def process_reporter() -> Reporter:
    """This process's reporter (the automatic step count reports through it)."""
    return _reporter


def manual_steps() -> None:
    """Turn off the automatic count of optimizer steps: the caller reports its steps."""
    _reporter.explicit_steps = True


def step(
    step: int,
    *,
    loss: float | None = None,
    samples_per_s: float | None = None,
    epoch: int = 0,
    step_time_s: float | None = None,
    metrics: Mapping[str, float] | None = None,
) -> None:
    """Report that training reached optimizer step ``step`` (counted from the start of
    training, resumes included). From then on this process's optimizer steps are no
    longer counted automatically."""
    _reporter.explicit_steps = True
    _reporter.emit_progress(
        step,
        epoch=epoch,
        loss=loss,
        samples_per_s=samples_per_s,
        step_time_s=step_time_s,
        metrics=metrics,
    )


def started(total_steps: int | None = None) -> None:
    """Report that training starts from scratch, with ``total_steps`` if known."""
    _reporter.resumed_from_step = None
    _emit_started(None, total_steps)


def resumed(step: int, total_steps: int | None = None) -> None:
    """Report that training resumed from the script's own snapshot taken at ``step``;
    the job's timeline shows "training resumed from snapshot at step N". Call it right
    after loading: it marks when the snapshot was loaded."""
    startup.mark(startup.Moment.SNAPSHOT_LOADED)
    _reporter.resumed_from_step = step
    _emit_started(step, total_steps)


def _emit_started(resumed_from_step: int | None, total_steps: int | None) -> None:
    beat()
    if not _reporter.enabled:
        return
    restart_count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    started = _validated(
        TrainingStarted,
        world_size=_world_size(),
        restart_count=int(restart_count) if restart_count.isdigit() else None,
        resumed_from_step=resumed_from_step,
        total_steps=total_steps,
        startup=startup.startup(),
    )
    _reporter.writer.emit(started)


def _world_size() -> int:
    raw = os.environ.get("WORLD_SIZE", "").strip()
    return int(raw) if raw.isdigit() else 1


def _validated(model: type[_Payload], **fields: object) -> _Payload:
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        raise ValueError(f"{model.kind.value} report refused: {exc}") from None
