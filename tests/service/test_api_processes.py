"""What goes between an API helper process and its controller (``service.api_processes``),
over a real socket pair in this process, and how the helpers' metrics add up on the
controller's ``/metrics`` (``service.metrics.HelperShares``)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from service import api_processes
from service.api_processes import ApiProcesses, ControllerLink, Families, Helper
from service.metrics import API_PROCESSES, ControllerMetrics, HelperShares
from service.settings import ControllerSettings


class Wakes:
    """The controller's reconciler's ``wake``, as recorded: answers True to a wake that
    waits (a pass ended), as ``PassSignals.wake`` does once one has."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def __call__(self, wait_s: float) -> bool:
        self.asked.append(wait_s)
        return wait_s > 0


class Process:
    """What the controller's side does to a helper's process, recorded."""

    pid = 12345

    def __init__(self) -> None:
        self.killed = threading.Event()

    def kill(self) -> None:
        self.killed.set()


class Joined:
    """A controller's side (``ApiProcesses.serve``) and a helper's (``ControllerLink``)
    of one socket pair, in this process."""

    def __init__(self, tmp_path: Path) -> None:
        self.wakes = Wakes()
        self.metrics = ControllerMetrics()
        self.closed = threading.Event()
        mine, theirs = socket.socketpair()
        self.process = Process()
        self.helper = Helper(self.process, Connection(mine.detach()))
        self.listener = socket.socket()
        processes = ApiProcesses(
            ControllerSettings(data_dir=tmp_path), self.listener, 1, self.wakes, self.metrics
        )
        self.serving = threading.Thread(target=processes.serve, args=(1, self.helper), daemon=True)
        self.serving.start()
        self.link = ControllerLink(Connection(theirs.detach()))
        self.link.listen(self.closed.set)


@pytest.fixture
def joined(tmp_path: Path) -> Iterator[Joined]:
    pair = Joined(tmp_path)
    yield pair
    pair.helper.hang_up()
    pair.serving.join(5)
    pair.helper.close()
    pair.listener.close()


def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.01)


def samples(exposition: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(exposition.decode())
        for s in family.samples
    }


def test_a_wake_that_waits_is_answered_by_the_controller_s_reconciler(joined: Joined) -> None:
    assert joined.link.wake(0.5) is True
    assert joined.wakes.asked == [0.5]


def test_a_wake_that_does_not_wait_reaches_the_reconciler_and_returns_at_once(
    joined: Joined,
) -> None:
    assert joined.link.wake(0.0) is False
    until(lambda: joined.wakes.asked == [0.0])


def test_a_scrape_in_a_helper_is_the_controller_s_answer_with_every_share(
    joined: Joined,
) -> None:
    """The helper's ``/metrics`` is the controller's exposition, which adds what the helper
    sent to the controller's own counts; the helper's gauges and ``process_*`` stay out."""
    helper = ControllerMetrics(exposed_by=joined.link.exposition)
    for seconds in (0.01, 0.2, 3.0):
        helper.heartbeat.observe(seconds)
    helper.shed.labels("heartbeat", "waited").inc(2)
    joined.metrics.heartbeat.observe(0.01)
    shares = helper.shares()
    assert {m.type for m in shares} <= {"counter", "histogram"}
    assert not [m for m in shares if not m.name.startswith("relaunch_")]
    joined.link.send(Families(shares))
    # Answered after the shares: one pair, read in order.
    seen = samples(helper.exposition())
    assert seen[("relaunch_heartbeat_seconds_count", frozenset())] == 4
    assert seen[("relaunch_heartbeat_seconds_bucket", frozenset({("le", "0.01")}))] == 2
    assert seen[("relaunch_heartbeat_seconds_bucket", frozenset({("le", "+Inf")}))] == 4
    waited = frozenset({("lane", "heartbeat"), ("reason", "waited")})
    assert seen[("relaunch_requests_shed_total", waited)] == 2
    assert seen[(API_PROCESSES, frozenset())] == 2
    from_controller = samples(joined.metrics.exposition())
    assert {k: v for k, v in seen.items() if k[0].startswith("relaunch_")} == {
        k: v for k, v in from_controller.items() if k[0].startswith("relaunch_")
    }


def test_what_a_helper_counted_is_kept_once_it_has_exited() -> None:
    """No sum falls when a helper exits (``rate`` would read a reset and count it all
    again); it is no longer counted among the processes."""
    shares = HelperShares()
    own = counter("relaunch_things", 1.0)
    shares.update(1, [counter("relaunch_things", 5.0)])
    shares.update(2, [counter("relaunch_things", 2.0)])
    assert value(shares.merged([own]), "relaunch_things_total") == 8.0
    assert value(shares.merged([own]), API_PROCESSES) == 3
    shares.forget(1)
    shares.update(1, [counter("relaunch_things", 0.5)])  # its successor, counting anew
    shares.forget(2)
    assert value(shares.merged([own]), "relaunch_things_total") == 8.5
    assert value(shares.merged([own]), API_PROCESSES) == 2


