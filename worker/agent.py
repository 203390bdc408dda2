"""The node agent: registers with the controller and runs what it is told to run.

One loop on one thread owns everything (``NodeAgent.run``):

1. at start: become a child subreaper, kill what a previous life of this agent
   left behind (pid ledger), then register (retrying until the controller answers;
   a refused enrolment token ends the agent instead, since asking again cannot help),
   presenting the node token a previous life saved (``worker.node_token``): the
   name of a node that is still ALIVE is given back only to its token's holder.
   The registration offers the node's cores and GPUs (``worker.gpus``: found once,
   by ``run_agent``, before the loop starts);
2. every heartbeat interval: send the running attempts and the GPUs' use, receive
   the complete set of assignments, and reconcile: stop those no longer assigned, start
   those not running (``plan_reconcile`` decides, the loop acts), except one whose GPUs
   (or node) the workers of another attempt here still hold: it waits for a later
   heartbeat (``start_blocker``); end the workers
   of an attempt that lost a member, so they re-form at once
   (``Attempt.follow_membership``);
3. every report interval: settle exits, send new output and events, and the
   exit report once an attempt has ended; refresh the pid ledger;
4. with warm workers: keep one spare launcher (``worker.spare``) loaded, which the
   next attempt to start here becomes; one that dies is replaced. At start the spares
   a previous life left are ended, and at shutdown this life's.

A 404 on heartbeat makes the agent register again; a 409 on a report means the
attempt is over for this node (its job was cancelled, or it was fenced): it is
stopped, and only its exit is reported (a 409 on that too and it is forgotten).
On SIGTERM/SIGINT every attempt is stopped (SIGTERM, grace, SIGKILL) and
reported before ``run`` returns.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import FrameType

from contract.protocol import (
    CUDA_VISIBLE_DEVICES_ENV,
    Assignment,
    Heartbeat,
    NodeLeave,
    NodeRegister,
    StopReason,
)
from worker import gpus, node_token, procs, sandbox
from worker.attempt import Attempt, attempt_label, attempt_marker, spare_env, spare_marker
from worker.client import (
    ControllerClient,
    ControllerError,
    ControllerUnavailableError,
    EnrolmentRefusedError,
    FencedError,
    UnknownNodeError,
)
from worker.settings import AgentSettings
from worker.spare import (
    REGISTER_WAIT_FOR_SPARE_S,
    RESPAWN_AFTER_DEATH_S,
    RESPAWN_AFTER_HANDOFF_S,
    SpareLauncher,
)

logger = logging.getLogger(__name__)

MAX_LOGS_PER_REPORT = 2000
MAX_LOG_CHARS_PER_REPORT = 2 * 2**20
MAX_EVENTS_PER_REPORT = 1000
MAX_REPORTS_PER_TICK = 10
_REMEMBERED_FINISHED = 4096
_REGISTER_BACKOFF_MAX_S = 10.0
ALIVE_EVERY_S = 1.0
_DEFAULT_HEARTBEAT_S = 1.0


class Delivery(Enum):
    """How sending an attempt's reports went (``NodeAgent._deliver``)."""

    DRAINED = "drained"  # everything it had was delivered
    MORE = "more"  # delivered what one tick may, or stopped for another reason: more to say
    FAILED = "failed"  # the controller answered with an error of its own (5xx)
    UNREACHABLE = "unreachable"  # no answer: the other attempts do not try either


@dataclass(frozen=True)
class ReconcilePlan:
    start: tuple[Assignment, ...]
    stop: tuple[int, ...]


RunKey = tuple[int, int | None]  # (attempt id, membership id): one run of an attempt here


def run_key(assignment: Assignment) -> RunKey:
    return assignment.attempt_id, assignment.member_id


