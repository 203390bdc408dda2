"""The per-attempt launcher: torch's elastic agent, run in-process, recording events.

Usage::

    python -m worker.launch --events-file F [--parent-pid P] [--node-token-file T] \
        -- <torchrun args>

It parses the torchrun arguments with torchrun's own parser and calls
``torch.distributed.run.run``. What the elastic agent decides is written to
``F`` as data (``contract.events`` JSON lines; one ``os.write`` per line
on an ``O_APPEND`` descriptor, so lines from several writers never interleave):

- RENDEZVOUS after every rendezvous round,
- WORKER_FAILED for each failed local worker when the monitor sees the group
  FAILED, with its cause (crash, hang, fatal exit code, start-up error),
- HANG for a worker that stopped making progress (see ``Supervision``),
- LAUNCHER_EXIT once at the end (exit status 0 on success, 1 on failure,
  128 + signal when stopped by a signal, 2 on bad arguments).

The events come from three wrapped methods of torch's elastic agent, in this
process only (see ``install_event_hooks``), which also apply relaunch's
restart policy: fatal failures end the launcher at once, restarts back off.

With ``--node-token-file`` it registers the rendezvous backend ``relaunch``
(``worker.rendezvous``), which keeps the rendezvous at the controller and calls
it with the node's token read from that file (and removes the file, before any
worker starts).

The launcher asks the kernel for SIGTERM when its parent (the node agent) dies;
torch's agent turns SIGTERM into an orderly stop of its workers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import psutil

from contract.events import (
    UNCHARGED_CAUSES,
    ColdStarted,
    HangDetected,
    LauncherExited,
    RendezvousComplete,
    WorkerFailed,
    ZygoteChanged,
)
from contract.labels import label_from_environ
from contract.logs import LOG_FORMAT
from contract.prctl import set_parent_death_signal
from contract.protocol import RENDEZVOUS_CLOSED_EXIT, RestartPolicy
from worker import warm
from worker.bootstrap import (
    STACK_DUMP_SIGNAL,
    error_says_peer_lost,
    returned_mark,
    teardown_mark,
)
from worker.hang import TEARDOWN_IDLE_S, BeatWatches, HangRule, HangTimeout, TeardownWatch
from worker.runtime.events import EventWriter
from worker.runtime.progress import progress_file
from worker.sandbox import WORKER_ERROR_DIR, WorkerSandbox, enter
from worker.warm import Zygote, discard_spare

logger = logging.getLogger(__name__)


def _context() -> str:
    """``[job 3 attempt 2 node node-a]``: the launcher's own lines have no rank."""
    return f"[{label_from_environ(os.environ, node=True) or 'launcher'}]"


# Set again by ``main``: a spare launcher (``worker.spare``) imported this module before
# it had the attempt's environment.
_CTX = _context()
_NO_ERROR_FILE = "<N/A>"  # torch's ProcessFailure.error_file when the worker wrote none
# An error file can hold a whole traceback; an event line must stay under
# events.MAX_LINE_BYTES to be appended atomically.
MAX_MESSAGE_CHARS = 1000


def failure_message(failure: Any) -> str:
    """A one-line reason from a torch ``ProcessFailure``, cut for display (``bounded``)."""
    return bounded(full_failure_message(failure))


def full_failure_message(failure: Any) -> str:
    """A torch ``ProcessFailure``'s whole reason, what failures are classified on.

    ``failure.message`` is the error file's message: a string, or a dict
    ``{"message": "Type: text", "extraInfo": {...}}`` written by ``@record``.
    Without an error file torch puts a documentation link there instead.
    """
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message") or str(message)
    if failure.error_file == _NO_ERROR_FILE and failure.exitcode > 0:
        return f"exited with code {failure.exitcode}"
    return str(message)


def bounded(text: str) -> str:
    """``text`` cut to ``MAX_MESSAGE_CHARS``, marked where it was cut."""
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


