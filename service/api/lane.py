"""Threads of their own for one kind of request, that shed what nobody waits for.

Under more load than the controller can answer, requests queue for a thread. An agent
gives up on an answer after its timeout and asks again; a controller that still works on
every request it queued spends itself on answers nobody reads, each one later than the
last, until none comes in time: the heartbeats of a fleet that is told nothing new send
ever more (a node that never hears the controller's pace keeps the base interval). A
request whose client has gone, or that waited for a thread longer than ``wait_max_s``
(less than an agent's timeout), is answered 503 with ``Retry-After`` instead, at no cost
to the database, so that the requests behind it are answered while they are still waited
for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio
from starlette.requests import Request

from service.metrics import ARRIVED

_T = TypeVar("_T")

# A request that got its turn sooner than this is not asked whether its client is still
# there: a client that keeps the agents' timeouts (5 s) still waits for it, and asking
# the server (a receive under a cancelled scope) cost about a twentieth of a heartbeat's
# CPU in its process, for every heartbeat.
GONE_CHECK_AFTER_S = 1.0


class Shed(Exception):
    """The request was not worked on: ``reason`` is ``gone`` (its client closed the
    connection) or ``waited`` (longer than the lane's bound), after ``waited_s``."""

    def __init__(self, reason: str, waited_s: float) -> None:
        super().__init__(f"{reason} after {waited_s:.1f} s in the queue")
        self.reason = reason
        self.waited_s = waited_s


class Lane:
    """``threads`` threads; a request that gets its turn after ``wait_max_s``, or after its
    client left (asked once it waited ``GONE_CHECK_AFTER_S``), raises ``Shed`` instead of
    running (``wait_max_s`` 0: none is shed). Made on the event loop that uses it."""

    def __init__(self, threads: int, wait_max_s: float) -> None:
        self._turns = anyio.CapacityLimiter(threads)
        # Only holders of a turn ask for a thread, so this never makes anyone wait; it keeps
        # the lane's threads out of the default limiter the API's routes share.
        self._threads = anyio.CapacityLimiter(threads)
        self.wait_max_s = wait_max_s

    def waiting(self) -> int:
        """How many requests wait for their turn now."""
        return int(self._turns.statistics().tasks_waiting)

    async def run(self, request: Request, work: Callable[[], _T]) -> _T:
        """``work()`` on a thread of the lane. The wait counts from when the request
        reached the app, so a busy event loop counts too."""
        arrived = request.scope.get(ARRIVED, time.monotonic())
        async with self._turns:
            if self.wait_max_s > 0:
                waited = time.monotonic() - arrived
                if waited > self.wait_max_s:
                    raise Shed("waited", waited)
                if waited >= GONE_CHECK_AFTER_S and await request.is_disconnected():
                    raise Shed("gone", waited)
            return await anyio.to_thread.run_sync(work, limiter=self._threads)
