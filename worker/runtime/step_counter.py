"""Progress of a script that reports nothing: its optimizer steps, counted.

The worker bootstrap installs one global optimizer step hook per worker
(``torch.optim.optimizer.register_optimizer_step_post_hook``). Every
``optimizer.step()`` of any optimizer beats the hang-detection progress on every
rank and counts one step; on rank 0 the count is reported at most every
``interval_s`` (the first step at once, the last at exit) with the mean step
time since the previous report. A script with two optimizers stepping once
each per batch therefore shows two steps per batch.

The count stays quiet once the script reports its own steps (``report.step``,
or the built-in ``Trainer``). It starts from the step a ``report.resumed`` call
named. The first step of any optimizer is the process's first step (see
``worker.runtime.startup``). A failure inside the hook is logged once and turns
the count off: counting must never stop training.
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from worker.report import Reporter, process_reporter
from worker.runtime import startup
from worker.runtime.progress import beat

logger = logging.getLogger(__name__)

REPORT_INTERVAL_S = 1.0


class StepCounter:
    """Counts steps and decides when rank 0 reports them; ``now`` is a monotonic time."""

    def __init__(self, reporter: Reporter, interval_s: float = REPORT_INTERVAL_S) -> None:
        self._reporter = reporter
        self._interval_s = interval_s
        self.count = 0
        self._reported_at: float | None = None
        self._reported_count = 0
        self._broken = False

    def on_step(self, now: float) -> None:
        beat()
        if self._broken or self._reporter.explicit_steps:
            return
        self.count += 1
        if self._reported_at is None:
            self._report(now, step_time_s=None)
        elif now - self._reported_at >= self._interval_s:
            self._report(now, step_time_s=self._mean_step_time(now))

    def flush(self, now: float) -> None:
        """Report the steps counted since the last report (at exit)."""
        if self._broken or self._reporter.explicit_steps or self.count == self._reported_count:
            return
        self._report(now, step_time_s=self._mean_step_time(now))

    def _mean_step_time(self, now: float) -> float | None:
        steps = self.count - self._reported_count
        if self._reported_at is None or steps <= 0:
            return None
        return (now - self._reported_at) / steps

    def _report(self, now: float, step_time_s: float | None) -> None:
        self._reported_at, self._reported_count = now, self.count
        if not self._reporter.enabled:
            return
        base = self._reporter.resumed_from_step or 0
        try:
            self._reporter.emit_progress(base + self.count, step_time_s=step_time_s)
        except Exception:
            self._broken = True
            logger.exception("counting optimizer steps failed; steps are no longer reported")


def install(
    reporter: Reporter | None = None, clock: Callable[[], float] = time.monotonic
) -> StepCounter:
    """Count this process's optimizer steps from now on (see the module's docstring)."""
    counter = StepCounter(reporter or process_reporter())

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        startup.mark(startup.Moment.FIRST_STEP)
        counter.on_step(clock())

    register_optimizer_step_post_hook(hook)
    atexit.register(lambda: counter.flush(clock()))
    return counter