_HOOK_MARK = "_relaunch_event_hook"
# Exception types (from a worker's error file) that no restart can fix: the
# program cannot even start. ``EntrypointNotFound`` is worker.bootstrap's,
# ``DeviceShortage`` worker.runtime.devices' (fewer GPUs visible than local ranks).
STARTUP_ERRORS = (
    "ModuleNotFoundError",
    "ImportError",
    "SyntaxError",
    "IndentationError",
    "TabError",
    "EntrypointNotFound",
    "DeviceShortage",
)
# Error texts, of any exception type, that say this worker has no GPU of its own to
# use; a restart on the same node shows it no other, so they are start-up errors too.
# CUDA answers "invalid device ordinal" for a ``cuda:N`` beyond the visible devices (a
# program that picks its local rank where the node shows fewer GPUs), torch "No CUDA
# GPUs are available" where none is visible, NCCL "Duplicate GPU detected" where two
# ranks share one.
NO_DEVICE_MARKERS = (
    "CUDA error: invalid device ordinal",
    "No CUDA GPUs are available",
    "Duplicate GPU detected",
)
STACK_DUMP_WAIT_S = 1.0  # for faulthandler to write every thread's stack before SIGKILL


@dataclass
class Supervision:
    """What the launcher decides beyond torch's agent: fatal failures, back-off, hangs.

    One instance per launcher process, shared by the hooks. ``policy.max_restarts``
    is torch's own local budget; the job-wide budget is the controller's.
    """

    events: EventWriter
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    hang_rule: HangRule | None = None  # None: no hang detection
    progress_dir: Path | None = None
    clock: Callable[[], float] = time.time
    fatal: str | None = None  # why the launcher gave up without restarting
    back_off_next_restart: bool = False
    hung_pids: set[int] = field(default_factory=set)
    # Written by the node agent when it ends the workers because the attempt lost a
    # member (``worker.attempt.Attempt.follow_membership``); no worker can write it.
    membership_file: Path | None = None
    charged: bool = False  # whether the last failed group had a failure that costs a restart
    # The hung workers ended last were all that still ran here, and another node's
    # workers had all finished: their end is this node's finish, not a failure.
    ended_after_peers: bool = False
    # Whether this round's store counts this node as one whose workers have all begun
    # their teardown (``announce_teardown``).
    teardown_announced: bool = False
    beats: BeatWatches | None = field(init=False, default=None)
    # Workers in their teardown (by pid), judged by their CPU; those ended as stuck in it.
    teardowns: dict[int, TeardownWatch] = field(default_factory=dict)
    teardown_pids: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.hang_rule is not None:
            self.beats = BeatWatches(self.hang_rule)

    def membership_changed(self) -> bool:
        return self.membership_file is not None and self.membership_file.exists()

    def forget_membership_change(self) -> None:
        """A new round formed: a membership change noted before it is over."""
        if self.membership_file is not None:
            self.membership_file.unlink(missing_ok=True)

    def classify(self, failure: Any) -> tuple[str, bool]:
        """(cause, fatal) of one torch ``ProcessFailure``, the first rule that fits:

        Texts are read whole (``full_failure_message``), not as cut for the event.

        1. the node agent ended the workers for a lost member: ``membership_change``;
        2. this launcher ended it as hung: ``hang``;
        3. an exit code the job calls fatal: ``fatal_exit_code``, fatal;
        4. a start-up error (``STARTUP_ERRORS`` by type, ``NO_DEVICE_MARKERS`` by
           text): ``startup_error``, fatal;
        5. a collective that broke because a peer went away, gloo's or NCCL's
           (``worker.bootstrap.error_says_peer_lost``: an error of the types torch's
           collectives raise; a collective timeout or a local NCCL error is not one):
           ``peer_lost``, free;
        6. anything else, a signal included: ``crash``. NCCL's watchdog ends a process
           with SIGABRT where ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` tears it down (1, 3);
           no error file says why then, so that is a crash too.
        """
        if self.membership_changed():
            return "membership_change", False
        if failure.pid in self.hung_pids:
            return "hang", False
        if failure.exitcode in self.policy.fatal_exit_codes:
            return "fatal_exit_code", True
        message = full_failure_message(failure)  # a reason may come past the display's cut
        if message.split(":", 1)[0].strip() in STARTUP_ERRORS:
            return "startup_error", True
        if any(marker in message for marker in NO_DEVICE_MARKERS):
            return "startup_error", True
        if error_says_peer_lost(message):
            return "peer_lost", False
        return "crash", False

    def on_failed(self, failures: dict[int, Any]) -> bool:
        """Record each failed worker, first by time first; True if one is fatal.

        ``charged`` then says whether one of them costs a restart (not a membership
        change nor a lost peer)."""
        fatal = False
        self.charged = False
        for global_rank, failure in sorted(failures.items(), key=lambda kv: kv[1].timestamp):
            cause, is_fatal = self.classify(failure)
            self.charged = self.charged or cause not in UNCHARGED_CAUSES
            message = failure_message(failure)
            if is_fatal and self.fatal is None:
                self.fatal = f"{cause.replace('_', ' ')} on rank {global_rank}: {message}"
            fatal = fatal or is_fatal
            self.events.emit(
                WorkerFailed(
                    local_rank=failure.local_rank,
                    global_rank=global_rank,
                    exitcode=failure.exitcode,
                    message=message,
                    cause=cause,
                    fatal=is_fatal,
                )
            )
        self.hung_pids.clear()
        self.teardown_pids.clear()
        self.teardowns.clear()
        self.forget_membership_change()
        return fatal

    def clear_progress(self, local_ranks: Sequence[int]) -> None:
        """Forget the beats of a worker group that is about to be replaced."""
        for local_rank in local_ranks:
            if self.beats is not None:
                self.beats.forget(local_rank)
            if self.progress_dir is not None:
                with contextlib.suppress(FileNotFoundError):
                    progress_file(self.progress_dir, local_rank).unlink()

    def find_hung(
        self, workers: Sequence[Any], in_teardown: Collection[int] = ()
    ) -> list[tuple[Any, float, HangTimeout]]:
        """(worker, idle seconds, timeout) of each worker that beat once and then not for
        its timeout (``worker.hang``), of those not ``in_teardown`` (pids). Called at every
        monitor pass: it also records the beats it sees, which an adaptive timeout is
        derived from."""
        if self.beats is None or self.progress_dir is None:
            return []
        now = self.clock()
        hung = []
        for worker in workers:
            if worker.id in in_teardown:
                continue
            beat_at = self._beat_at(worker)
            if beat_at is None:
                continue  # no beat yet: still starting, or a program that never beats
            watch = self.beats.watch(worker.local_rank, worker.id)
            watch.observe(beat_at)
            timeout = watch.timeout()
            idle = now - beat_at
            if idle > timeout.seconds and worker.id not in self.hung_pids:
                hung.append((worker, idle, timeout))
        return hung

    def end_hung(
        self,
        all_workers: Sequence[Any],
        hung: list[tuple[Any, float, HangTimeout]],
        peers_finished: bool = False,
    ) -> None:
        """Dump every local worker's stacks into the logs, then SIGKILL the hung ones.

        The next monitor pass sees them failed; torch restarts the group and the
        failure is reported with cause "hang". With ``peers_finished`` (the hung
        workers are all that still ran here, and another node's workers had all
        finished), nothing restarts: that pass ends this node as finished
        (``finished_after_peers``).
        """
        self.ended_after_peers = peers_finished
        for worker, idle, timeout in hung:
            logger.error(
                "%s worker rank %s (local rank %s, pid %s) made no progress for %.1f s "
                "(hang timeout %s); dumping stacks and restarting",
                _CTX, worker.global_rank, worker.local_rank, worker.id, idle,
                timeout.derivation,
            )  # fmt: skip
            self.events.emit(
                HangDetected(
                    local_rank=worker.local_rank,
                    global_rank=worker.global_rank,
                    idle_s=round(idle, 1),
                    timeout_s=timeout.seconds,
                    rule=timeout.rule,
                    derivation=timeout.derivation[:300],
                    peers_finished=peers_finished,
                )
            )
        if self.beats is not None and any(t.rule == "adaptive" for _, _, t in hung):
            floor = self.beats.raise_floor()
            logger.warning(
                "%s the adaptive hang timeout of this launcher's next workers is at least "
                "%.0f s (a pause the script makes on purpose is allowed longer each time)",
                _CTX, floor,
            )  # fmt: skip
        # With ``peers_finished`` the node's other workers have exited (``_running_only``):
        # their pids are not signalled, as they may be another process's now.
        dumped = [worker for worker, _, _ in hung] if peers_finished else all_workers
        for worker in dumped:
            _signal(worker.id, STACK_DUMP_SIGNAL)
        time.sleep(STACK_DUMP_WAIT_S)
        for worker, _, _ in hung:
            self.hung_pids.add(worker.id)
            _signal(worker.id, signal.SIGKILL)

    def find_stuck_teardowns(
        self, workers: Sequence[Any], in_teardown: dict[int, str]
    ) -> list[tuple[Any, str]]:
        """(worker, how it was judged) of each worker in its teardown (``in_teardown``:
        pid to what began it) that its ``TeardownWatch`` finds stuck. Called at every
        monitor pass; a worker whose CPU time cannot be read is left alone."""
        for pid in list(self.teardowns):
            if pid not in in_teardown:
                del self.teardowns[pid]
        now = self.clock()
        stuck = []
        for worker in workers:
            what = in_teardown.get(worker.id)
            if what is None or worker.id in self.teardown_pids:
                continue
            try:
                times = psutil.Process(worker.id).cpu_times()
            except psutil.Error:
                continue
            watch = self.teardowns.setdefault(worker.id, TeardownWatch())
            if watch.observe(now, times.user + times.system, self._beat_at(worker)):
                stuck.append((worker, watch.derivation(what)))
        return stuck

    def _beat_at(self, worker: Any) -> float | None:
        """When ``worker`` last beat (its beat file's time); None if it never did."""
        if self.progress_dir is None:
            return None
        try:
            return progress_file(self.progress_dir, worker.local_rank).stat().st_mtime
        except FileNotFoundError:
            return None

    def end_stuck_teardowns(self, stuck: list[tuple[Any, str]]) -> None:
        """Dump the stacks of the workers stuck in their teardown into the logs, then
        SIGKILL them. Their work is done: the next monitor pass takes the group as finished
        (``ended_in_teardown``), with no restart. The node's other workers have exited
        (``_running_only``): their pids are not signalled, as they may be another's now."""
        for worker, derivation in stuck:
            logger.error(
                "%s worker rank %s (local rank %s, pid %s) is stuck in its teardown (it %s); "
                "dumping stacks and ending it as finished",
                _CTX, worker.global_rank, worker.local_rank, worker.id, derivation,
            )  # fmt: skip
            self.events.emit(
                HangDetected(
                    local_rank=worker.local_rank,
                    global_rank=worker.global_rank,
                    idle_s=TEARDOWN_IDLE_S,
                    timeout_s=TEARDOWN_IDLE_S,
                    rule="teardown",
                    derivation=derivation[:300],
                )
            )
        for worker, _ in stuck:
            _signal(worker.id, STACK_DUMP_SIGNAL)
        time.sleep(STACK_DUMP_WAIT_S)
        for worker, _ in stuck:
            self.teardown_pids.add(worker.id)
            _signal(worker.id, signal.SIGKILL)

    def ended_in_teardown(self, failures: dict[int, Any]) -> bool:
        """Whether this failed group is only workers ended as stuck in their teardown."""
        if not failures or any(f.pid not in self.teardown_pids for f in failures.values()):
            return False
        self.teardown_pids.clear()
        return True

    def finished_after_peers(self, failures: dict[int, Any]) -> bool:
        """Whether this failed group is only the hung workers ended after another node's
        workers had all finished (``end_hung``). Torch would restart the group, and its
        rendezvous could never form: the finished nodes wait in torch's exit barrier,
        not for a new round. A worker stuck in its teardown (a process group's
        destructor that waits for a thread) is one such case."""
        ended_after_peers, self.ended_after_peers = self.ended_after_peers, False
        if not ended_after_peers or not failures:
            return False
        if any(f.pid not in self.hung_pids for f in failures.values()):
            return False
        self.hung_pids.clear()
        ranks = ", ".join(str(rank) for rank in sorted(failures))
        logger.warning(
            "%s worker rank(s) %s ended as hung after another node's workers had all "
            "finished: this node finishes too, without a restart",
            _CTX,
            ranks,
        )
        return True


