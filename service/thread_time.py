"""Where a thread's wall time went: on a CPU (``time.thread_time``, exact), ready to run
but waiting for a CPU (Linux's scheduler's count for the thread, the second figure of
``/proc/self/task/TID/schedstat``), and the rest, time the thread slept: waiting on a
socket (the database), a lock, or the interpreter's lock. Where the kernel keeps no such
count there are no figures.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Where each thread of this process has its scheduler's counts.
TASKS = Path("/proc/self/task")


def schedstat_of(thread_id: int, tasks: Path = TASKS) -> Path:
    """Where the scheduler's counts of thread ``thread_id`` (its native id) are."""
    return tasks / str(thread_id) / "schedstat"


def waited_for_cpu(path: Path) -> float | None:
    """The seconds the thread of ``path`` (``schedstat_of``) has been ready to run but
    waiting for a CPU since it began; None where the kernel does not say. A kernel that
    keeps no counts writes zeros, and a thread that reads its own file has run."""
    try:
        on_cpu, waiting, *_ = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return None
    if on_cpu == 0:
        return None
    return waiting / 1e9


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
    """Splits the wall time of the thread that made it, from its making to ``split``, as
    ``Split`` says. ``split`` on another thread has no figures (a thread's CPU time is
    read on the thread itself)."""

    def __init__(self, tasks: Path = TASKS) -> None:
        self._thread = threading.get_native_id()
        self._path = schedstat_of(self._thread, tasks)
        self._wall = time.perf_counter()
        self._cpu = time.thread_time()
        self._waited = waited_for_cpu(self._path)

    def split(self) -> Split | None:
        wall = time.perf_counter() - self._wall
        running = time.thread_time() - self._cpu
        if self._waited is None or threading.get_native_id() != self._thread:
            return None  # no figures, or this thread's CPU time is not the span's thread's
        waited = waited_for_cpu(self._path)
        if waited is None:
            return None
        runnable = max(0.0, waited - self._waited)
        return Split(running, runnable, max(0.0, wall - running - runnable))
