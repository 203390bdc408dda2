"""The simulated fleet's open loop (``--runs-at-once``): turns shared by the fleet and steps
on a fixed clock, against a stand-in controller that answers the node protocol in-process."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from contextlib import AsyncExitStack

import httpx
import pytest

from bench.sim_nodes import FleetStats, Rendezvous, SimNode, Training
from contract.events import EventKind
from contract.protocol import HeartbeatReply, NodeRegistered
from tests.worker.helpers import an_assignment


class _Controller:
    """Registers node ``sim-N`` as node N and assigns it attempt N (job N) at every
    heartbeat; answers each report after ``report_delay_s``, noting when it came and what
    it carried."""

    def __init__(self, report_delay_s: float = 0.0) -> None:
        self.report_delay_s = report_delay_s
        # (attempt id, when it came, when it was answered, what it carried)
        self.reports: list[tuple[int, float, float, dict[str, object]]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/nodes/register"):
            node = int(json.loads(request.content)["name"].removeprefix("sim-"))
            registered = NodeRegistered(
                node_id=node, node_token=f"t{node}", heartbeat_interval_s=0.2
            )
            return httpx.Response(200, json=registered.model_dump(mode="json"))
        node = int(path.split("/")[-2])
        if path.endswith("/heartbeat"):
            reply = HeartbeatReply(
                assignments=[an_assignment(attempt_id=node, job_id=node)], heartbeat_interval_s=0.2
            )
            return httpx.Response(200, json=reply.model_dump(mode="json"))
        came = time.monotonic()
        await asyncio.sleep(self.report_delay_s)
        body = json.loads(request.content)
        self.reports.append((body["attempt_id"], came, time.monotonic(), body))
        return httpx.Response(200, json={})


async def _serve(
    controller: _Controller, training: Training, nodes: int, turns: asyncio.Semaphore | None
) -> tuple[FleetStats, list[int]]:
    """``nodes`` simulated nodes until each has finished its run; the runs waiting their
    turn, sampled every 20 ms."""
    stats, rendezvous = FleetStats(), Rendezvous()
    waiting: list[int] = []
    transport = httpx.MockTransport(controller)
    async with AsyncExitStack() as clients:
        fleet = [
            SimNode(
                f"sim-{i}",
                await clients.enter_async_context(
                    httpx.AsyncClient(transport=transport, base_url="http://controller")
                ),
                "enrol",
                training,
                rendezvous,
                stats,
                turns,
            )
            for i in range(1, nodes + 1)
        ]
        for node in fleet:
            await node.register()
        deadline = [time.monotonic() + 30.0]
        serving = [asyncio.create_task(node.serve(lambda: deadline[0])) for node in fleet]
        while stats.runs_succeeded < nodes and time.monotonic() < deadline[0]:
            waiting.append(stats.waiting)
            await asyncio.sleep(0.02)
        deadline[0] = 0.0
        await asyncio.gather(*serving)
    return stats, waiting


def test_runs_beyond_the_fleets_turns_wait_and_train_one_after_another() -> None:
    controller = _Controller()
    # Each run trains 0.8 s: every node is assigned its run (within 0.2 s of the start)
    # before the first one ends.
    training = Training(steps=4, step_s=0.2, progress_every=2, rendezvous_s=0.0)
    stats, waiting = asyncio.run(_serve(controller, training, 3, asyncio.Semaphore(1)))
    assert stats.runs_succeeded == 3 and stats.running == stats.waiting == 0
    assert max(waiting) == 2  # one run trains, the other two wait
    # Each run's reports, from its rendezvous to its exit, lie outside every other run's.
    spans: dict[int, tuple[float, float]] = {}
    for attempt, came, answered, _ in controller.reports:
        first, last = spans.get(attempt, (came, answered))
        spans[attempt] = (min(first, came), max(last, answered))
    assert sorted(spans) == [1, 2, 3]
    ordered = sorted(spans.values())
    assert all(earlier[1] <= later[0] for earlier, later in itertools.pairwise(ordered))


@pytest.mark.parametrize("fixed_clock", [False, True])
def test_on_a_fixed_clock_a_step_does_not_wait_out_a_slow_answer_as_well(
    fixed_clock: bool,
) -> None:
    # Steps of 0.4 s, reports answered after 0.5 s. Closed loop: a progress report is sent
    # a step after the last one was answered, at least 0.9 s after it was sent. On the
    # clock: the next one is already due when the last is answered, and is sent then.
    controller = _Controller(report_delay_s=0.5)
    training = Training(
        steps=3, step_s=0.4, progress_every=1, rendezvous_s=0.0, fixed_clock=fixed_clock
    )
    stats, _ = asyncio.run(_serve(controller, training, 1, None))
    assert stats.runs_succeeded == 1
    progress = [
        came
        for _, came, _, body in controller.reports
        if any(e["kind"] == EventKind.PROGRESS for e in body["events"])  # type: ignore[attr-defined]
    ]
    assert len(progress) == 3
    gaps = [later - earlier for earlier, later in itertools.pairwise(progress)]
    if fixed_clock:
        assert max(gaps) < 0.75, gaps  # the answer's 0.5 s, not the step's 0.4 s besides
    else:
        assert min(gaps) >= 0.9, gaps


def test_each_attempts_steps_last_a_length_of_its_own_the_same_in_every_run() -> None:
    training = Training(step_s=0.5, step_spread=0.5)
    lengths = [training.step_s_of(attempt) for attempt in range(1, 201)]
    assert lengths == [training.step_s_of(attempt) for attempt in range(1, 201)]  # drawn again
    assert all(0.25 <= length <= 0.75 for length in lengths)
    assert len({round(length, 3) for length in lengths}) > 150  # not a few lengths
    assert 0.45 < sum(lengths) / len(lengths) < 0.55  # the same mean
    assert Training(step_s=0.5).step_s_of(7) == 0.5  # no spread: every run alike


def test_runs_of_spread_lengths_report_and_keep_their_own_step_time() -> None:
    controller = _Controller()
    training = Training(
        steps=4, step_s=0.2, progress_every=1, rendezvous_s=0.0, fixed_clock=True, step_spread=0.9
    )
    stats, _ = asyncio.run(_serve(controller, training, 3, None))
    assert stats.runs_succeeded == 3
    told: dict[int, set[float]] = {}
    spans: dict[int, list[float]] = {}
    for attempt, came, _, body in controller.reports:
        spans.setdefault(attempt, []).append(came)
        for event in body["events"]:  # type: ignore[attr-defined]
            if event["kind"] == EventKind.PROGRESS:
                told.setdefault(attempt, set()).add(event["data"]["step_time_s"])
    assert told == {attempt: {training.step_s_of(attempt)} for attempt in (1, 2, 3)}
    # Each run lasts at least its own four steps, from its rendezvous's report to its
    # exit's, and the run of the longest steps lasts longest.
    lasted = {attempt: max(came) - min(came) for attempt, came in spans.items()}
    for attempt, seconds in lasted.items():
        assert seconds >= 4 * training.step_s_of(attempt) - 0.01, (attempt, seconds)
    assert max(lasted, key=lasted.__getitem__) == max((1, 2, 3), key=training.step_s_of)
