"""The hang timeout in force for a worker: fixed, or derived from its own beats."""

from __future__ import annotations

import pytest

from worker.hang import (
    FLOOR_S,
    MIN_INTERVALS,
    TEARDOWN_IDLE_S,
    WINDOW,
    BeatWatch,
    BeatWatches,
    HangRule,
    TeardownWatch,
)

CAP_S = 600.0


def _watch_after(beats: list[float], rule: HangRule | None = None) -> BeatWatch:
    watch = BeatWatch(rule or HangRule(CAP_S, adaptive=True))
    for at in beats:
        watch.observe(at)
    return watch


def _steady(interval_s: float, count: int, start: float = 1000.0) -> list[float]:
    return [start + i * interval_s for i in range(count)]


def test_a_fixed_timeout_is_the_spec_s_number_whatever_the_beats() -> None:
    watch = _watch_after(_steady(0.2, 50), HangRule(45.0))
    timeout = watch.timeout()
    assert (timeout.seconds, timeout.rule) == (45.0, "fixed")


def test_until_enough_intervals_are_seen_the_cap_holds() -> None:
    watch = _watch_after(_steady(0.2, MIN_INTERVALS))  # MIN_INTERVALS beats: one interval short
    timeout = watch.timeout()
    assert (timeout.seconds, timeout.rule) == (CAP_S, "adaptive")
    assert "fewer than" in timeout.derivation
    watch.observe(1000.0 + MIN_INTERVALS * 0.2)
    assert watch.timeout().seconds == FLOOR_S


def test_sub_second_steps_get_the_floor() -> None:
    timeout = _watch_after(_steady(0.25, 40)).timeout()
    assert timeout.seconds == FLOOR_S
    assert (
        "floor 30 s" in timeout.derivation and "median beat interval 0.25 s" in timeout.derivation
    )


def test_slow_steps_get_ten_times_the_median() -> None:
    assert _watch_after(_steady(5.0, 20)).timeout().seconds == 50.0


def test_the_timeout_never_passes_the_cap() -> None:
    assert _watch_after(_steady(90.0, 8)).timeout().seconds == CAP_S
    low_cap = HangRule(20.0, adaptive=True)  # a cap below the floor still caps
    assert _watch_after(_steady(0.2, 20), low_cap).timeout().seconds == 20.0


def test_a_pause_once_survived_is_allowed_twice_over() -> None:
    """An evaluation of 25 s between epochs of 0.2 s steps: the next one may take 50 s."""
    beats = _steady(0.2, 30)
    beats += _steady(0.2, 30, start=beats[-1] + 25.0)
    timeout = _watch_after(beats).timeout()
    assert timeout.seconds == 50.0
    assert "longest 25 s" in timeout.derivation


def test_the_median_ignores_a_few_slow_steps_and_forgets_old_ones() -> None:
    beats = [*_steady(1.0, 20), 1019.0 + 2.0, 1021.0 + 2.0]  # two slow steps among 1 s ones
    assert _watch_after(beats).timeout().seconds == 30.0  # 10 x median 1 s = 10 s < floor
    slow_now = _steady(1.0, 20) + _steady(4.0, WINDOW + 1, start=1019.0 + 4.0)
    assert _watch_after(slow_now).timeout().seconds == 40.0  # the window holds 4 s steps only


def test_an_unchanged_or_older_beat_time_adds_no_interval() -> None:
    watch = _watch_after([1000.0, 1000.0, 999.0, 1001.0])
    assert list(watch.intervals) == [1.0]
    assert watch.last_beat == 1001.0


def test_a_new_process_of_a_local_rank_starts_a_new_watch() -> None:
    watches = BeatWatches(HangRule(CAP_S, adaptive=True))
    first = watches.watch(0, pid=100)
    for at in _steady(0.2, 10):
        first.observe(at)
    assert watches.watch(0, pid=100) is first
    restarted = watches.watch(0, pid=200)
    assert restarted is not first and not restarted.intervals
    watches.forget(0)
    assert watches.watch(0, pid=200) is not restarted


@pytest.mark.parametrize("timeout_s", [0.0, -1.0])
def test_a_rule_needs_a_positive_timeout(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="> 0"):
        HangRule(timeout_s)


def test_a_hang_found_by_the_adaptive_rule_doubles_the_floor_up_to_the_cap() -> None:
    """A pause that is part of the script costs one restart; the next one is allowed
    twice as long, and so on up to the cap. A fixed rule never moves."""
    watches = BeatWatches(HangRule(100.0, adaptive=True))
    before = watches.watch(0, pid=100)
    assert watches.raise_floor() == 2 * FLOOR_S
    after = watches.watch(0, pid=200)  # the restarted worker
    for at in _steady(0.2, MIN_INTERVALS + 1):
        before.observe(at)
        after.observe(at)
    assert before.timeout().seconds == FLOOR_S  # a running worker keeps its rule
    assert after.timeout().seconds == 2 * FLOOR_S
    assert watches.raise_floor() == 100.0  # capped
    assert watches.raise_floor() == 100.0
    fixed = BeatWatches(HangRule(5.0))
    assert fixed.raise_floor() == FLOOR_S and fixed.watch(0, pid=1).timeout().seconds == 5.0


def test_a_teardown_without_cpu_for_the_whole_window_is_stuck() -> None:
    watch = TeardownWatch()
    assert not watch.observe(100.0, 5.0)  # the window starts at the first pass
    assert not watch.observe(100.0 + TEARDOWN_IDLE_S - 0.1, 5.0)
    assert watch.observe(100.0 + TEARDOWN_IDLE_S, 5.0)


def test_a_teardown_that_works_is_not_stuck_until_it_stops_working() -> None:
    """A final save after the group was destroyed uses CPU; only its last 30 s count."""
    watch = TeardownWatch()
    cpu = 0.0
    for second in range(0, 121):
        cpu += 0.5 if second <= 60 else 0.0  # half a core for a minute, then nothing
        stuck = watch.observe(float(second), cpu)
        assert stuck is (second >= 60 + TEARDOWN_IDLE_S), second


def test_a_trickle_of_cpu_under_the_share_is_still_stuck() -> None:
    """A thread that wakes now and then (a progress bar's monitor) does not hide a hang."""
    watch = TeardownWatch(idle_s=30.0, cpu_share=0.01)
    cpu = 0.0
    for second in range(0, 31):
        cpu += 0.002  # 0.2 % of a core
        stuck = watch.observe(float(second), cpu)
    assert stuck
    assert "less than 1% of a core for 30 s after it destroyed" in watch.derivation(
        "it destroyed its process group"
    )


def test_a_beat_in_the_teardown_starts_the_window_again() -> None:
    """A script waiting on purpose after it destroyed its group (to form a new one) beats."""
    watch = TeardownWatch(idle_s=30.0)
    assert not watch.observe(0.0, 1.0, beat_at=-5.0)  # the beat from before the teardown
    assert not watch.observe(20.0, 1.0, beat_at=-5.0)
    assert not watch.observe(25.0, 1.0, beat_at=24.0)  # beats while it waits
    assert not watch.observe(54.0, 1.0, beat_at=24.0)
    assert watch.observe(55.0, 1.0, beat_at=24.0)  # 30 s since the window began again
