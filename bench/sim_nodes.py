"""Simulated node agents: the real node protocol over HTTP, no launcher and no torch.

Each ``SimNode`` does what ``worker.agent.NodeAgent`` does on the wire: it registers
with the enrolment token, heartbeats at the interval the controller gives it with the
attempts it runs, starts the attempts it is assigned and stops those no longer assigned,
and reports on them: the rendezvous of every node; from the node of group rank 0 the
training's start, its progress (with a log line) every few steps, one snapshot and its
finish; then every node's exit, ``succeeded``. A 409 on a report ends that run, as it
ends an agent's. Hundreds of them share one event loop; each has its HTTP client.

By default the fleet is a closed loop: a run's next step waits for its last report's
answer, and a node starts what it is given at once, so a controller that answers sooner is
sent more. ``Training.fixed_clock`` and a ``turns`` semaphore shared by the fleet make it
an open one (``--runs-at-once`` of the control-plane bench): steps keep their clock, and at
most so many runs train at once while the others wait their turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from contract.events import (
    LauncherExited,
    RendezvousComplete,
    SnapshotSaved,
    TrainingFinished,
    TrainingProgress,
    TrainingStarted,
    runtime_event,
)
from contract.protocol import (
    AttemptExit,
    AttemptReport,
    Heartbeat,
    HeartbeatReply,
    LogLine,
    NodeRegister,
    NodeRegistered,
    RunningAttempt,
)
from worker.agent import paced_wait

logger = logging.getLogger(__name__)

API = "/api/v1"
RunKey = tuple[int, int | None]  # (attempt id, membership id), as the agent keys a run


@dataclass(frozen=True)
class Training:
    """What a simulated attempt does: ``steps`` steps of ``step_s`` seconds, a progress
    report every ``progress_every`` steps, a snapshot half-way, after a rendezvous of
    ``rendezvous_s``."""

    steps: int = 20
    step_s: float = 0.5
    progress_every: int = 5
    rendezvous_s: float = 1.0
    snapshot_bytes: int = 256 * 2**20
    # Each step due at a fixed time from the run's start, however long the reports before
    # it took to be answered (a script's steps do not wait for its agent's reports); by
    # default a step starts once the report before it was answered.
    fixed_clock: bool = False
    # Each attempt's steps last ``step_s`` times a factor drawn for it from [1 - spread,
    # 1 + spread] (``step_s_of``), the same mean. Runs of one length that start together
    # end together, and the runs that take their turns start together again: with no
    # spread a fleet's runs stay in waves, every run's exit and the next runs' starts in
    # the same few seconds of each run's length, which no fleet of real jobs does.
    step_spread: float = 0.0

    def step_s_of(self, attempt_id: int) -> float:
        """The seconds of a step of ``attempt_id``: the same on every node of the attempt
        and in every run of the bench (drawn from the attempt's id)."""
        if not self.step_spread:
            return self.step_s
        factor = random.Random(attempt_id).uniform(1 - self.step_spread, 1 + self.step_spread)
        return self.step_s * factor


# What a registration waits for its answer by default: longer than the agents' 5 s, since
# the fleet's start is not what the control-plane bench measures. A try whose answer comes
# too late has registered the node all the same; the next try takes it back with the same
# registration key (without one: 409s until that node is lost).
REGISTER_TIMEOUT_S = 60.0


@dataclass
class Registrations:
    """How a fleet's registrations went, client side."""

    tries: int = 0
    refused: int = 0  # 409: the name is an ALIVE node's that this try could not take back
    timed_out: int = 0  # no answer: the try timed out, or its connection failed
    after_timeout: int = 0  # registered after a try of the same registration got no answer


@dataclass
class FleetStats:
    """What the nodes saw, client side."""

    # When each heartbeat and report was sent (``time.monotonic``), and its time (ms).
    heartbeat_sent: list[tuple[float, float]] = field(default_factory=list)
    report_sent: list[tuple[float, float]] = field(default_factory=list)
    # Of the heartbeats answered 200, those whose answer started a run the node did not
    # run yet (the controller makes them the long way: a transaction, worker tokens, a
    # first rendering), and the others.
    starting_ms: list[float] = field(default_factory=list)
    steady_ms: list[float] = field(default_factory=list)
    heartbeat_timeouts: int = 0
    # The longest heartbeat interval the controller told a node (its pace).
    interval_told_s_max: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    runs_started: int = 0
    # When each exit report of "succeeded" that the controller took was sent.
    run_ended: list[float] = field(default_factory=list)
    runs_fenced: int = 0
    runs_stopped: int = 0
    jobs_placed: set[int] = field(default_factory=set)
    running: int = 0  # runs under way now: the load the fleet offers follows it
    waiting: int = 0  # runs assigned that wait for their turn to train (``turns``)

    @property
    def runs_succeeded(self) -> int:
        return len(self.run_ended)

    @property
    def heartbeat_ms(self) -> list[float]:
        return [ms for _, ms in self.heartbeat_sent]

    @property
    def report_ms(self) -> list[float]:
        return [ms for _, ms in self.report_sent]

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def reset(self) -> None:
        """Forget everything seen so far: the measurement starts now (runs under way go
        on)."""
        kept = FleetStats(running=self.running, waiting=self.waiting)
        for name, value in vars(kept).items():
            setattr(self, name, value)


class Rendezvous:
    """Group ranks by order of arrival, per attempt: what torch's rendezvous hands out."""

    def __init__(self) -> None:
        self._arrived: dict[int, list[str]] = {}

    def join(self, attempt_id: int, node: str) -> None:
        self._arrived.setdefault(attempt_id, []).append(node)

    def rank(self, attempt_id: int, node: str) -> tuple[int, int]:
        """This node's group rank and the number of nodes in the round."""
        arrived = self._arrived.get(attempt_id, [node])
        return arrived.index(node), len(arrived)


class SimNode:
    def __init__(
        self,
        name: str,
        http: httpx.AsyncClient,
        enrolment_token: str,
        training: Training,
        rendezvous: Rendezvous,
        stats: FleetStats,
        turns: asyncio.Semaphore | None = None,
    ) -> None:
        """``turns``, shared by the fleet: how many of its runs may train at once; a run
        assigned beyond them waits (as one whose rendezvous is slow), still reported in
        the node's heartbeats. None: every run trains as soon as it is assigned."""
        self.name = name
        self._http = http
        self._enrolment_token = enrolment_token
        self._training = training
        self._rendezvous = rendezvous
        self._stats = stats
        self._turns = turns
        self._node_id = 0
        self._token = ""
        self._interval_s = 1.0
        self._base_interval_s = 1.0  # registration's
        # What the next heartbeat waits after this one: the interval, or after a change of
        # it what an agent waits (``worker.agent.paced_wait``).
        self._wait_s = 1.0
        # What each run has to report and when it may next send it (``_report``).
        self._held: dict[RunKey, tuple[list[Any], list[str]]] = {}
        self._next_report: dict[RunKey, float] = {}
        self._runs: dict[int, tuple[RunKey, asyncio.Task[None]]] = {}
        self._finished: set[RunKey] = set()
        self._closing = False

    async def register(
        self,
        tries: int = 120,
        timeout_s: float = REGISTER_TIMEOUT_S,
        with_key: bool = True,
        counts: Registrations | None = None,
    ) -> None:
        """Register, retrying a controller that does not answer, or that holds the name for
        a live node (409), as an agent does. Every try carries the same registration key
        (``with_key``, as agents do), so one after a try whose answer came too late takes
        the node back; without it, the name is free again only once that node is lost."""
        counts = counts if counts is not None else Registrations()
        key = secrets.token_urlsafe(32) if with_key else None
        body = NodeRegister(
            name=self.name, address="127.0.0.1", slots=1, pid=0, registration_key=key
        )
        timed_out = False
        for attempt in range(tries):
            counts.tries += 1
            try:
                response = await self._http.post(
                    f"{API}/nodes/register",
                    json=body.model_dump(mode="json"),
                    headers={"authorization": f"Bearer {self._enrolment_token}"},
                    timeout=timeout_s,
                )
                counts.refused += response.status_code == 409
                retry = response.status_code >= 500 or response.status_code == 409
                if not retry or attempt == tries - 1:
                    break
            except httpx.TransportError:
                counts.timed_out += 1
                timed_out = True
                if attempt == tries - 1:
                    raise
            await asyncio.sleep(1.0)
        response.raise_for_status()
        counts.after_timeout += timed_out
        registered = NodeRegistered.model_validate(response.json())
        self._node_id, self._token = registered.node_id, registered.node_token
        self._interval_s = self._base_interval_s = registered.heartbeat_interval_s

    async def serve(self, until: Callable[[], float]) -> None:
        """Heartbeat until ``until()`` (``time.monotonic``; it may move while this runs),
        then drop every run without a word, as a node that went away: the measurement ends
        there."""
        await asyncio.sleep(random.uniform(0, self._interval_s))  # spread the fleet out
        try:
            while time.monotonic() < until():
                sent = time.monotonic()
                self._wait_s = self._interval_s
                await self._heartbeat()
                await asyncio.sleep(max(0.0, sent + self._wait_s - time.monotonic()))
        finally:
            self._closing = True
            for _, task in self._runs.values():
                task.cancel()
            await asyncio.gather(*(t for _, t in self._runs.values()), return_exceptions=True)

    async def _heartbeat(self) -> None:
        running = [RunningAttempt(attempt_id=a, processes=1) for a in self._runs]
        sent, start = time.monotonic(), time.perf_counter()
        try:
            response = await self._http.post(
                f"{API}/nodes/{self._node_id}/heartbeat",
                json=Heartbeat(running=running).model_dump(mode="json"),
                headers=self._auth,
            )
        except httpx.TimeoutException as exc:
            # Unanswered within the agent's timeout: counted at what it waited, a lower bound.
            self._stats.heartbeat_sent.append((sent, (time.perf_counter() - start) * 1000))
            self._stats.heartbeat_timeouts += 1
            self._stats.error(f"heartbeat {type(exc).__name__}")
            return
        except httpx.HTTPError as exc:
            self._stats.error(f"heartbeat {type(exc).__name__}")
            return
        took_ms = (time.perf_counter() - start) * 1000
        self._stats.heartbeat_sent.append((sent, took_ms))
        if response.status_code != 200:
            self._stats.error(f"heartbeat {response.status_code}")
            return
        reply = HeartbeatReply.model_validate(response.json())
        told = reply.heartbeat_interval_s
        if told is not None:  # the controller's pace, followed as agents follow it
            self._stats.interval_told_s_max = max(self._stats.interval_told_s_max, told)
            if told != self._interval_s:
                self._wait_s = paced_wait(self._interval_s, told)
            self._interval_s = told
        wanted = {a.attempt_id for a in reply.assignments}
        for attempt_id in [a for a in self._runs if a not in wanted]:
            self._runs[attempt_id][1].cancel()  # no longer assigned: the run stops
        started = False
        for assignment in reply.assignments:
            key = (assignment.attempt_id, assignment.member_id)
            if assignment.attempt_id in self._runs or key in self._finished:
                continue
            started = True
            self._stats.runs_started += 1
            self._stats.jobs_placed.add(assignment.job_id)
            task = asyncio.create_task(self._run(key, assignment.active_members or 1))
            self._runs[assignment.attempt_id] = (key, task)
        (self._stats.starting_ms if started else self._stats.steady_ms).append(took_ms)

    @property
    def _auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._token}"}

    async def _run(self, key: RunKey, members: int) -> None:
        """One run of an attempt on this node, from rendezvous to exit."""
        attempt_id, _ = key
        try:
            async with self._turn():
                self._stats.running += 1
                try:
                    await self._train(key, members)
                finally:
                    self._stats.running -= 1
        except asyncio.CancelledError:
            if not self._closing:
                self._stats.runs_stopped += 1
                exit = AttemptExit(outcome="stopped", message="no longer assigned")
                await asyncio.shield(self._report(key, exit=exit))
            raise
        except _Fenced:
            self._stats.runs_fenced += 1
        finally:
            self._finished.add(key)
            self._runs.pop(attempt_id, None)
            self._held.pop(key, None)
            self._next_report.pop(key, None)

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """Hold one of the fleet's ``turns`` (none to hold: at once)."""
        if self._turns is None:
            yield
            return
        self._stats.waiting += 1
        try:
            await self._turns.acquire()
        finally:
            self._stats.waiting -= 1
        try:
            yield
        finally:
            self._turns.release()

    async def _train(self, key: RunKey, members: int) -> None:
        training, attempt_id = self._training, key[0]
        step_s = training.step_s_of(attempt_id)
        self._rendezvous.join(attempt_id, self.name)
        began = time.monotonic()
        done = 0  # steps done

        async def step_done(steps: int) -> None:
            """Until ``steps`` steps after the rendezvous are done: on the run's clock, or
            those not done yet from now."""
            nonlocal done
            if training.fixed_clock:
                due = began + training.rendezvous_s + steps * step_s
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            else:
                await asyncio.sleep((steps - done) * step_s)
            done = steps

        await asyncio.sleep(training.rendezvous_s)
        rank, nodes = self._rendezvous.rank(attempt_id, self.name)
        world = max(nodes, members)
        rdzv = RendezvousComplete(
            world_size=world, group_rank=rank, group_world_size=nodes, restart_count=0
        )
        if rank != 0:
            await self._report(key, events=[rdzv])
            await step_done(training.steps)
            await self._exit(key)
            return
        started = TrainingStarted(world_size=world, restart_count=0, total_steps=training.steps)
        await self._report(key, events=[rdzv, started], logs=["training started"])
        for step in range(1, training.steps + 1):
            await step_done(step)
            events: list[Any] = []
            if step % training.progress_every == 0:
                loss = 1.0 / step
                events.append(
                    TrainingProgress(
                        step=step,
                        loss=loss,
                        world_size=world,
                        step_time_s=step_s,
                        samples_per_s=64 / step_s,
                    )
                )
            if step == training.steps // 2:
                events.append(
                    SnapshotSaved(
                        step=step,
                        world_size=world,
                        path=f"/snapshots/attempt-{attempt_id}/step-{step}",
                        bytes=training.snapshot_bytes,
                        seconds=random.uniform(0.2, 2.0),
                    )
                )
            if events:
                await self._report(key, events=events, logs=[f"step {step}"])
        finished = TrainingFinished(step=training.steps, loss=1.0 / training.steps)
        launcher = LauncherExited(outcome="succeeded", exitcode=0)
        await self._report(key, events=[finished, launcher])
        await self._exit(key)

    async def _exit(self, key: RunKey) -> None:
        sent = time.monotonic()
        if await self._report(key, exit=AttemptExit(outcome="succeeded", exit_code=0)):
            self._stats.run_ended.append(sent)

    async def _report(
        self,
        key: RunKey,
        events: list[Any] | None = None,
        logs: list[str] | None = None,
        exit: AttemptExit | None = None,
    ) -> bool:
        """Send one report; retried on 503 (a lost compare-and-set), ``_Fenced`` on 409.
        Paced as an agent paces them (``worker.agent``), roughly: above the base heartbeat
        interval a run's events and lines are held and sent at most once per interval
        told, with its next report or its exit, which is not held. Unlike an agent it
        does not send what it holds on a timer, nor retry a report that failed."""
        held_events, held_logs = self._held.setdefault(key, ([], []))
        held_events += events or []
        held_logs += logs or []
        paced = self._interval_s > self._base_interval_s
        if exit is None and paced and time.monotonic() < self._next_report.get(key, 0.0):
            return True
        self._next_report[key] = time.monotonic() + self._interval_s
        events, logs = self._held.pop(key)
        if exit is not None:
            self._next_report.pop(key, None)
        now = datetime.now(UTC)
        report = AttemptReport(
            attempt_id=key[0],
            member_id=key[1],
            events=[runtime_event(e, now) for e in events or []],
            logs=[LogLine(time=now, line=line) for line in logs or []],
            exit=exit,
        )
        body = report.model_dump(mode="json")
        for _ in range(3):
            sent, start = time.monotonic(), time.perf_counter()
            try:
                response = await self._http.post(
                    f"{API}/nodes/{self._node_id}/reports", json=body, headers=self._auth
                )
            except httpx.HTTPError as exc:
                self._stats.error(f"report {type(exc).__name__}")
                return False
            self._stats.report_sent.append((sent, (time.perf_counter() - start) * 1000))
            if response.status_code == 200:
                return True
            if response.status_code == 409:
                if exit is not None:
                    return False  # the exit of a fenced run: forgotten, as an agent does
                raise _Fenced(response.text)
            self._stats.error(f"report {response.status_code}")
            if response.status_code != 503:
                return False
            await asyncio.sleep(1.0)
        return False


class _Fenced(Exception):
    """The controller answered 409: the attempt is over for this node."""
