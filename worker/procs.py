"""Process-tree handling for the node agent (Linux only).

The elastic launcher starts every worker in a *new session*, so signalling the
launcher's process group does not reach the workers, and a launcher killed with
SIGKILL leaves them running with a new parent. Three things keep an attempt's
processes findable here:

- ``become_subreaper``: orphans of our descendants are re-parented to the agent
  (so they can be seen and reaped) instead of to init;
- an environment marker (attempt id, node name, agent work dir; see
  ``worker.attempt.attempt_marker``) that every process of an attempt
  inherits; ``find_by_env`` scans ``/proc`` for it;
- ``PidLedger``: pid + create time of every process seen, on disk, so that an
  agent restarted after a crash can kill what its previous life left behind.
  The create time guards against pid reuse.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from contract.prctl import PR_SET_CHILD_SUBREAPER, prctl

logger = logging.getLogger(__name__)

_POLL_S = 0.1
# psutil derives create_time from clock ticks since boot; equal within a boot.
_CREATE_TIME_TOLERANCE_S = 0.05


def become_subreaper() -> None:
    """Make orphaned descendants of this process re-parent to it instead of init."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


@dataclass(frozen=True)
class ProcessId:
    """A process identity that survives pid reuse: pid plus create time."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, proc: psutil.Process) -> ProcessId:
        return cls(proc.pid, proc.create_time())

    def resolve(self) -> psutil.Process | None:
        """The live process with this identity, or None if it is gone or the pid was reused."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > _CREATE_TIME_TOLERANCE_S:
                return None
        except psutil.Error:
            return None
        return proc if is_alive(proc) else None