def _running_only(agent: Any, pids: Collection[int]) -> bool:
    """Whether the workers ``pids`` are all of the agent's local workers that still run
    (the others exited 0: a group with a failed one is not healthy)."""
    handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None)
    if not handlers:
        return False
    return all(
        handler.proc.pid in pids or handler.proc.poll() is not None for handler in handlers.values()
    )


def _own_marks(
    agent: Any, local_rank: int, pid: int, mark: Callable[[str, int], Path]
) -> list[Path]:
    """Where worker ``pid`` of ``local_rank`` writes a ``worker.bootstrap`` mark: beside
    torch's error file, or under isolation 'user' beside its own in the job-owned
    directory (``worker.sandbox``). None if it has no error file."""
    error_files = getattr(getattr(agent, "_pcontext", None), "error_files", None) or {}
    torch_path = error_files.get(local_rank)
    if not torch_path or torch_path == os.devnull:
        return []
    own = Path(torch_path).parent / WORKER_ERROR_DIR / Path(torch_path).name
    return [mark(path, pid) for path in (torch_path, str(own))]


def _marked(agent: Any, local_rank: int, pid: int, mark: Callable[[str, int], Path]) -> bool:
    return any(os.path.lexists(path) for path in _own_marks(agent, local_rank, pid, mark))


