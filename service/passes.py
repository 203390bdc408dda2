"""When the reconciler's passes begin and end, shared between its loop and the callers
that wake it (a submit, a registration) and stop it.

On a thread of the API's process the callers use these directly. In the reconciler's
own process (``service.reconciler_process``) a thread that reads the controller's
messages calls ``ask`` with the tickets of the callers that wait, and the loop hands
each pass's tickets back when it has ended; nothing here is shared between processes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class PassSignals:
    """``woken``: the next pass begins after the rest, not after the interval.
    ``waited_on``: a caller holds an API thread until a pass ends, so the rest ends too.
    ``stop``: the loop ends. ``begun`` and ``ended`` count the loop's passes, read and
    written under ``passes`` (whose waiters are told when a pass ends)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.woken = threading.Event()
        self.waited_on = threading.Event()
        self.passes = threading.Condition()
        self.begun = 0
        self.ended = 0
        # Tickets of callers in another process that wait for the next pass to begin (``ask``).
        self._asked: list[int] = []

    def wake(self, wait_s: float = 0.0) -> bool:
        """Begin the next pass without waiting for the interval, once the rest after the
        last pass has ended. Wakes that come during a pass make one more pass, not one each.

        With ``wait_s``, return once a pass begun after this call has ended (True), or
        after ``wait_s`` (False): a caller that committed before calling then knows the
        pass saw its commit. Such a wake also ends the rest at once."""
        with self.passes:
            target = self.begun + 1
            self.woken.set()
            if wait_s > 0:
                self.waited_on.set()
        if wait_s <= 0:
            return False
        with self.passes:
            return (
                self.passes.wait_for(lambda: self.ended >= target or self.stop.is_set(), wait_s)
                and not self.stop.is_set()
            )

    def ask(self, tickets: Iterable[int], waiting: bool) -> None:
        """A wake sent by another process: as ``wake``, without waiting here. The
        ``tickets`` are those of its callers that wait; ``begin`` hands them to the pass
        that begins next, which answers them when it has ended."""
        with self.passes:
            self._asked.extend(tickets)
            self.woken.set()
            if waiting:
                self.waited_on.set()

    def begin(self) -> list[int]:
        """The loop begins a pass: wakes from now on ask for the one after it. Returns the
        tickets this pass answers (``ask``)."""
        with self.passes:
            self.woken.clear()
            self.waited_on.clear()
            self.begun += 1
            tickets, self._asked = self._asked, []
            return tickets

    def end(self) -> None:
        with self.passes:
            self.ended += 1
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