def plan_reconcile(
    desired: Iterable[Assignment],
    held: Collection[int],
    finished: Collection[RunKey],
    held_members: Mapping[int, int | None] | None = None,
) -> ReconcilePlan:
    """What to start and what to stop so that this node runs exactly ``desired``.

    ``held``: attempts the agent has (running, or ended with the exit report
    not yet delivered). ``finished``: runs (attempt and membership) whose exit was
    delivered or that were fenced; they are never started again, even if still
    assigned. A node that left an attempt and joined it again has a new membership,
    so it runs the attempt again, once its old run (``held_members``: the membership
    each held attempt runs for) is stopped: that one is stopped like an attempt no
    longer assigned, even if it thawed and still runs.
    """
    held_members = held_members or {}
    start: dict[int, Assignment] = {}
    wanted: set[int] = set()
    for assignment in desired:
        aid = assignment.attempt_id
        old = held_members.get(aid)
        if old is None or assignment.member_id is None or old == assignment.member_id:
            wanted.add(aid)
        if aid not in held and run_key(assignment) not in finished:
            start.setdefault(aid, assignment)
    stop = tuple(sorted(aid for aid in held if aid not in wanted))
    return ReconcilePlan(start=tuple(start.values()), stop=stop)


def start_blocker(
    assignment: Assignment, busy: Iterable[Assignment], node_has_gpus: bool
) -> Assignment | None:
    """The attempt whose workers ``assignment`` must wait for before it starts, or None.

    ``busy``: attempts this node holds whose workers may still run (running, or being
    stopped). The controller may give a GPU of an attempt that just ended here to a new
    one in the same reply; the new one waits until the old one's workers are gone. On a
    node with GPUs a CPU attempt takes the node whole: it waits for every busy attempt,
    and every attempt waits for a busy CPU one; a CUDA attempt waits for a busy CUDA
    attempt that has any of its GPUs. On a node without GPUs nothing waits.
    """
    if not node_has_gpus:
        return None
    for other in busy:
        if assignment.device == "cpu" or other.device == "cpu":
            return other
        if set(assignment.gpus) & set(other.gpus):
            return other
    return None


def paced_wait(
    old_s: float, new_s: float, spread: Callable[[float, float], float] = random.uniform
) -> float:
    """What a node told ``new_s`` instead of ``old_s`` waits before its next heartbeat
    (``NodeAgent._follow_pace``): lengthened, the old interval and a random time up to
    the new one (``spread``); shortened, the new interval."""
    return spread(old_s, old_s + new_s) if new_s > old_s else new_s


