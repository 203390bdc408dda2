"""NodeAgent.step against a scripted client and a hand-moved clock (no processes)."""

import math
import os
import random
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest

from contract.protocol import (
    AttemptExit,
    AttemptReport,
    Heartbeat,
    HeartbeatReply,
    LogLine,
    NodeLeave,
    NodeLeft,
    NodeRegister,
    NodeRegistered,
    ReportAccepted,
    RunningAttempt,
)
from worker import procs
from worker.agent import NodeAgent
from worker.client import ControllerClient, ControllerUnavailableError, UnknownNodeError
from worker.settings import AgentSettings


class ScriptedClient(ControllerClient):
    def __init__(self) -> None:
        super().__init__("http://unused.invalid", "enrolment-secret")
        self.calls: list[str] = []
        self.register_failures = 0
        self.heartbeat_failures: list[Exception] = []
        self.leave_fails = False

    def register(self, body: NodeRegister) -> NodeRegistered:
        self.calls.append("register")
        if self.register_failures:
            self.register_failures -= 1
            raise ControllerUnavailableError("down")
        return NodeRegistered(node_id=7, heartbeat_interval_s=2.0, node_token="rln_seven")

    def heartbeat(self, node_id: int, body: Heartbeat) -> HeartbeatReply:
        self.calls.append(f"heartbeat {node_id}")
        if self.heartbeat_failures:
            raise self.heartbeat_failures.pop(0)
        return HeartbeatReply()

    def report(self, node_id: int, body: AttemptReport) -> ReportAccepted:
        self.calls.append("report")
        return ReportAccepted(accepted=True)

    def leave(self, node_id: int, body: NodeLeave) -> NodeLeft:
        self.calls.append(f"leave {node_id}")
        if self.leave_fails:
            raise ControllerUnavailableError("down")
        return NodeLeft(left=True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _longest(low: float, high: float) -> float:
    """A spread of the agent's that always waits the longest it may."""
    return high


def _least(low: float, high: float) -> float:
    return low


def _agent(
    tmp_path: Path,
    spread: Callable[[float, float], float] = _longest,
    clock: Clock | None = None,
) -> tuple[NodeAgent, ScriptedClient, Clock]:
    settings = AgentSettings(
        enrolment_token="t", controller_url="http://c:1", name="loop", work_dir=tmp_path
    )
    client, clock = ScriptedClient(), clock or Clock()
    return NodeAgent(settings, client, clock=clock, spread=spread), client, clock


def test_registration_backs_off_then_heartbeats_on_the_controllers_interval(
    tmp_path: Path,
) -> None:
    agent, client, clock = _agent(tmp_path)
    client.register_failures = 2
    agent.step()  # fails; next try in 0.5 s
    clock.now += 0.3
    agent.step()
    assert client.calls == ["register"]
    clock.now += 0.3
    agent.step()  # fails again; next try in 1 s
    clock.now += 0.9
    agent.step()
    assert client.calls == ["register", "register"]
    clock.now += 0.2
    agent.step()
    assert agent.node_id == 7
    agent.step()
    assert client.calls[-1] == "heartbeat 7"
    clock.now += 1.9
    agent.step()
    assert client.calls.count("heartbeat 7") == 1
    clock.now += 0.2
    agent.step()
    assert client.calls.count("heartbeat 7") == 2


def test_unknown_node_registers_again_and_outages_are_survived(tmp_path: Path) -> None:
    agent, client, clock = _agent(tmp_path)
    agent.step()
    agent.step()
    client.heartbeat_failures = [ControllerUnavailableError("down"), UnknownNodeError("404")]
    clock.now += 2.0
    agent.step()  # unavailable: keep the node id, try again next interval
    assert agent.node_id == 7
    clock.now += 2.0
    agent.step()  # 404: forget the node id
    assert agent.node_id is None
    agent.step()
    assert agent.node_id == 7
    assert client.calls.count("register") == 2


def test_the_loop_marks_itself_alive_every_second(tmp_path: Path) -> None:
    agent, _, clock = _agent(tmp_path)
    alive = tmp_path / "agent.alive"
    agent.step()
    first = alive.stat().st_mtime_ns
    clock.now += 0.5
    os.utime(alive, ns=(first, first))
    agent.step()  # not due yet
    assert alive.stat().st_mtime_ns == first
    clock.now += 0.6
    agent.step()
    assert alive.stat().st_mtime_ns > first


def test_a_stopping_agent_says_it_leaves_and_survives_a_controller_that_is_down(
    tmp_path: Path,
) -> None:
    agent, client, _ = _agent(tmp_path)
    agent.step()
    agent.request_stop()
    agent.run()  # returns at once: stop was requested
    assert client.calls[-1] == "leave 7"
    agent, client, _ = _agent(tmp_path)
    client.leave_fails = True
    agent.step()
    agent.request_stop()
    agent.run()  # the controller is down: the node times out there instead
    assert client.calls[-1] == "leave 7"


def test_the_agent_heartbeats_at_the_interval_each_reply_gives(tmp_path: Path) -> None:
    """The controller lengthens the interval as its fleet grows (and shortens it again);
    a reply without one (an older controller) keeps the last."""
    agent, client, clock = _agent(tmp_path)
    told: list[float | None] = [5.0, None, 1.0, 1.0]

    def paced(node_id: int, body: Heartbeat) -> HeartbeatReply:
        client.calls.append(f"heartbeat {node_id}")
        return HeartbeatReply(heartbeat_interval_s=told.pop(0))

    client.heartbeat = paced  # type: ignore[method-assign]
    agent.step()  # registers: every 2 s, as registration said
    agent.step()  # the first heartbeat: told 5 s, the next after the old 2 s and up to 5 s
    assert client.calls.count("heartbeat 7") == 1
    clock.now += 6.9  # the longest: 7 s
    agent.step()
    assert client.calls.count("heartbeat 7") == 1
    clock.now += 0.2
    agent.step()  # the second: no interval given, still 5 s
    assert client.calls.count("heartbeat 7") == 2
    clock.now += 4.9
    agent.step()
    assert client.calls.count("heartbeat 7") == 2
    clock.now += 0.2
    agent.step()  # the third: 1 s from now
    assert client.calls.count("heartbeat 7") == 3
    clock.now += 1.05
    agent.step()
    assert client.calls.count("heartbeat 7") == 4


def test_a_node_told_a_longer_interval_first_waits_the_old_and_up_to_the_new(
    tmp_path: Path,
) -> None:
    """Then the new interval; told a shorter one, the next goes after the shorter one."""
    asked: list[tuple[float, float]] = []

    def least(low: float, high: float) -> float:
        asked.append((low, high))
        return low

    agent, client, clock = _agent(tmp_path, spread=least)
    told: list[float | None] = [8.0, None, 1.0]

    def paced(node_id: int, body: Heartbeat) -> HeartbeatReply:
        client.calls.append(f"heartbeat {node_id}")
        return HeartbeatReply(heartbeat_interval_s=told.pop(0) if told else None)

    client.heartbeat = paced  # type: ignore[method-assign]
    sent_at = _sent_at(agent, client, clock, range(0, 200))
    # Registered at 0 (every 2 s); 0.1: told 8 s, waits 2 and up to 8 more (here none);
    # 2.1: none told, waits 8; 10.1: told 1 s, waits 1; 11.1: none told, waits 1
    assert sent_at[:5] == [0.1, 2.1, 10.1, 11.1, 12.1]
    assert asked == [(2.0, 10.0)]


def _fleet_phases(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    nodes: int,
    seed: int,
    told: Callable[[float], float],
    ticks: int,
    tick_s: float,
    window: tuple[float, float],
) -> Counter[int]:
    """``nodes`` agents that register within one second of 100 s (``seed``: their spread
    and when each registers), each heartbeat answered with the interval ``told(now)``,
    stepped ``ticks`` times ``tick_s`` apart: how many of the heartbeats sent within
    ``window`` fell in each second of ten (the second's number modulo 10)."""
    # These agents start no processes: none to reap (a look at /proc at every report tick).
    monkeypatch.setattr(procs, "reap_children", lambda *args, **kwargs: None)
    nodes_clock, rng = Clock(), random.Random(seed)
    agents = []
    for i in range(nodes):
        (tmp_path / str(i)).mkdir()
        agent, client, _ = _agent(tmp_path / str(i), spread=rng.uniform, clock=nodes_clock)

        def paced(node_id: int, body: Heartbeat, client: ScriptedClient = client) -> HeartbeatReply:
            client.calls.append(f"heartbeat {node_id} {nodes_clock.now:.2f}")
            return HeartbeatReply(heartbeat_interval_s=told(nodes_clock.now))

        client.heartbeat = paced  # type: ignore[method-assign]
        agents.append((rng.uniform(0.0, 1.0), agent, client))
    for tick in range(ticks):
        nodes_clock.now = 100.0 + tick * tick_s
        for registers_at, agent, _ in agents:
            if nodes_clock.now - 100.0 >= registers_at:
                agent.step()
    seconds: Counter[int] = Counter()
    for _, _, client in agents:
        for call in client.calls:
            at = float(call.rsplit(" ", 1)[1]) if call.startswith("heartbeat") else 0.0
            if window[0] <= at < window[1]:
                seconds[int(at) % 10] += 1
    return seconds


def test_a_fleet_told_a_much_longer_interval_spreads_its_heartbeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nodes that registered within one second at 2 s, told 10 s at once (a controller's
    pace after many nodes joined, or one restarted): their heartbeats come spread over the
    ten seconds, not within the two of the old interval."""
    nodes = 20
    seconds = _fleet_phases(
        tmp_path,
        monkeypatch,
        nodes,
        seed=7,
        told=lambda now: 2.0 if now < 110.0 else 10.0,
        ticks=1200,
        tick_s=1 / 20,
        window=(130.0, math.inf),  # the last 30 s, at 10 s
    )
    assert sum(seconds.values()) == 3 * nodes
    # Spread evenly, each second would hold 6; kept in the old window, two would hold 60.
    assert max(seconds.values()) <= 18, sorted(seconds.items())


def test_a_fleet_whose_interval_grows_in_steps_spreads_its_heartbeats_evenly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pace grows in steps while a fleet registers (here 2 s, then 9 s, then 10 s):
    each node's heartbeats come at a uniform phase of the last interval, so no second of
    the ten holds many more than another. A first wait between the old interval and the
    new one kept most of the old phases: here one second of the ten held 20 heartbeats and
    another 240."""
    nodes = 100
    seconds = _fleet_phases(
        tmp_path,
        monkeypatch,
        nodes,
        seed=3,
        told=lambda now: 2.0 if now < 110.0 else 9.0 if now < 150.0 else 10.0,
        ticks=2000,
        tick_s=1 / 10,
        window=(200.0, 300.0),  # ten cycles at 10 s
    )
    assert sum(seconds.values()) == 10 * nodes
    # Evenly, each second of the ten would hold 100.
    assert min(seconds.values()) >= 50 and max(seconds.values()) <= 150, sorted(seconds.items())


def _heartbeats_sent_at(
    tmp_path: Path,
    failures: list[Exception],
    spread: Callable[[float, float], float] = _longest,
) -> list[float]:
    """When (seconds after registration) the agent sent its heartbeats, paced at 10 s by
    the first reply, with the next ones failing with ``failures`` in turn."""
    tmp_path.mkdir(exist_ok=True)
    agent, client, clock = _agent(tmp_path, spread)

    def paced(node_id: int, body: Heartbeat) -> HeartbeatReply:
        client.calls.append(f"heartbeat {node_id}")
        if client.heartbeat_failures:
            raise client.heartbeat_failures.pop(0)
        return HeartbeatReply(heartbeat_interval_s=10.0)

    client.heartbeat = paced  # type: ignore[method-assign]
    agent.step()
    agent.step()  # paced at 10 s from here
    client.heartbeat_failures = list(failures)
    return _sent_at(agent, client, clock, range(1, 400))


def _sent_at(agent: NodeAgent, client: ScriptedClient, clock: Clock, ticks: range) -> list[float]:
    """Step ``agent`` at each of ``ticks`` (tenths of a second after 100 s); when (seconds
    after 100) it sent a heartbeat."""
    sent_at = []
    for tick in ticks:
        clock.now = 100.0 + tick / 10 + 0.01
        before = client.calls.count("heartbeat 7")
        agent.step()
        if client.calls.count("heartbeat 7") > before:
            sent_at.append(round(clock.now - 100.0, 1))
    return sent_at


def test_a_failed_heartbeat_is_tried_again_sooner_than_a_long_pace(tmp_path: Path) -> None:
    """After the base interval registration gave (2 s), then twice that, up to the pace
    (10 s): a node at a long pace is not silent for two of its intervals after one
    failure, and a lost reply may have told it a shorter interval than it follows."""
    sent_at = _heartbeats_sent_at(tmp_path, [ControllerUnavailableError("down")] * 3)
    # 12: fails (the longest first wait at the pace: the old 2 s and the new 10 s), 14:
    # fails, 18: fails, 26: answered (8 s later, not 10), 36: at the pace
    assert sent_at[:5] == [12.0, 14.0, 18.0, 26.0, 36.0]


def test_a_failed_heartbeat_is_tried_again_after_a_random_half_to_whole_of_its_wait(
    tmp_path: Path,
) -> None:
    """Nodes that failed in one stall of the controller's do not all try again at once:
    here each waits the least, half of 2 s, 4 s and 8 s (and the first, after the pace of
    10 s was told, the old interval, 2 s)."""
    sent_at = _heartbeats_sent_at(tmp_path, [ControllerUnavailableError("down")] * 3, _least)
    # 2: fails, 3: fails, 5: fails, 9: answered, 19: at the pace
    assert sent_at[:5] == [2.0, 3.0, 5.0, 9.0, 19.0]


def test_a_shed_heartbeat_is_not_sent_again_before_its_retry_after(tmp_path: Path) -> None:
    """An overloaded controller sheds a heartbeat with 503 and Retry-After (it recorded the
    node as heard from): the next goes after that wait, not after the base interval; a
    wait longer than the pace leaves the paced schedule as it was."""
    shed = [
        ControllerUnavailableError("shed", 503, retry_after_s=5.0),
        ControllerUnavailableError("shed", 503, retry_after_s=30.0),
    ]
    # 12: shed, asks 5 s (not the 2 s base); 17: shed, asks 30 s: the pace (10 s) wins. With
    # the least spread the first goes 2 s after the pace was told, the old interval.
    for spread, expected in (
        (_longest, [12.0, 17.0, 27.0, 37.0]),
        (_least, [2.0, 7.0, 17.0, 27.0]),
    ):
        sent_at = _heartbeats_sent_at(tmp_path / spread.__name__, list(shed), spread)
        assert sent_at[:4] == expected, spread.__name__


class NewsyAttempt:
    """An attempt with something new to report at every report tick (no processes): each
    report is one log line, the last one its exit once ``exit`` is set."""

    def __init__(self) -> None:
        self.attempt_id = 5
        self.assignment = SimpleNamespace(job_id=1, attempt_id=5, member_id=9)
        self.exit: AttemptExit | None = None
        self.done = False
        self.launcher_pid = None
        self.unsent = 0  # lines not yet delivered

    def refresh(self) -> None:
        self.unsent += 1

    def poll(self) -> None: ...

    def stop(self, why: str) -> None: ...  # the scripted replies assign it nothing

    def running_info(self) -> RunningAttempt:
        return RunningAttempt(attempt_id=5, launcher_pid=None, processes=1)

    def ledger_entries(self) -> list[object]:
        return []

    def next_report(self, **_limits: object) -> SimpleNamespace | None:
        if self.done or not self.unsent:
            return None
        lines = [LogLine(time=datetime.now(UTC), stream="stdout", line="step")] * self.unsent
        report = AttemptReport(attempt_id=5, member_id=9, logs=lines, exit=self.exit)
        return SimpleNamespace(report=report)

    def delivered(self, pending: SimpleNamespace) -> None:
        self.unsent -= len(pending.report.logs)
        self.done = pending.report.exit is not None


def _newsy_agent(
    tmp_path: Path,
) -> tuple[NodeAgent, ScriptedClient, Clock, list[float], NewsyAttempt]:
    """An agent running a ``NewsyAttempt``, told by each heartbeat reply the interval in
    the returned list (registration's base one is 2 s)."""
    agent, client, clock = _agent(tmp_path)
    told = [2.0]

    def paced(node_id: int, body: Heartbeat) -> HeartbeatReply:
        client.calls.append(f"heartbeat {node_id}")
        return HeartbeatReply(heartbeat_interval_s=told[0])

    client.heartbeat = paced  # type: ignore[method-assign]
    attempt = NewsyAttempt()
    agent._attempts[attempt.attempt_id] = attempt  # type: ignore[assignment]
    agent.step()  # registers
    return agent, client, clock, told, attempt


def _reports_over(
    agent: NodeAgent, client: ScriptedClient, clock: Clock, seconds: float
) -> list[float]:
    """Step the agent every 50 ms for ``seconds``: when it sent a report, from the start."""
    start, sent_at = clock.now, []
    for tick in range(1, int(seconds * 20) + 1):
        clock.now = start + tick / 20
        before = client.calls.count("report")
        agent.step()
        if client.calls.count("report") > before:
            sent_at.append(round(clock.now - start, 2))
    return sent_at


def test_reports_follow_the_heartbeat_pace_and_an_exit_goes_at_once(tmp_path: Path) -> None:
    """At the base interval an attempt reports every report interval (0.5 s); paced at
    10 s, once per heartbeat interval, everything since in one go; its exit is not held
    back by the pace."""
    agent, client, clock, told, attempt = _newsy_agent(tmp_path)
    assert len(_reports_over(agent, client, clock, 10.0)) >= 19  # every 0.5 s
    told[0] = 10.0
    _reports_over(agent, client, clock, 10.0)  # the next heartbeat tells the pace
    sent = _reports_over(agent, client, clock, 30.0)
    assert len(sent) == 3 and sent[1] - sent[0] == sent[2] - sent[1] == 10.0
    clock.now += 0.5  # half a second after a paced report: the next is 9.5 s away
    attempt.exit = AttemptExit(outcome="succeeded", exit_code=0)
    assert len(_reports_over(agent, client, clock, 0.5)) == 1  # at the next report tick
    assert attempt.done and attempt.unsent == 0


def test_a_paced_report_that_failed_is_tried_again_sooner_backing_off(tmp_path: Path) -> None:
    """Not a whole interval later (what it carried is no older for a failure): after the
    report interval, then twice that and so on, up to the pace; then at the pace again."""
    agent, client, clock, told, _ = _newsy_agent(tmp_path)
    told[0] = 10.0
    _reports_over(agent, client, clock, 12.0)  # paced from the second heartbeat on
    sent = _reports_over(agent, client, clock, 10.0)
    assert len(sent) == 1
    failures = [ControllerUnavailableError("down")] * 3

    def failing_once(node_id: int, body: AttemptReport) -> ReportAccepted:
        client.calls.append("report")
        if failures:
            raise failures.pop(0)
        return ReportAccepted(accepted=True)

    client.report = failing_once  # type: ignore[method-assign]
    retried = _reports_over(agent, client, clock, 26.0)
    gaps = [round(later - earlier, 2) for earlier, later in pairwise(retried)]
    assert gaps[:4] == [0.5, 1.0, 2.0, 10.0]  # three failures, delivered, then the pace


def test_a_report_tick_a_little_early_against_the_last_delivery_still_delivers(
    tmp_path: Path,
) -> None:
    """The last delivery's time was read after a heartbeat of the same step, the next tick's
    without one: a few ms short of the interval. At the base interval every tick reports;
    at a pace, the tick nearest the interval does."""
    agent, _, clock, told, attempt = _newsy_agent(tmp_path)
    agent._drained_at[attempt.attempt_id] = clock.now
    assert agent._delivery_due(attempt, clock.now + 0.5 - 0.01)  # type: ignore[arg-type]
    assert not agent._delivery_due(attempt, clock.now + 0.2)  # type: ignore[arg-type]
    told[0] = 10.0
    _reports_over(agent, client=agent._client, clock=clock, seconds=3.0)  # type: ignore[arg-type]
    agent._drained_at[attempt.attempt_id] = clock.now
    assert agent._delivery_due(attempt, clock.now + 10.0 - 0.01)  # type: ignore[arg-type]
    assert not agent._delivery_due(attempt, clock.now + 9.5)  # type: ignore[arg-type]
