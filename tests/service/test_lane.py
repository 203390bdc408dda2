"""The heartbeats' lane asks whether a request's client is still there only once the
request has waited: asking costs every heartbeat CPU, and a client that keeps the agents'
timeouts still waits for an answer that comes sooner."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
from starlette.requests import Request

from service.api.lane import GONE_CHECK_AFTER_S, Lane, Shed
from service.metrics import ARRIVED


def _request(waited_s: float, client_left: bool) -> tuple[Request, list[int]]:
    """A request that reached the app ``waited_s`` ago, and how often it was asked for
    its client (a receive)."""
    asked: list[int] = []

    async def receive() -> dict[str, Any]:
        asked.append(1)
        if client_left:
            return {"type": "http.disconnect"}
        await anyio.sleep_forever()  # nothing more from a client that waits
        raise AssertionError("unreachable")

    scope = {"type": "http", ARRIVED: time.monotonic() - waited_s}
    return Request(scope, receive), asked


def _run(lane: Lane, request: Request) -> str:
    async def go() -> str:
        return await lane.run(request, lambda: "worked on")

    return anyio.run(go)


def test_a_request_taken_up_at_once_is_worked_on_without_asking_for_its_client() -> None:
    request, asked = _request(0.0, client_left=True)
    assert _run(Lane(threads=1, wait_max_s=60), request) == "worked on"
    assert asked == []


def test_a_request_that_waited_is_shed_if_its_client_left() -> None:
    request, asked = _request(GONE_CHECK_AFTER_S + 0.5, client_left=True)
    with pytest.raises(Shed) as shed:
        _run(Lane(threads=1, wait_max_s=60), request)
    assert shed.value.reason == "gone"
    assert asked == [1]


def test_a_request_that_waited_is_worked_on_while_its_client_waits() -> None:
    request, asked = _request(GONE_CHECK_AFTER_S + 0.5, client_left=False)
    assert _run(Lane(threads=1, wait_max_s=60), request) == "worked on"
    assert asked == [1]


def test_a_request_that_waited_past_the_bound_is_shed_unasked() -> None:
    request, asked = _request(5.0, client_left=False)
    with pytest.raises(Shed) as shed:
        _run(Lane(threads=1, wait_max_s=2), request)
    assert shed.value.reason == "waited"
    assert asked == []
