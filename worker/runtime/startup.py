"""The moments of this worker process's start, as wall-clock times of its node.

Each moment is kept the first time it is marked and never moved: a process starts
once. ``imported`` is marked by the worker bootstrap once torch is imported,
``process_group`` and ``snapshot_loaded`` by the ``Trainer`` (or a script's
``report.resumed``), ``first_step`` by the first optimizer step. The creation of
the process is not marked but read from the kernel (``/proc/self/stat``), so it is
the fork, before the interpreter even started (see ``process_clock``); it is
None where there is no ``/proc``.

Wall-clock times (``time.time``), not monotonic ones: the controller sets them
beside the node's other events. Moments of one process are on one clock.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from enum import StrEnum

from contract.events import WorkerStartup
from worker.runtime.process_clock import process_started_at


class Moment(StrEnum):
    IMPORTED = "imported"
    PROCESS_GROUP = "process_group"
    SNAPSHOT_LOADED = "snapshot_loaded"
    FIRST_STEP = "first_step"


_marked: dict[Moment, float] = {}


def mark(moment: Moment, at: float | None = None) -> None:
    """Record ``moment`` at ``at`` (default: now), unless it was recorded before."""
    if moment not in _marked:
        _marked[moment] = time.time() if at is None else at


def reached(moment: Moment) -> bool:
    return moment in _marked


def startup() -> WorkerStartup:
    """The moments recorded so far, with the process's creation."""

    def at(seconds: float | None) -> datetime | None:
        return None if seconds is None else datetime.fromtimestamp(seconds, UTC)

    return WorkerStartup(
        process_started_at=at(process_started_at()),
        imported_at=at(_marked.get(Moment.IMPORTED)),
        process_group_at=at(_marked.get(Moment.PROCESS_GROUP)),
        snapshot_loaded_at=at(_marked.get(Moment.SNAPSHOT_LOADED)),
        first_step_at=at(_marked.get(Moment.FIRST_STEP)),
    )


def forget() -> None:
    """Forget every mark (for tests that play several processes in one)."""
    _marked.clear()
