"""Where a thread's wall time went, as Linux's scheduler counts it for the thread
(``/proc/thread-self/schedstat``): on a CPU, or ready to run and waiting for one. The
rest of a span is time the thread slept: waiting on a socket (the database), a lock, or
the interpreter's lock. Elsewhere (no such file) there are no figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

SCHEDSTAT = Path("/proc/thread-self/schedstat")


def scheduler_times(path: Path = SCHEDSTAT) -> tuple[float, float] | None:
    """The calling thread's seconds on a CPU and seconds ready but waiting for one, since
    it began; None where the kernel does not say."""
    try:
        on_cpu, waiting, *_ = path.read_text().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Split:
    """A span of one thread's wall time, in seconds: ``running`` on a CPU, ``runnable``
    waiting for one, ``blocked`` the rest (asleep on I/O or a lock)."""

    running: float
    runnable: float
    blocked: float

    def describe(self) -> str:
        return (
            f"on a CPU {self.running:.2f} s, waiting for a CPU {self.runnable:.2f} s, "
            f"waiting on the database or a lock {self.blocked:.2f} s"
        )


class SpanClock:
    """Splits the wall time from its making to ``split`` (same thread) as ``Split`` says."""

    def __init__(self, path: Path = SCHEDSTAT) -> None:
        self._path = path
        self._wall = time.perf_counter()
        self._start = scheduler_times(path)

    def split(self) -> Split | None:
        wall = time.perf_counter() - self._wall
        end = scheduler_times(self._path)
        if self._start is None or end is None:
            return None
        running = max(0.0, end[0] - self._start[0])
        runnable = max(0.0, end[1] - self._start[1])
        return Split(running, runnable, max(0.0, wall - running - runnable))