class NodeAgent:
    def __init__(
        self,
        settings: AgentSettings,
        client: ControllerClient,
        clock: Callable[[], float] = time.monotonic,
        inventory: gpus.GpuInventory | None = None,
        spread: Callable[[float, float], float] = random.uniform,
    ) -> None:
        """``spread(low, high)``: a random wait between the two (``_follow_pace``,
        ``_retry_heartbeat``)."""
        self._settings = settings
        self._client = client
        self._clock = clock
        self._spread = spread
        self._inventory = inventory if inventory is not None else gpus.GpuInventory()
        self._stop = threading.Event()
        self._attempts: dict[int, Attempt] = {}
        self._finished: deque[RunKey] = deque(maxlen=_REMEMBERED_FINISHED)
        self._deferred: set[RunKey] = set()  # assignments waiting for busy GPUs, logged once
        self._ledger = procs.PidLedger(settings.work_dir / "pids.json")
        self._node_id: int | None = None
        self._heartbeat_s = _DEFAULT_HEARTBEAT_S
        # The interval registration gave (the controller's base one), and the heartbeats
        # that failed in a row: a failed one is tried again after the base interval, then
        # twice that, up to the paced interval (``_retry_heartbeat``).
        self._base_heartbeat_s = _DEFAULT_HEARTBEAT_S
        self._heartbeats_failed = 0
        self._next_heartbeat = 0.0
        self._next_report = 0.0
        # When each attempt last had everything it had to say delivered, and when its
        # last delivery failed and how many failed in a row (``_delivery_due``).
        self._drained_at: dict[int, float] = {}
        self._failed: dict[int, tuple[float, int]] = {}
        self._next_register = 0.0
        self._next_alive = 0.0
        self._register_backoff_s = 0.5
        self._token_file = node_token.token_file(settings.work_dir)
        self._spare: SpareLauncher | None = None
        # A new agent waits for its spares before it registers; one the controller forgot
        # (it answered 404) registers again at once.
        self._registered_once = False
        # Sent with every registration of this agent's life: a try whose answer was lost
        # (registered, but the token never arrived) is taken back by the next try.
        self._registration_key = secrets.token_urlsafe(32)
        self._next_spare = 0.0

    @property
    def node_id(self) -> int | None:
        return self._node_id

    def request_stop(self) -> None:
        """Ask ``run`` to stop every attempt and return (safe from any thread)."""
        self._stop.set()

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT (main thread) or ``request_stop``; then stop all."""
        self._install_signal_handlers()
        sandbox.root_dir(self._settings.work_dir)  # jobs pass to their files, list nothing
        procs.become_subreaper()
        left = procs.kill_leftovers(
            self._ledger, self._settings.stop_grace_s, marker_of=self._marker_of
        )
        if left:
            logger.warning("node=%s killed %d leftover processes", self._settings.name, left)
        spares = procs.find_by_env(spare_marker(self._settings))
        if spares:
            procs.kill_all(spares, self._settings.stop_grace_s)
            logger.warning(
                "node=%s ended %d spare launcher(s) of a previous life", self._settings.name,
                len(spares),
            )  # fmt: skip
        logger.info(
            "node=%s agent pid %d serving, controller %s, isolation %s",
            self._settings.name,
            os.getpid(),
            self._settings.controller_url,
            self._settings.isolation,
        )
        try:
            while not self._stop.is_set():
                self._keep_spare(self._clock())  # first: it loads while the agent registers
                self.step()
                self._stop.wait(self._idle_s())
        finally:
            self._shutdown()

    def _marker_of(self, attempt_id: int) -> dict[str, str]:
        return attempt_marker(self._settings, attempt_id)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals go to the main thread; the caller uses request_stop()

        def _on_signal(signum: int, _frame: FrameType | None) -> None:
            logger.info("node=%s got %s, stopping", self._settings.name, signal.strsignal(signum))
            self._stop.set()

        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)

    def _idle_s(self) -> float:
        now = self._clock()
        due = min(self._next_heartbeat, self._next_report)
        return min(0.2, max(0.02, due - now))

    def step(self) -> None:
        """One pass of the loop; does what is due at ``clock()``."""
        now = self._clock()
        if self._node_id is None:
            warming = not self._registered_once and self._spare_loading(now)
            if now >= self._next_register and not warming:
                self._register(now)
        elif now >= self._next_heartbeat:
            self._next_heartbeat = now + self._heartbeat_s
            self._heartbeat()
        if now >= self._next_report:
            self._next_report = now + self._settings.report_interval_s
            self._report_all()
        if now >= self._next_alive:
            self._next_alive = now + ALIVE_EVERY_S
            self._mark_alive()

    def _spare_loading(self, now: float) -> bool:
        """Whether registration waits for the spare (launcher and zygote) to load: a node
        is offered warm, so that the attempt it is given at once starts without imports.
        Never longer than ``REGISTER_WAIT_FOR_SPARE_S`` from the spare's start."""
        spare = self._spare
        if spare is None or not spare.alive() or spare.ready():
            return False
        return now - spare.started_at < REGISTER_WAIT_FOR_SPARE_S

    def _keep_spare(self, now: float) -> None:
        """With warm workers and ``spare_launcher``, have one spare launcher: start one
        where there is none (or it died), once ``_next_spare`` has come. Only ``run`` keeps
        one: the thread that starts a spare must outlive it (its parent-death signal
        follows that thread)."""
        if not (self._settings.warm_workers and self._settings.spare_launcher):
            return
        spare = self._spare
        if spare is not None:
            if spare.alive():
                if not spare.logged and spare.ready():
                    spare.logged = True
                    rss = spare.rss_bytes()
                    logger.info(
                        "node=%s spare launcher pid %d loaded in %.1f s (%s MiB)",
                        self._settings.name, spare.pid, spare.ready_after_s,
                        "?" if rss is None else rss >> 20,
                    )  # fmt: skip
                return
            logger.warning(
                "node=%s spare launcher pid %d died (exit %s); another in %.0f s",
                self._settings.name, spare.pid, spare.proc.returncode, RESPAWN_AFTER_DEATH_S,
            )  # fmt: skip
            spare.stop()
            self._spare = None
            self._next_spare = now + RESPAWN_AFTER_DEATH_S
            return
        if now < self._next_spare:
            return
        try:
            self._spare = SpareLauncher.start(
                spare_env(self._settings, os.environ),
                sandbox.root_dir(self._settings.work_dir / "spare", 0o700),
            )
        except OSError as exc:
            logger.error("node=%s cannot start a spare launcher: %s", self._settings.name, exc)
            self._next_spare = now + RESPAWN_AFTER_DEATH_S

    def _take_spare(self) -> SpareLauncher | None:
        """The spare, for an attempt to start as; the next one comes a little later."""
        spare, self._spare = self._spare, None
        if spare is not None:
            self._next_spare = self._clock() + RESPAWN_AFTER_HANDOFF_S
        return spare

    def _mark_alive(self) -> None:
        """Show the loop turns, whether or not the controller answers (container health)."""
        try:
            self._settings.alive_file.touch()  # run() made the work dir
        except OSError as exc:
            logger.warning(
                "node=%s cannot touch %s: %s", self._settings.name, self._settings.alive_file, exc
            )

    def _register(self, now: float) -> None:
        body = NodeRegister(
            name=self._settings.name,
            address=self._settings.address,
            slots=self._settings.slots,
            pid=os.getpid(),
            node_token=node_token.load(self._token_file),
            registration_key=self._registration_key,
            gpus=list(self._inventory.gpus),
            gpu_driver=self._inventory.driver,
            cuda_version=self._inventory.cuda_version,
            cpus=self._settings.cpus,
        )
        try:
            reply = self._client.register(body)
        except EnrolmentRefusedError as exc:
            logger.error(
                "node=%s the controller at %s refused the enrolment token (%d: %s); "
                "RELAUNCH_AGENT_ENROLMENT_TOKEN must equal the controller's "
                "RELAUNCH_ENROLMENT_TOKEN. Not retrying: the agent exits",
                self._settings.name,
                self._settings.controller_url,
                exc.status_code,
                exc.detail,
            )
            raise
        except ControllerError as exc:
            if exc.status_code == 409:
                logger.warning(
                    "node=%s the controller holds this name for a node that is alive and "
                    "this agent does not hold its node token (%s in the work dir); retrying until "
                    "that node is lost or leaves",
                    self._settings.name,
                    node_token.FILE_NAME,
                )
            logger.warning(
                "node=%s register failed (retry in %.1fs): %s",
                self._settings.name,
                self._register_backoff_s,
                exc,
            )
            self._next_register = now + self._register_backoff_s
            self._register_backoff_s = min(2 * self._register_backoff_s, _REGISTER_BACKOFF_MAX_S)
            return
        try:
            node_token.save(self._token_file, reply.node_token)
        except OSError as exc:  # the node works; only a restart would wait for its old self
            logger.warning("node=%s cannot save its node token: %s", self._settings.name, exc)
        self._node_id = reply.node_id
        self._registered_once = True
        self._heartbeat_s = self._base_heartbeat_s = reply.heartbeat_interval_s
        self._heartbeats_failed = 0
        self._register_backoff_s = 0.5
        self._next_heartbeat = now
        logger.info(
            "node=%s registered as node %d (heartbeat every %.1fs)",
            self._settings.name,
            reply.node_id,
            reply.heartbeat_interval_s,
        )

    def _heartbeat(self) -> None:
        if self._node_id is None:
            return
        body = Heartbeat(
            running=[a.running_info() for a in self._attempts.values()],
            gpus=self._inventory.usage(),
        )
        try:
            reply = self._client.heartbeat(self._node_id, body)
        except UnknownNodeError:
            logger.warning("node=%s unknown to the controller; registering again", self._node_id)
            self._node_id = None
            self._next_register = 0.0
            return
        except ControllerError as exc:
            logger.warning("node=%s heartbeat failed: %s", self._node_id, exc)
            self._retry_heartbeat(
                exc.retry_after_s if isinstance(exc, ControllerUnavailableError) else 0.0
            )
            return
        self._heartbeats_failed = 0
        self._follow_pace(reply.heartbeat_interval_s)
        plan = plan_reconcile(
            reply.assignments,
            set(self._attempts),
            set(self._finished),
            {aid: a.assignment.member_id for aid, a in self._attempts.items()},
        )
        for aid in plan.stop:
            self._attempts[aid].stop("no longer assigned to this node")  # does not block
        self._deferred &= {run_key(a) for a in reply.assignments}
        for assignment in plan.start:
            if self._waits(assignment):
                continue
            attempt = Attempt(
                assignment, self._settings, self._client.node_token, self._inventory.indices
            )
            self._attempts[assignment.attempt_id] = attempt
            attempt.start(self._take_spare())
        for assignment in reply.assignments:
            held = self._attempts.get(assignment.attempt_id)
            if held is not None and held.assignment.member_id == assignment.member_id:
                held.follow_membership(assignment)  # does not block

    def _retry_heartbeat(self, retry_after_s: float = 0.0) -> None:
        """Send the next heartbeat after the base interval, then after twice that, and so
        on up to the paced one, each wait a random time between half of it and all of it
        (nodes whose heartbeats failed in one stall of the controller's then do not all
        try again in the same moment). A node at a long pace that waited a whole interval
        after a failure would have been silent for two; and a reply that was lost may have
        told it a shorter interval than it follows. Not sooner than the controller's
        ``Retry-After`` (``retry_after_s``): an overloaded controller that shed the
        heartbeat recorded the node as heard from, and asks for the pace."""
        self._heartbeats_failed += 1
        retry_s = self._base_heartbeat_s * 2 ** min(self._heartbeats_failed - 1, 16)
        retry_s = max(self._spread(retry_s / 2, retry_s), retry_after_s)
        if retry_s < self._heartbeat_s:
            self._next_heartbeat = min(self._next_heartbeat, self._clock() + retry_s)

    def _follow_pace(self, interval_s: float | None) -> None:
        """Follow the interval the reply gave: the controller lengthens it as the fleet
        grows (``service.heartbeats.Pace``). Lengthened, the next heartbeat goes after the
        old interval and a random time up to the new one, and the ones after it at the
        new one; shortened, after the new one. A node's phase in the new interval is then
        uniform, whatever it was before. Had each node kept its phase (the next one new
        interval after the last), the nodes told a much longer interval at about the same
        time would have kept the window of the old one: told 10 s instead of 1 s, a fleet
        would send all its heartbeats within the same second of every ten. A wait between
        the old interval and the new one still left the phases uneven when the interval
        grew in steps, as it does while a fleet registers (1,000 nodes sent 43 to 166
        heartbeats a second, in a cycle of ten). No wait is shorter than the old interval,
        so the fleet never heartbeats faster than the interval it was told before; the one
        after a lengthening may be up to the two intervals together, which the silence a
        node is allowed covers (``service.heartbeats.allowed_silence``)."""
        if interval_s is None or interval_s == self._heartbeat_s:
            return
        logger.info(
            "node=%s heartbeat every %.1fs from now (was %.1fs): the controller's pace",
            self._node_id,
            interval_s,
            self._heartbeat_s,
        )
        sent = self._next_heartbeat - self._heartbeat_s  # step() set it: sent + old
        self._next_heartbeat = sent + paced_wait(self._heartbeat_s, interval_s, self._spread)
        self._heartbeat_s = interval_s

    def _waits(self, assignment: Assignment) -> bool:
        """Whether ``assignment`` must wait (for a later heartbeat) for the workers of an
        attempt that holds its devices here (``start_blocker``); logged once per run."""
        busy = [a.assignment for a in self._attempts.values() if a.may_hold_devices]
        blocker = start_blocker(assignment, busy, bool(self._inventory.gpus))
        key = run_key(assignment)
        if blocker is None:
            self._deferred.discard(key)
            return False
        if key not in self._deferred:
            self._deferred.add(key)
            logger.info(
                "[%s] waits to start: the workers of [%s] still run on %s",
                attempt_label(assignment),
                attempt_label(blocker),
                f"GPU(s) {sorted(set(assignment.gpus) & set(blocker.gpus))}"
                if assignment.device == "cuda" and blocker.device == "cuda"
                else "this node, which a CPU attempt takes whole",
            )
        return True

    def _report_all(self) -> None:
        reachable = True
        now = self._clock()
        for attempt in list(self._attempts.values()):
            attempt.refresh()
            attempt.poll()
            if reachable and self._node_id is not None and self._delivery_due(attempt, now):
                delivery = self._deliver(attempt, self._node_id)
                reachable = delivery is not Delivery.UNREACHABLE
                self._note_delivery(attempt.attempt_id, delivery, now)
            if attempt.done:
                self._forget(attempt)
        self._ledger.write({aid: a.ledger_entries() for aid, a in self._attempts.items()})
        # This process owns no children but launchers; the rest are adopted orphans.
        launchers = {a.launcher_pid for a in self._attempts.values()}
        if self._spare is not None:
            launchers.add(self._spare.pid)
        procs.reap_children(exclude={pid for pid in launchers if pid is not None})

    def _report_every_s(self) -> float:
        """How often an attempt's output and events are sent: every report interval while
        the controller keeps the base heartbeat interval, else once per heartbeat
        interval it gave (its pace bounds the reports of a large fleet as it bounds the
        heartbeats). An exit is sent at once."""
        if self._heartbeat_s <= self._base_heartbeat_s:
            return self._settings.report_interval_s
        return max(self._settings.report_interval_s, self._heartbeat_s)

    def _delivery_due(self, attempt: Attempt, now: float) -> bool:
        """Whether ``attempt`` reports now: it has ended; or its last delivery failed and
        the report interval has passed since, doubling with each failure in a row up to
        the paced interval; or, else, a report interval (as paced now) has passed since
        all it had was delivered. One that left more to send goes on at the next tick."""
        every = self._report_every_s()
        if attempt.exit is not None:
            return True
        # Report ticks come every report interval, each a little late or early against the
        # last (a heartbeat sent in the same step delays the clock's read): half a tick
        # of slack, so that an interval of one tick is every tick.
        base = self._settings.report_interval_s
        slack = base / 2
        failed = self._failed.get(attempt.attempt_id)
        if failed is not None:
            failed_at, failures = failed
            return now - failed_at + slack >= min(every, base * 2 ** min(failures - 1, 16))
        drained_at = self._drained_at.get(attempt.attempt_id)
        return drained_at is None or now - drained_at + slack >= every

    def _note_delivery(self, attempt_id: int, delivery: Delivery, now: float) -> None:
        if delivery is Delivery.DRAINED:
            self._drained_at[attempt_id] = now
        if delivery in (Delivery.FAILED, Delivery.UNREACHABLE):
            _, failures = self._failed.get(attempt_id, (now, 0))
            self._failed[attempt_id] = (now, failures + 1)
        else:
            self._failed.pop(attempt_id, None)

    def _deliver(self, attempt: Attempt, node_id: int) -> Delivery:
        """Send what the attempt has to say, ``MAX_REPORTS_PER_TICK`` reports at most."""
        ctx = f"job={attempt.assignment.job_id} attempt={attempt.attempt_id}"
        for _ in range(MAX_REPORTS_PER_TICK):
            pending = attempt.next_report(
                max_logs=MAX_LOGS_PER_REPORT,
                max_log_chars=MAX_LOG_CHARS_PER_REPORT,
                max_events=MAX_EVENTS_PER_REPORT,
            )
            if pending is None:
                return Delivery.DRAINED
            try:
                self._client.report(node_id, pending.report)
            except FencedError as exc:
                if pending.report.exit is not None:
                    logger.warning("%s exit report refused (409); dropping it", ctx)
                    attempt.give_up_reporting()
                elif exc.reason is StopReason.CANCELLED:
                    logger.info("%s cancelled by its owner; stopping it", ctx)
                    attempt.fence("its job was cancelled")
                else:
                    logger.warning("%s fenced by the controller; stopping it", ctx)
                    attempt.fence()
                return Delivery.MORE  # only its exit, if any, is left to say
            except UnknownNodeError:
                logger.warning("%s node %s unknown; registering again", ctx, node_id)
                self._node_id = None
                self._next_register = 0.0
                return Delivery.MORE
            except ControllerUnavailableError as exc:
                logger.warning("%s report failed, will retry: %s", ctx, exc)
                return Delivery.UNREACHABLE
            except ControllerError as exc:
                if exc.status_code is None or exc.status_code >= 500:
                    logger.warning("%s report failed, will retry: %s", ctx, exc)
                    return Delivery.FAILED
                logger.error("%s report rejected, dropping the batch: %s", ctx, exc)
            attempt.delivered(pending)
        return Delivery.MORE

    def _forget(self, attempt: Attempt) -> None:
        del self._attempts[attempt.attempt_id]
        self._drained_at.pop(attempt.attempt_id, None)
        self._failed.pop(attempt.attempt_id, None)
        self._finished.append(run_key(attempt.assignment))

    def _leave(self, node_id: int) -> None:
        """Tell the controller this node is going, so its jobs re-form at once."""
        try:
            self._client.leave(node_id, NodeLeave())
        except ControllerError as exc:
            logger.warning(
                "node=%s could not say it is leaving (it will time out instead): %s",
                self._settings.name,
                exc,
            )

    def _shutdown(self) -> None:
        if self._spare is not None:
            self._spare.stop()
            self._spare = None
        attempts = list(self._attempts.values())
        for attempt in attempts:
            attempt.stop("the node agent is shutting down")
        for attempt in attempts:  # the grace periods run side by side
            attempt.wait_stopped()
        if self._node_id is not None:
            for attempt in attempts:
                self._deliver(attempt, self._node_id)
            self._leave(self._node_id)
        self._ledger.write(
            {a.attempt_id: a.ledger_entries() for a in attempts if a.ledger_entries()}
        )
        logger.info("node=%s agent stopped", self._settings.name)