def in_teardown(agent: Any, workers: Sequence[Any]) -> dict[int, str]:
    """pid to what began it, of each worker that has begun its teardown: its program
    returned, or destroyed its default process group (``worker.bootstrap``'s marks)."""
    found = {}
    for worker in workers:
        if worker.id is None:
            continue
        if _marked(agent, worker.local_rank, worker.id, returned_mark):
            found[worker.id] = "its program returned"
        elif _marked(agent, worker.local_rank, worker.id, teardown_mark):
            found[worker.id] = "it destroyed its process group"
    return found


# A count in the round's store: the nodes whose workers have all begun their teardown.
TEARDOWN_NODES_KEY = "relaunch/nodes_in_teardown"


def announce_teardown(agent: Any, supervision: Supervision, in_teardown: bool) -> None:
    """Keep the round's store's count of nodes in their teardown right for this node:
    counted while every local worker has begun its teardown (its program returned, or it
    destroyed its default process group) or exited, so that the other nodes know its
    training is over even while a teardown takes long (gloo's can wait for a peer) and
    before its agent enters torch's exit barrier; taken back if a worker initialises a
    process group again. Best effort: a store that cannot be told leaves the other nodes
    to the exit barrier alone."""
    if in_teardown == supervision.teardown_announced:
        return
    try:
        agent._store.add(TEARDOWN_NODES_KEY, 1 if in_teardown else -1)
    except Exception as exc:  # a store gone
        logger.info("%s cannot tell the round whether this node is in its teardown: %s", _CTX, exc)
        return
    supervision.teardown_announced = in_teardown


