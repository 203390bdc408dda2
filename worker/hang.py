"""How long a worker may go without a progress beat: a fixed timeout, or one derived
from the worker's own rhythm.

The launcher looks at every worker's beat file (``worker.runtime.progress``) at each
monitor pass. ``BeatWatch`` keeps, per worker process, the intervals between the beats
it saw (from the file's modification times) and answers the timeout in force now:

- ``fixed`` (the spec gave a number): that number, always;
- ``adaptive`` (``hang_timeout_s: auto``, the default): before ``MIN_INTERVALS``
  intervals are known, the cap (``HangRule.timeout_s``: 600 s, as the controller sends
  it), since the first steps (compilation, a DataLoader's start, the first collective)
  say nothing about the rhythm; after that
  ``max(FLOOR_S, FACTOR x median interval, 2 x longest interval)``, never above the
  cap. With sub-second steps that is the floor, 30 s.

The longest interval counts so that a pause the worker already survived (an
evaluation, a snapshot written in the foreground) never becomes a hang when it comes
back, even a little longer. A pause longer than the timeout before it was ever seen
is a hang by this rule: a script that pauses for long should call
``worker.runtime.progress.beat()`` during the pause, or set ``hang_timeout_s``.

A hang found by the adaptive rule doubles the floor for this launcher's later workers
(``BeatWatches.raise_floor``): a pause that is part of the script (rank 0 evaluating or
saving while the others wait, before any such pause was seen) costs one restart, and
the next time the same pause is allowed twice as long, up to the cap; a real hang is
still found, a little later each time.

A worker that has begun its teardown (it destroyed its default process group, or its
program returned: ``worker.bootstrap``'s marks) trains no more, and its beats say
nothing. ``TeardownWatch`` judges it instead: one that has used less than
``TEARDOWN_CPU_SHARE`` of a core over the last ``TEARDOWN_IDLE_S`` is stuck in its
teardown (a process group's destructor waiting for a thread or a peer, which torch's
gloo can do at exit). Work after the teardown began (a final save, an upload in an
``atexit`` handler) uses CPU and is left alone, and so is a worker that beats; a
teardown that spins is not found.

The launcher sees beats only at its monitor passes (every 0.2 s), so several beats
between two passes count as one interval: with very short steps the median is the
pass interval, and the floor decides. A new worker process (a restart, a new
rendezvous round) starts a new watch: a new world size may step at another speed.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Literal

FLOOR_S = 30.0  # the least an adaptive timeout is
FACTOR = 10.0  # times the median interval between beats
MIN_INTERVALS = 5  # intervals seen before the rhythm is trusted
WINDOW = 64  # the most recent intervals the median is taken over
LONGEST_FACTOR = 2.0  # times the longest interval seen
TEARDOWN_IDLE_S = 30.0  # the window over which a worker in its teardown is judged
TEARDOWN_CPU_SHARE = 0.01  # of one core: less than this over the window is stuck


@dataclass(frozen=True)
class HangRule:
    """What a job asked for: a fixed ``timeout_s``, or an adaptive one up to ``timeout_s``.

    Holds ``timeout_s > 0``; for an adaptive rule ``floor_s <= timeout_s`` is not
    required (a cap below the floor wins: the timeout never passes the cap).
    """

    timeout_s: float
    adaptive: bool = False
    floor_s: float = FLOOR_S
    factor: float = FACTOR
    min_intervals: int = MIN_INTERVALS

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"a hang timeout must be > 0 s, got {self.timeout_s}")


@dataclass(frozen=True)
class HangTimeout:
    """The timeout in force for one worker, and how it was reached, in words."""

    seconds: float
    rule: Literal["fixed", "adaptive"]
    derivation: str


@dataclass
class BeatWatch:
    """The beats one worker process made, as seen at the launcher's passes.

    ``observe(mtime)`` takes the beat file's modification time at each pass; an
    unchanged or older time adds nothing.
    """

    rule: HangRule
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    longest_s: float = 0.0
    last_beat: float | None = None

    def observe(self, beat_at: float) -> None:
        if self.last_beat is not None and beat_at > self.last_beat:
            interval = beat_at - self.last_beat
            self.intervals.append(interval)
            self.longest_s = max(self.longest_s, interval)
        if self.last_beat is None or beat_at > self.last_beat:
            self.last_beat = beat_at

    def timeout(self) -> HangTimeout:
        rule = self.rule
        if not rule.adaptive:
            return HangTimeout(rule.timeout_s, "fixed", f"hang_timeout_s {rule.timeout_s:g} s")
        seen = len(self.intervals)
        if seen < rule.min_intervals:
            return HangTimeout(
                rule.timeout_s,
                "adaptive",
                f"the cap {rule.timeout_s:g} s: {seen} beat intervals seen, "
                f"fewer than {rule.min_intervals}",
            )
        median = statistics.median(self.intervals)
        derived = max(rule.floor_s, rule.factor * median, LONGEST_FACTOR * self.longest_s)
        seconds = round(min(rule.timeout_s, derived), 1)
        return HangTimeout(
            seconds,
            "adaptive",
            f"{seconds:g} s = max(floor {rule.floor_s:g} s, {rule.factor:g} x median beat "
            f"interval {median:.3g} s, {LONGEST_FACTOR:g} x longest {self.longest_s:.3g} s), "
            f"at most {rule.timeout_s:g} s; over the last {seen} beat intervals",
        )


class BeatWatches:
    """One ``BeatWatch`` per local rank, for the worker process that holds it now."""

    def __init__(self, rule: HangRule) -> None:
        self.rule = rule
        self._watches: dict[int, tuple[int | None, BeatWatch]] = {}

    def watch(self, local_rank: int, pid: int | None) -> BeatWatch:
        """The watch of ``local_rank``'s current process; a new process starts afresh."""
        held = self._watches.get(local_rank)
        if held is None or held[0] != pid:
            held = (pid, BeatWatch(self.rule))
            self._watches[local_rank] = held
        return held[1]

    def forget(self, local_rank: int) -> None:
        self._watches.pop(local_rank, None)

    def raise_floor(self) -> float:
        """After a hang found by the adaptive rule: double the floor of the watches of
        worker processes started from now on, never above the cap. The new floor."""
        rule = self.rule
        if rule.adaptive:
            self.rule = replace(rule, floor_s=min(rule.timeout_s, 2 * rule.floor_s))
        return self.rule.floor_s


