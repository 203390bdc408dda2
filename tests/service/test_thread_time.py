"""A thread's wall time split by what the scheduler says it did (``service.thread_time``)."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.synchronize
import os
import re
import threading
import time
from pathlib import Path

import pytest

from service.reconciler import _PhaseTimer
from service.thread_time import SpanClock, Split, schedstat_of, waited_for_cpu

linux_only = pytest.mark.skipif(
    not schedstat_of(threading.get_native_id()).exists(), reason="the kernel keeps no schedstat"
)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _burn(cpu_seconds: float) -> None:
    """Spin until this thread has had ``cpu_seconds`` on a CPU, however busy the machine."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def _spin_on(cpu: int, started: multiprocessing.synchronize.Event) -> None:
    os.sched_setaffinity(0, {cpu})
    started.set()
    _spin(30.0)


@linux_only
def test_a_busy_span_is_running_and_a_sleeping_one_blocked() -> None:
    busy = SpanClock()
    _burn(0.3)
    worked = busy.split()
    asleep = SpanClock()
    time.sleep(0.3)
    slept = asleep.split()
    assert worked is not None and slept is not None
    assert worked.running > worked.blocked
    assert slept.blocked > 0.25
    assert slept.running < 0.05


@linux_only
def test_a_thread_that_shares_its_cpu_with_a_busy_process_waits_for_it() -> None:
    """Pinned to one CPU beside a process that spins there, the thread is ready to run
    for part of the time it spins itself, and the kernel counts that as runnable."""
    cpu = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    started = multiprocessing.get_context("spawn").Event()
    rival = multiprocessing.get_context("spawn").Process(target=_spin_on, args=(cpu, started))
    rival.start()
    try:
        assert started.wait(30)
        os.sched_setaffinity(0, {cpu})
        clock = SpanClock()
        _spin(1.0)
        split = clock.split()
    finally:
        os.sched_setaffinity(0, mine)
        rival.kill()
        rival.join()
    assert split is not None
    assert split.runnable > 0.1, split
    assert split.running + split.runnable + split.blocked == pytest.approx(1.0, abs=0.1)


def test_no_figures_where_the_kernel_does_not_say(tmp_path: Path) -> None:
    me = threading.get_native_id()
    stat = schedstat_of(me, tmp_path)
    assert waited_for_cpu(stat) is None  # no such file
    stat.parent.mkdir()
    stat.write_text("not numbers\n")
    assert waited_for_cpu(stat) is None
    stat.write_text("0 0 0\n")  # a kernel that keeps no counts
    assert waited_for_cpu(stat) is None
    stat.write_text("1000 2000000000 3\n")
    assert waited_for_cpu(stat) == 2.0
    assert SpanClock(tmp_path / "none").split() is None
    # Figures at the start but none at the end split nothing.
    clock = SpanClock(tmp_path)
    stat.write_text("")
    assert clock.split() is None


@linux_only
def test_a_span_split_on_another_thread_has_no_figures() -> None:
    """A thread's CPU time is read on the thread itself: a split made elsewhere would mix
    two threads' counts."""
    clock = SpanClock()
    assert clock.split() is not None
    elsewhere: list[Split | None] = [Split(0, 0, 0)]
    other = threading.Thread(target=lambda: elsewhere.__setitem__(0, clock.split()))
    other.start()
    other.join()
    assert elsewhere == [None]


@linux_only
def test_a_slow_pass_is_logged_with_where_its_thread_spent_the_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    timer = _PhaseTimer(None)
    _burn(0.05)
    timer.done("fleet")
    time.sleep(0.05)
    timer.done("apply")
    timer.ended()
    assert timer.split is not None
    assert timer.split.running >= 0.04 and timer.split.blocked >= 0.04
    with caplog.at_level(logging.INFO, logger="service.reconciler"):
        timer.describe_slow(3600.0, 3, 4, [], False)  # not slow: no line
        assert caplog.messages == []
        timer.describe_slow(0.05, 3, 4, [], False)
    (line,) = caplog.messages
    n = r"\d+\.\d\d"
    assert re.match(
        rf"slow reconciler pass: {n} s \(fleet {n} s, apply {n} s; on a CPU {n} s, "
        rf"waiting for a CPU {n} s, waiting on the database or a lock {n} s\) over 3 nodes "
        r"and 4 open jobs read \(the queue's head\); actions: none$",
        line,
    ), line