def _peers_finished(agent: Any, supervision: Supervision) -> bool:
    """Whether another node of this round has finished its training: its agent entered
    torch's exit barrier, which it does once its workers have all exited 0
    (``SimpleElasticAgent._exit_barrier``: it adds 1 to a count in the round's store), or
    its workers have all begun their teardown (``announce_teardown``; this node's own
    announcement is not counted). False if the store cannot say."""
    try:
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
        from torch.distributed.elastic.utils.store import _NUM_MEMBERS

        store = agent._store
        if int(store.add(_TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS, 0)) > 0:
            return True
        return int(store.add(TEARDOWN_NODES_KEY, 0)) > int(supervision.teardown_announced)
    except Exception as exc:  # a torch without these names, or a store gone
        logger.info("%s cannot tell whether other nodes finished: %s", _CTX, exc)
        return False


def returned_before_signals(agent: Any, failures: dict[int, Any]) -> bool:
    """Whether every failed worker was ended by a signal after its program had returned
    and its interpreter had joined the program's threads and run its ``atexit`` handlers
    (``worker.bootstrap``'s mark, by the worker's own pid): a teardown that aborted
    (torch's gloo can, at exit), or torch ending the others once it saw that. Their work
    is done; the group is finished, not failed. A worker that exited with a status of
    its own, or had not got that far, fails the group as before."""
    if not failures:
        return False
    for failure in failures.values():
        if failure.exitcode >= 0:
            return False
        if not _marked(agent, failure.local_rank, failure.pid, returned_mark):
            return False
    for rank, failure in sorted(failures.items()):
        logger.warning(
            "%s worker rank %s (pid %s) ended by %s after its program returned and its "
            "interpreter ran its exit handlers: counted as finished",
            _CTX,
            rank,
            failure.pid,
            _signal_name(-failure.exitcode),
        )
    return True


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass
class WarmEvents:
    """Events of the warm zygote and of cold starts, for ``sandbox.enter``."""

    events: EventWriter

    def on_zygote(self, state: str, message: str, zygote: Zygote | None) -> None:
        logger.info("%s zygote %s: %s", _CTX, state, message)
        self.events.emit(
            ZygoteChanged(
                state=state,  # type: ignore[arg-type]
                pid=None if zygote is None else zygote.pid,
                import_s=None if zygote is None else zygote.import_s,
                rss_bytes=None if zygote is None or state != "ready" else zygote.rss_bytes(),
                message=bounded(message),
                spare=zygote is not None and zygote.spare and state == "ready",
                spare_passed_over=bounded(zygote.spare_passed_over or "")
                if zygote is not None
                else "",
            )
        )

    def on_cold(self, local_rank: int, reason: str) -> None:
        logger.warning("%s local rank %d starts cold: %s", _CTX, local_rank, reason)
        self.events.emit(ColdStarted(local_rank=local_rank, reason=bounded(reason)))