def run_agent(settings: AgentSettings) -> int:
    """Run a node agent until SIGTERM/SIGINT (call from the main thread); the exit status.

    0 after a signal; 1 when the controller refused the enrolment token (the
    reason is logged), so that a restart policy, not this loop, decides whether to retry;
    1 too when the isolation cannot be had, or RELAUNCH_AGENT_GPUS names a GPU that
    NVML does not find (the reason is logged).
    """
    sandbox.forget_credentials()
    refusal = sandbox.start_refusal(settings.isolation, settings.job_uid_base, settings.work_dir)
    if refusal is not None:
        logger.error("node=%s cannot start: %s", settings.name, refusal)
        return 1
    inherited = os.environ.get(CUDA_VISIBLE_DEVICES_ENV)
    if inherited is not None and settings.gpus is None:
        logger.warning(
            "node=%s CUDA_VISIBLE_DEVICES=%s in the agent's environment limits nothing: NVML "
            "ignores it, and each attempt's workers get their own; offer fewer GPUs with "
            "RELAUNCH_AGENT_GPUS",
            settings.name,
            inherited,
        )
    try:
        inventory = gpus.GpuInventory.open(settings.gpus, gpus.load_nvml())
    except ValueError as exc:
        logger.error("node=%s cannot start: %s", settings.name, exc)
        return 1
    try:
        with ControllerClient(settings.controller_url, settings.token) as client:
            try:
                NodeAgent(settings, client, inventory=inventory).run()
            except EnrolmentRefusedError:
                return 1
    finally:
        inventory.close()
    return 0
