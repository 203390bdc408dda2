"""When the reconciler's passes begin and end, shared between its loop and the callers
that wake it (a submit, a registration) and stop it.

The loop may run on a thread of the API's process or in a process of its own
(``service.reconciler_process``); the same signals serve both, built from threading
primitives or from those of a ``multiprocessing`` context.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from typing import Any, Protocol


class _Event(Protocol):
    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass
class _Count:
    """An int with the ``value`` of ``multiprocessing.Value``, for the in-process signals."""

    value: int = 0


@dataclass
class PassSignals:
    """``woken``: the next pass begins after the rest, not after the interval.
    ``waited_on``: a caller holds an API thread until a pass ends, so the rest ends too.
    ``stop``: the loop ends. ``begun`` and ``ended`` count the loop's passes, read and
    written under ``passes`` (whose waiters are told when a pass ends)."""

    stop: _Event
    woken: _Event
    waited_on: _Event
    passes: Any  # threading.Condition or multiprocessing's Condition
    begun: Any = field(default_factory=_Count)
    ended: Any = field(default_factory=_Count)

    @classmethod
    def in_process(cls) -> PassSignals:
        return cls(threading.Event(), threading.Event(), threading.Event(), threading.Condition())

    @classmethod
    def across_processes(cls, context: BaseContext) -> PassSignals:
        """Signals a child process of ``context`` inherits (passed to it as arguments)."""
        passes = context.Condition()
        return cls(
            context.Event(),
            context.Event(),
            context.Event(),
            passes,
            # Read and written under ``passes`` only, so they need no lock of their own.
            context.Value("q", 0, lock=False),
            context.Value("q", 0, lock=False),
        )

    def wake(self, wait_s: float = 0.0) -> bool:
        """Begin the next pass without waiting for the interval, once the rest after the
        last pass has ended. Wakes that come during a pass make one more pass, not one each.

        With ``wait_s``, return once a pass begun after this call has ended (True), or
        after ``wait_s`` (False): a caller that committed before calling then knows the
        pass saw its commit. Such a wake also ends the rest at once."""
        with self.passes:
            target = self.begun.value + 1
            self.woken.set()
            if wait_s > 0:
                self.waited_on.set()
        if wait_s <= 0:
            return False
        with self.passes:
            return bool(
                self.passes.wait_for(
                    lambda: self.ended.value >= target or self.stop.is_set(), wait_s
                )
                and not self.stop.is_set()
            )

    def begin(self) -> None:
        """The loop begins a pass: wakes from now on ask for the one after it."""
        with self.passes:
            self.woken.clear()
            self.waited_on.clear()
            self.begun.value += 1

    def end(self) -> None:
        with self.passes:
            self.ended.value += 1
            self.passes.notify_all()

    def rest(self, rest_s: float, interval_s: float) -> None:
        """Wait ``rest_s`` unless a caller waits on a pass, then until the interval is
        over unless woken."""
        self.waited_on.wait(rest_s)
        self.woken.wait(max(0.0, interval_s - rest_s))

    def request_stop(self) -> None:
        self.stop.set()
        self.woken.set()
        self.waited_on.set()
        with self.passes:
            self.passes.notify_all()