def _signal(pid: int | None, sig: int) -> None:
    """Signal a worker: a forked one through its pidfd (its zygote, not this launcher,
    decides when its pid is freed), a cold one (this launcher's child) by pid."""
    if pid is None:
        return
    forked = warm.forked(pid)
    if forked is not None:
        forked.send_signal(sig)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def install_event_hooks(supervision: Supervision) -> None:
    """Wrap three methods of ``LocalElasticAgent`` to record events and apply our policy.

    Seams (torch 2.13, ``torch/distributed/elastic/agent/server/``):

    - ``SimpleElasticAgent._rendezvous(worker_group)`` (api.py) fills
      ``worker_group`` with the round's ranks; it runs for the first round and
      for every restart (``_initialize_workers`` -> ``_rendezvous``), before the
      workers start. The restart count is computed as torch does for
      TORCHELASTIC_RESTART_COUNT: ``spec.max_restarts - agent._remaining_restarts``.
    - ``LocalElasticAgent._monitor_workers(worker_group)`` returns a
      ``RunResult``; on FAILED, ``failures`` maps *global* rank to a
      ``ProcessFailure`` (which carries ``local_rank`` and ``pid``). Torch has
      already terminated the siblings then. ``_invoke_run`` restarts the group
      while ``agent._remaining_restarts > 0``; a fatal failure sets it to 0, so
      torch stops the workers and the launcher exits failed. While HEALTHY,
      workers that stopped beating are ended (hang detection).
      A failed group whose every failure is free (``UNCHARGED_CAUSES``: a lost
      peer, a member dropped by the controller) gets back the local restart that
      ``_invoke_run`` is about to take, so that membership changes never exhaust
      torch's ``--max-restarts``: like the controller's, it counts failures only.
    - ``SimpleElasticAgent._restart_workers(worker_group)`` runs for failures
      and for membership changes alike; after a failure that costs a restart it
      first waits the back-off of the job's next restart.
    - Hung workers after the peers finished: ``agent._pcontext.subprocess_handlers``
      (each ``.proc`` polled) says which local workers still run, and the round's
      store (``agent._store``) counts the agents in ``_exit_barrier``
      (``_TERMINAL_STATE_SYNC_ID`` + ``_NUM_MEMBERS``, utils/store.py). A success
      handed back to ``_invoke_run`` has a return value per worker, as
      ``SimpleElasticAgent.run`` records one event per worker.

    The wrappers call the originals and return their results. Install once per
    process, before ``torch.distributed.run.run``.
    """
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original_rendezvous: Callable[..., None] = LocalElasticAgent._rendezvous
    original_monitor: Callable[..., Any] = LocalElasticAgent._monitor_workers
    original_restart: Callable[..., None] = LocalElasticAgent._restart_workers
    if getattr(original_monitor, _HOOK_MARK, False):
        raise RuntimeError("event hooks are already installed in this process")

    emit = supervision.events.emit  # logs and drops a failed write itself

    @functools.wraps(original_rendezvous)
    def _rendezvous(self: Any, worker_group: Any) -> None:
        original_rendezvous(self, worker_group)
        workers = worker_group.workers
        world_size = workers[0].world_size if workers else 0
        restart_count = worker_group.spec.max_restarts - self._remaining_restarts
        supervision.clear_progress([w.local_rank for w in workers])
        supervision.forget_membership_change()
        supervision.teardown_announced = False  # the new round's store has no count of ours
        logger.info(
            "%s rendezvous: group_rank=%s group_world_size=%s world_size=%s restart_count=%s",
            _CTX,
            worker_group.group_rank,
            worker_group.group_world_size,
            world_size,
            restart_count,
        )
        emit(
            RendezvousComplete(
                world_size=world_size,
                group_rank=worker_group.group_rank,
                group_world_size=worker_group.group_world_size,
                restart_count=restart_count,
            )
        )

    @functools.wraps(original_monitor)
    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        result = original_monitor(self, worker_group)
        if result.state == WorkerState.FAILED and (
            supervision.finished_after_peers(result.failures)
            or supervision.ended_in_teardown(result.failures)
            or returned_before_signals(self, result.failures)
        ):
            # Every worker a return value, as torch's own success has: its run() records
            # one event per worker and refuses a worker it cannot place.
            values = {worker.global_rank: None for worker in worker_group.workers}
            return RunResult(state=WorkerState.SUCCEEDED, return_values=values)
        if result.state == WorkerState.FAILED:
            if supervision.on_failed(result.failures):
                self._remaining_restarts = 0
            elif supervision.charged:
                supervision.back_off_next_restart = True
            else:
                self._remaining_restarts += 1  # _invoke_run takes it back: no restart spent
        elif result.state == WorkerState.HEALTHY:
            workers = worker_group.workers
            leaving = in_teardown(self, workers)
            announce_teardown(self, supervision, bool(leaving) and _running_only(self, leaving))
            stuck = supervision.find_stuck_teardowns(workers, leaving)
            # Stuck teardowns end only once every other local worker has exited or is
            # stuck too: a group with a worker still training would fail and restart.
            if stuck and _running_only(self, {worker.id for worker, _ in stuck}):
                supervision.end_stuck_teardowns(stuck)
                return result
            hung = supervision.find_hung(workers, in_teardown=leaving)
            if hung:
                hung_ids = {worker.id for worker, _, _ in hung}
                peers_finished = _running_only(self, hung_ids) and _peers_finished(
                    self, supervision
                )
                supervision.end_hung(workers, hung, peers_finished)
        return result

    @functools.wraps(original_restart)
    def _restart_workers(self: Any, worker_group: Any) -> None:
        if supervision.back_off_next_restart:
            supervision.back_off_next_restart = False
            local = worker_group.spec.max_restarts - self._remaining_restarts
            number = supervision.policy.restarts_before + local
            delay = supervision.policy.delay_s(number)
            if delay > 0:
                logger.info("%s restart %d of the job: backing off %.1f s", _CTX, number, delay)
                time.sleep(delay)
        original_restart(self, worker_group)

    setattr(_monitor_workers, _HOOK_MARK, True)
    LocalElasticAgent._rendezvous = _rendezvous  # type: ignore[method-assign]
    LocalElasticAgent._monitor_workers = _monitor_workers  # type: ignore[method-assign]
    LocalElasticAgent._restart_workers = _restart_workers  # type: ignore[method-assign]


