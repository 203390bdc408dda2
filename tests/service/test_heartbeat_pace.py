"""The heartbeat pace: a larger fleet is told a longer interval, and given that much
more silence before a node is lost."""

from __future__ import annotations

import functools

import pytest

from service.heartbeats import PACE_RECOUNT_S, Pace, allowed_silence, count_alive, paced_interval
from service.reconciler import Reconciler
from service.settings import ControllerSettings
from tests.helpers import FakeClock
from tests.service.helpers import ENROLMENT_TOKEN, Cluster, register


@pytest.mark.parametrize(
    "alive,base_s,per_s_max,told_s",
    [
        (0, 1.0, 100.0, 1.0),
        (100, 1.0, 100.0, 1.0),  # exactly the budget at the base interval
        (101, 1.0, 100.0, 1.1),  # rounded up to a tenth
        (150, 1.0, 100.0, 1.5),
        (1000, 1.0, 100.0, 10.0),
        (30, 2.0, 10.0, 3.0),
        (3, 1.0, 1.0, 3.0),
        (100_000, 1.0, 1.0, 60.0),  # never longer than a minute
    ],
)
def test_the_interval_keeps_the_fleet_within_its_heartbeat_budget(
    alive: int, base_s: float, per_s_max: float, told_s: float
) -> None:
    assert paced_interval(alive, base_s, per_s_max) == told_s
    assert alive / told_s <= per_s_max or told_s in (base_s, 60.0)


def test_a_node_at_any_pace_may_miss_one_heartbeat() -> None:
    assert allowed_silence(10.0, 1.0, None) == 10.0
    assert allowed_silence(10.0, 1.0, 1.0) == 10.0
    for told in (1.5, 3.0, 10.0, 60.0):
        assert allowed_silence(10.0, 1.0, told) > 2 * told


@pytest.fixture
def settings(settings: ControllerSettings) -> ControllerSettings:
    return settings.model_copy(update={"heartbeats_per_s_max": 1.0})  # 3 nodes: every 3 s


class Ticks:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def beat(api: Cluster, node_id: int) -> float:
    r = api.post(f"/api/v1/nodes/{node_id}/heartbeat", json={"running": []})
    assert r.status_code == 200, r.text
    told: float = r.json()["heartbeat_interval_s"]
    return told


def states(api: Cluster) -> dict[str, str]:
    return {n["name"]: n["state"] for n in api.get("/api/v1/nodes").json()["items"]}


def test_a_node_told_a_longer_interval_is_lost_that_much_later(
    api: Cluster, reconciler: Reconciler, clock: FakeClock, settings: ControllerSettings
) -> None:
    ticks = Ticks()
    read_factory = api.app.state.read_session_factory  # type: ignore[attr-defined]
    pace = Pace(settings, functools.partial(count_alive, read_factory), clock=ticks)
    api.app.state.heartbeat_pace = pace  # type: ignore[attr-defined]
    a, b = register(api, "a"), register(api, "b")
    r = api.post(
        "/api/v1/nodes/register",
        json={"name": "c", "address": "127.0.0.1", "slots": 1, "pid": 1},
        headers={"Authorization": f"Bearer {ENROLMENT_TOKEN}"},
    )
    assert r.json()["heartbeat_interval_s"] == 1.0  # registration tells the base interval
    reconciler.run_once()  # leads from now: silence counts from here at the earliest
    assert beat(api, b) == 3.0  # three alive at one heartbeat a second at most
    ticks.now += PACE_RECOUNT_S - 0.1
    register(api, "d")
    assert beat(api, b) == 3.0  # not counted again yet
    ticks.now += 0.1
    assert beat(api, a) == 4.0

    clock.advance(11)  # c and d silent for 11 s, as told; b may be for 10 + 2 * 2 s, a 16 s
    reconciler.run_once()
    assert states(api) == {"a": "ALIVE", "b": "ALIVE", "c": "LOST", "d": "LOST"}
    clock.advance(4)  # b silent for 15 s of its 14, a of its 16
    reconciler.run_once()
    assert states(api) == {"a": "ALIVE", "b": "LOST", "c": "LOST", "d": "LOST"}

    # a is alone: the next count tells it the base interval, and 10 s of silence
    ticks.now += PACE_RECOUNT_S
    assert beat(api, a) == 1.0
    clock.advance(10.5)
    reconciler.run_once()
    assert states(api)["a"] == "LOST"
