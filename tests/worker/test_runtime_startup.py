"""worker.runtime.startup and process_clock: the moments of a worker process's start,
each kept once, the first read from the kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from worker.runtime import startup
from worker.runtime.process_clock import process_started_at


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    startup.forget()
    yield
    startup.forget()


def test_a_moment_is_kept_the_first_time_it_is_marked() -> None:
    startup.mark(startup.Moment.IMPORTED, at=100.0)
    startup.mark(startup.Moment.IMPORTED, at=200.0)
    assert startup.reached(startup.Moment.IMPORTED)
    assert not startup.reached(startup.Moment.FIRST_STEP)
    moments = startup.startup()
    assert moments.imported_at is not None and moments.imported_at.timestamp() == 100.0
    assert moments.process_group_at is None and moments.first_step_at is None


def test_the_process_start_is_the_kernels_record_of_this_process() -> None:
    started = process_started_at()
    assert started is not None
    # psutil reads the same record against a boot time in whole seconds.
    assert abs(started - psutil.Process().create_time()) < 1.5
    assert started <= time.time()
    assert startup.startup().process_started_at is not None


def test_a_new_process_starts_no_earlier_than_half_a_tick_before_its_fork() -> None:
    half_tick = 0.5 / os.sysconf("SC_CLK_TCK")
    before = time.time()
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from worker.runtime.process_clock import process_started_at as s; print(repr(s()))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    after = time.time()
    started = float(child.stdout)
    # The kernel rounds the start down to a tick; the middle of it is half a tick off at most.
    assert before - half_tick <= started <= after + half_tick


def test_a_command_name_with_spaces_and_parentheses_is_read_past(tmp_path: Path) -> None:
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    started_ticks = int((since_boot - 60) * ticks_per_s)  # a minute ago
    fields = ["S", *["0"] * 18, str(started_ticks), "0"]
    (tmp_path / "stat").write_text(f"42 (a (b) c) {' '.join(fields)}\n")
    started = process_started_at(tmp_path)
    assert started is not None
    assert abs((time.time() - started) - 60) < 1.0


def test_without_proc_there_is_no_process_start(tmp_path: Path) -> None:
    assert process_started_at(tmp_path / "missing") is None
    (tmp_path / "stat").write_text("garbage")
    assert process_started_at(tmp_path) is None