def run_torchrun(
    torchrun_args: Sequence[str], supervision: Supervision | None = None
) -> tuple[Literal["succeeded", "failed", "closed"], int, str]:
    """Run torch's elastic launcher in this process; return (outcome, exit code, message)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.run import parse_args, run

    try:
        args = parse_args(list(torchrun_args))
    except SystemExit as exc:  # argparse reports and exits on bad arguments
        return "failed", 2, f"invalid torchrun arguments (argparse exit {exc.code})"

    def _raise_signal(signum: int, _frame: FrameType | None) -> None:
        raise SignalException(f"launcher got signal {signum}", sigval=signal.Signals(signum))

    # torch installs this kind of handler only when it starts workers; from
    # here on a SIGTERM during rendezvous also ends in an orderly LAUNCHER_EXIT.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_signal)
    try:
        run(args)
    except ChildFailedError as exc:
        if supervision is not None and supervision.fatal is not None:
            return "failed", 1, f"fatal: {supervision.fatal}"
        global_rank, failure = exc.get_first_failure()
        message = (
            f"rank {global_rank} (local rank {failure.local_rank}) failed: "
            f"{failure_message(failure)}"
        )
        return "failed", 1, message
    except SignalException as exc:
        return "failed", 128 + int(exc.sigval), f"stopped by signal {exc.sigval.name}"
    except RendezvousClosedError:
        return (
            "closed",
            RENDEZVOUS_CLOSED_EXIT,
            "the attempt's rendezvous had closed: another node's launcher ended first",
        )
    except Exception as exc:
        logger.exception("%s elastic launcher failed", _CTX)
        return "failed", 1, f"{type(exc).__name__}: {exc}"
    return "succeeded", 0, ""


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m worker.launch")
    parser.add_argument("--events-file", required=True)
    parser.add_argument(
        "--restart-policy",
        type=RestartPolicy.model_validate_json,
        default=RestartPolicy(),
        help="protocol.RestartPolicy as JSON",
    )
    parser.add_argument(
        "--hang-timeout-s",
        type=float,
        default=None,
        help="seconds without a progress beat after which a worker is hung (default: never)",
    )
    parser.add_argument(
        "--hang-timeout-adaptive",
        action="store_true",
        help="derive each worker's timeout from its beats (worker.hang), up to --hang-timeout-s",
    )
    parser.add_argument("--progress-dir", type=Path, default=None)
    parser.add_argument(
        "--membership-file",
        type=Path,
        default=None,
        help="present when the node agent ended the workers because the attempt lost a "
        "member: their ends are a membership change, not a failure",
    )
    parser.add_argument(
        "--node-token-file",
        type=Path,
        default=None,
        help="a file holding the node's token, for --rdzv-backend relaunch",
    )
    parser.add_argument(
        "--member-id",
        type=int,
        default=None,
        help="the node's membership of the attempt that this launcher runs for: rendezvous "
        "calls of a membership that has ended are refused",
    )
    parser.add_argument(
        "--sandbox",
        type=WorkerSandbox.model_validate_json,
        default=None,
        help="sandbox.WorkerSandbox as JSON: start the workers as the job's user, with "
        "the job's variables from its file",
    )
    parser.add_argument(
        "--warm-workers",
        action="store_true",
        help="with --sandbox: fork the workers from a zygote that has imported torch "
        "(worker.warm); a worker that cannot be forked starts cold, with an event",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit at once if the parent is no longer this pid (it died before we armed "
        "PR_SET_PDEATHSIG)",
    )
    argv = list(argv)
    if "--" not in argv:
        parser.error("torchrun arguments must follow '--'")
    split = argv.index("--")
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    global _CTX
    _CTX = _context()
    ns, torchrun_args = _parse(sys.argv[1:] if argv is None else argv)
    set_parent_death_signal(signal.SIGTERM)
    if ns.parent_pid is not None and os.getppid() != ns.parent_pid:
        logger.error("%s parent %s is gone before start; exiting", _CTX, ns.parent_pid)
        return 1
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    events = EventWriter(ns.events_file)
    supervision = Supervision(
        events=events,
        policy=ns.restart_policy,
        hang_rule=None
        if ns.hang_timeout_s is None
        else HangRule(ns.hang_timeout_s, adaptive=ns.hang_timeout_adaptive),
        progress_dir=ns.progress_dir,
        membership_file=ns.membership_file,
    )
    try:
        refusal = None
        if ns.sandbox is not None:
            warm = WarmEvents(events) if ns.warm_workers else None
            refusal = enter(ns.sandbox, warm)
        discard_spare()  # a spare launcher's zygote that this attempt's workers do not use
        if refusal is not None:
            logger.error("%s cannot start the workers: %s", _CTX, refusal)
            events.emit(
                LauncherExited(outcome="failed", exitcode=1, message=bounded(refusal), fatal=True)
            )
            return 1
        install_event_hooks(supervision)
        try:
            if ns.node_token_file is not None:
                from worker import rendezvous

                token = rendezvous.read_token_file(ns.node_token_file)
                rendezvous.register(token, ns.member_id)
            outcome, exitcode, message = run_torchrun(torchrun_args, supervision)
        except (OSError, ValueError) as exc:
            outcome, exitcode, message = "failed", 1, f"cannot read the node token: {exc}"
        events.emit(
            LauncherExited(
                outcome=outcome,
                exitcode=exitcode,
                message=bounded(message),
                fatal=supervision.fatal is not None,
            )
        )
        logger.info("%s launcher exit: %s (%s) %s", _CTX, outcome, exitcode, message)
    finally:
        events.close()
    return exitcode


if __name__ == "__main__":
    from worker.ending import run_then_exit

    run_then_exit(main)