@dataclass
class TeardownWatch:
    """The CPU time one worker process in its teardown has used, as seen at the
    launcher's passes: ``observe(now, cpu_s)`` answers whether it is stuck, that is,
    whether over the last ``idle_s`` or more it used less than ``cpu_share`` of a core.
    The window starts at the first pass that saw the process in its teardown."""

    idle_s: float = TEARDOWN_IDLE_S
    cpu_share: float = TEARDOWN_CPU_SHARE
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    last_beat: float | None = None

    def observe(self, now: float, cpu_s: float, beat_at: float | None = None) -> bool:
        """``beat_at``: the worker's last progress beat, if any. A beat newer than the last
        one seen starts the window again: a script that waits on purpose after its teardown
        began (to initialise a new group, say) beats to say so."""
        if beat_at is not None and (self.last_beat is None or beat_at > self.last_beat):
            if self.last_beat is not None:
                self.samples.clear()
            self.last_beat = beat_at
        self.samples.append((now, cpu_s))
        # Keep one sample at least ``idle_s`` old, the newest such: the window's start.
        while len(self.samples) > 1 and now - self.samples[1][0] >= self.idle_s:
            self.samples.popleft()
        start, start_cpu = self.samples[0]
        window = now - start
        return window >= self.idle_s and cpu_s - start_cpu < self.cpu_share * window

    def derivation(self, what: str) -> str:
        return f"used less than {self.cpu_share:.0%} of a core for {self.idle_s:g} s after {what}"
