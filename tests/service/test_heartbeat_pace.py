"""The heartbeat pace: a larger fleet is told a longer interval, and given that much
more silence before a node is lost."""

from __future__ import annotations

import pytest

from service.heartbeats import PACE_RECOUNT_S, Pace, paced_interval
from service.reconciler import Reconciler
from service.settings import ControllerSettings
from tests.helpers import FakeClock
from tests.service.helpers import Cluster, register


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
    ],
)
def test_the_interval_keeps_the_fleet_within_its_heartbeat_budget(
    alive: int, base_s: float, per_s_max: float, told_s: float
) -> None:
    assert paced_interval(alive, base_s, per_s_max) == told_s
    assert alive / told_s <= per_s_max or told_s == base_s


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
    api.app.state.heartbeat_pace = Pace(settings, clock=ticks)  # type: ignore[attr-defined]
    a, b = register(api, "a"), register(api, "b")
    register(api, "c")
    reconciler.run_once()  # leads from now: silence counts from here at the earliest
    assert beat(api, b) == 1.0  # counted at a's registration: no node was alive
    ticks.now += PACE_RECOUNT_S
    assert beat(api, a) == 3.0  # three alive at one heartbeat a second at most

    clock.advance(11)  # b and c silent for 11 s, a for 11 s of the 12 s it may be
    reconciler.run_once()
    assert states(api) == {"a": "ALIVE", "b": "LOST", "c": "LOST"}
    clock.advance(1.5)
    reconciler.run_once()
    assert states(api)["a"] == "LOST"

    # a is back alone: the next count tells it the base interval, and 10 s of silence
    assert beat(api, a) == 3.0  # not counted again yet
    ticks.now += PACE_RECOUNT_S
    assert beat(api, a) == 1.0
    clock.advance(10.5)
    reconciler.run_once()
    assert states(api)["a"] == "LOST"