def rss_bytes(pid: int) -> int | None:
    """The resident memory of process ``pid`` (from ``/proc/PID/statm``); None if gone."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def is_alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie holds no resources; its parent reaps it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def descendants(pid: int) -> list[psutil.Process]:
    """All live descendants of ``pid`` (empty if ``pid`` is gone)."""
    return descendants_of([pid])


def descendants_of(pids: Iterable[int]) -> list[psutil.Process]:
    """All live descendants of any of ``pids``, from one pass over the process table."""
    children: dict[int, list[psutil.Process]] = defaultdict(list)
    for proc in psutil.process_iter(["ppid"]):
        ppid = proc.info.get("ppid")
        if ppid is not None:
            children[ppid].append(proc)
    found: dict[int, psutil.Process] = {}
    stack = list(pids)
    while stack:
        for child in children.get(stack.pop(), []):
            if child.pid not in found:
                found[child.pid] = child
                stack.append(child.pid)
    return [p for p in found.values() if is_alive(p)]


def find_by_env(marker: Mapping[str, str]) -> list[psutil.Process]:
    """Live processes whose initial environment holds every ``name=value`` of ``marker``.

    This process is excluded; an empty marker matches nothing.
    """
    found: list[psutil.Process] = []
    if not marker:
        return found
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
            if all(env.get(k) == v for k, v in marker.items()) and is_alive(proc):
                found.append(proc)
        except psutil.Error:
            continue  # gone, a zombie, or not ours to read
    return found


def reap(procs: Iterable[psutil.Process]) -> dict[int, int | None]:
    """Reap those of ``procs`` that are dead children of this process; pid -> exit code."""
    codes: dict[int, int | None] = {}
    me = os.getpid()
    for proc in procs:
        try:
            if proc.ppid() != me or proc.status() != psutil.STATUS_ZOMBIE:
                continue
            codes[proc.pid] = proc.wait(timeout=0)
        except (psutil.Error, ChildProcessError):
            continue
    return codes


def reap_children(exclude: Collection[int] = ()) -> dict[int, int | None]:
    """Reap every dead child of this process except ``exclude`` (e.g. pids Popen waits for).

    A subreaper inherits orphans it never started; nobody else reaps them.
    """
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return {}
    return reap(p for p in children if p.pid not in exclude)


@dataclass
class KillOutcome:
    """What ``kill_tree`` left: ``left`` are pids still alive after SIGKILL."""

    left: list[int] = field(default_factory=list)
    exit_codes: dict[int, int | None] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.left


class _Tracker:
    """Processes of one tree, keyed by identity so a reused pid is never signalled."""

    def __init__(self, marker: Mapping[str, str] | None) -> None:
        self._marker = marker
        self.procs: dict[ProcessId, psutil.Process] = {}

    def add(self, procs: Iterable[psutil.Process]) -> None:
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                self.procs.setdefault(ProcessId.of(proc), proc)

    def refresh(self, *, scan_marker: bool) -> None:
        self.add(descendants_of(p.pid for p in self.alive()))
        if scan_marker and self._marker is not None:
            self.add(find_by_env(self._marker))

    def alive(self) -> list[psutil.Process]:
        return [p for p in self.procs.values() if is_alive(p)]


def _signal(procs: Iterable[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def kill_tree(
    root_pid: int,
    grace_s: float,
    *,
    marker: Mapping[str, str] | None = None,
    known: Iterable[psutil.Process] = (),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> KillOutcome:
    """End ``root_pid`` and everything descended from it; wait at most ~``grace_s`` + 3 s.

    SIGTERM goes to the root only, once (the elastic launcher then stops its
    workers itself; a second SIGTERM would cut its own shutdown short). Once
    the root is gone, what is left of the tree gets SIGTERM too. After
    ``grace_s`` every remaining process is SIGKILLed: descendants of the root,
    ``known`` ones (e.g. seen earlier, now re-parented), and, when ``marker``
    (env name -> value) is given, every process carrying it. Dead children of
    this process among them are reaped.
    """
    tracker = _Tracker(marker)
    roots: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        roots.append(psutil.Process(root_pid))
    tracker.add(roots)
    tracker.add(known)
    return _kill(tracker, roots, grace_s, clock=clock, sleep=sleep)


def kill_all(
    targets: Iterable[psutil.Process],
    grace_s: float,
    *,
    marker: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> KillOutcome:
    """Like ``kill_tree`` for unrelated processes: SIGTERM them all, then SIGKILL what is left."""
    tracker = _Tracker(marker)
    tracker.add(targets)
    return _kill(tracker, tracker.alive(), grace_s, clock=clock, sleep=sleep)


def _kill(
    tracker: _Tracker,
    first: list[psutil.Process],
    grace_s: float,
    *,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> KillOutcome:
    outcome = KillOutcome()
    tracker.refresh(scan_marker=True)
    _signal(first, signal.SIGTERM)
    termed = {ProcessId.of(p) for p in first if is_alive(p)}
    deadline = clock() + grace_s
    while clock() < deadline:
        tracker.refresh(scan_marker=False)
        alive = tracker.alive()
        if not alive:
            break
        if not any(is_alive(p) for p in first):
            stray = [p for p in alive if ProcessId.of(p) not in termed]
            _signal(stray, signal.SIGTERM)
            termed.update(ProcessId.of(p) for p in stray)
        outcome.exit_codes.update(reap(tracker.procs.values()))
        sleep(_POLL_S)

    for _ in range(3):
        tracker.refresh(scan_marker=True)
        alive = tracker.alive()
        if not alive:
            break
        logger.warning("SIGKILL %d processes: %s", len(alive), [p.pid for p in alive])
        _signal(alive, signal.SIGKILL)
        gone, _ = psutil.wait_procs(alive, timeout=1.0)
        # wait_procs reaps our own children and leaves their status in .returncode
        outcome.exit_codes.update({p.pid: getattr(p, "returncode", None) for p in gone})
    outcome.exit_codes.update(reap(tracker.procs.values()))
    outcome.left = sorted(p.pid for p in tracker.alive())
    return outcome


class PidLedger:
    """A JSON file of the processes each attempt had, rewritten atomically.

    Format: ``{"attempts": {"<attempt_id>": [{"pid": int, "create_time": float}]}}``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last: str | None = None

    def write(self, attempts: dict[int, list[ProcessId]]) -> None:
        doc = {
            "attempts": {
                str(aid): [{"pid": p.pid, "create_time": p.create_time} for p in procs]
                for aid, procs in sorted(attempts.items())
            }
        }
        text = json.dumps(doc, sort_keys=True)
        if text == self._last:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        # The agent's own: no job's user may read which processes it tracks.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(text)
        os.replace(tmp, self.path)
        self._last = text

    def read(self) -> dict[int, list[ProcessId]]:
        try:
            doc = json.loads(self.path.read_text())
            return {
                int(aid): [ProcessId(int(e["pid"]), float(e["create_time"])) for e in entries]
                for aid, entries in doc["attempts"].items()
            }
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("ignoring unreadable pid ledger %s: %s", self.path, exc)
            return {}


def kill_leftovers(
    ledger: PidLedger,
    grace_s: float,
    *,
    marker_of: Callable[[int], Mapping[str, str]] | None = None,
) -> int:
    """Kill the processes a previous life of the agent recorded; return how many were alive.

    ``marker_of(attempt_id)``, when given, names the environment an attempt's
    processes carry; those are killed too, which catches workers started after
    the last ledger write. The ledger is emptied afterwards.
    """
    entries = ledger.read()
    found = 0
    for attempt_id, ids in entries.items():
        marker = marker_of(attempt_id) if marker_of is not None else None
        found_here = [p for p in (i.resolve() for i in ids) if p is not None]
        if marker is not None:
            found_here.extend(find_by_env(marker))
        procs = list({p.pid: p for p in found_here}.values())
        if not procs:
            continue
        found += len(procs)
        logger.warning(
            "attempt=%s: killing %d processes left by a previous agent", attempt_id, len(procs)
        )
        outcome = kill_all(procs, grace_s, marker=marker)
        if not outcome.clean:
            logger.error("attempt=%s: processes survive SIGKILL: %s", attempt_id, outcome.left)
    ledger.write({})
    return found