def test_histograms_of_two_processes_add_up() -> None:
    """Two real histograms, as the controller's and a helper's registries collect them."""
    ours, theirs = ControllerMetrics(), ControllerMetrics()
    ours.heartbeat.observe(0.003)
    theirs.heartbeat.observe(0.003)
    theirs.heartbeat.observe(7.0)
    shares = HelperShares()
    shares.update(1, theirs.shares())
    merged = shares.merged(list(ours.registry.collect()))
    assert value(merged, "relaunch_heartbeat_seconds_count") == 3
    assert value(merged, "relaunch_heartbeat_seconds_sum") == pytest.approx(7.006)
    assert value(merged, "relaunch_heartbeat_seconds_bucket", {"le": "0.005"}) == 2
    assert value(merged, "relaunch_heartbeat_seconds_bucket", {"le": "10.0"}) == 3
    created = [
        value(m.registry.collect(), "relaunch_heartbeat_seconds_created") for m in (ours, theirs)
    ]
    assert value(merged, "relaunch_heartbeat_seconds_created") == min(created)


def test_shares_add_by_name_and_labels_and_keep_the_earliest_created() -> None:
    own = HistogramMetricFamily("relaunch_wait_seconds", "w", labels=["route"])
    own.add_metric(["/a"], [("1.0", 1.0), ("+Inf", 2.0)], sum_value=3.0)
    own.samples.append(own.samples[0]._replace(name="relaunch_wait_seconds_created", value=50.0))
    theirs = HistogramMetricFamily("relaunch_wait_seconds", "w", labels=["route"])
    theirs.add_metric(["/a"], [("1.0", 4.0), ("+Inf", 4.0)], sum_value=1.0)
    theirs.add_metric(["/b"], [("1.0", 0.0), ("+Inf", 1.0)], sum_value=9.0)
    theirs.samples.append(
        theirs.samples[0]._replace(name="relaunch_wait_seconds_created", value=40.0)
    )
    shares = HelperShares()
    shares.update(1, [theirs, counter("relaunch_only_theirs", 7.0)])
    merged = shares.merged([own])
    a = {"route": "/a"}
    assert value(merged, "relaunch_wait_seconds_bucket", {**a, "le": "1.0"}) == 5.0
    assert value(merged, "relaunch_wait_seconds_bucket", {**a, "le": "+Inf"}) == 6.0
    assert value(merged, "relaunch_wait_seconds_sum", a) == 4.0
    assert value(merged, "relaunch_wait_seconds_sum", {"route": "/b"}) == 9.0
    assert value(merged, "relaunch_wait_seconds_created", {**a, "le": "1.0"}) == 40.0
    assert value(merged, "relaunch_only_theirs_total") == 7.0
    assert own.samples[0].value == 1.0  # the own family is not changed in place


def test_a_helper_whose_controller_hangs_up_stops_and_asks_nothing_more(
    joined: Joined,
) -> None:
    joined.helper.hang_up()
    assert joined.closed.wait(5), "the helper was not told its controller hung up"
    began = time.monotonic()
    assert joined.link.wake(5.0) is False
    with pytest.raises(ConnectionError):
        joined.link.exposition()
    assert time.monotonic() - began < 1.0  # neither waited for an answer that cannot come
    joined.serving.join(5)
    assert not joined.serving.is_alive()


def counter(name: str, value: float) -> Metric:
    family = CounterMetricFamily(name, "c")
    family.add_metric([], value)
    return family


def value(families: list[Metric], sample: str, labels: dict[str, str] | None = None) -> float:
    found = [
        s.value
        for family in families
        for s in family.samples
        if s.name == sample and s.labels == (labels or {})
    ]
    assert len(found) == 1, (sample, labels, found)
    return found[0]


def test_a_silent_helper_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper whose event loop sends nothing (stuck, or stopped) still holds its socket,
    whose share of the port's connections would get no answer: it is killed."""
    monkeypatch.setattr(api_processes, "SILENCE_ALLOWED_S", 0.5)
    pair = Joined(tmp_path)
    try:
        pair.link.send(Families([]))  # heard once, then silent
        pair.serving.join(10)
        assert not pair.serving.is_alive()
        assert pair.process.killed.is_set()
    finally:
        pair.helper.close()
        pair.listener.close()
