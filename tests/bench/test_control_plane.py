"""The control-plane benchmark's engine, run small: a real controller, a few simulated
nodes, a few jobs, a few seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from bench.control_plane import (
    BASELINES,
    CODE_ROOT,
    Options,
    _by_label,
    cores_apart,
    during_stalls,
    histogram_quantile,
    main,
    paired,
    per_second,
    poll,
    print_table,
    run,
    share_within,
    split_cores,
    tail_of,
)
from bench.sim_nodes import Training


@pytest.mark.e2e  # a real controller process, like the end-to-end tests
def test_the_simulated_nodes_run_the_submitted_jobs(tmp_path: Path) -> None:
    training = Training(steps=4, step_s=0.2, progress_every=2, rendezvous_s=0.2)
    options = Options(
        nodes=4,
        jobs=6,
        seconds=8.0,
        read_rate=20,
        training=training,
        work_dir=tmp_path,
        heartbeats_per_s_max=2.5,  # 4 nodes: each told 1.6 s once they are counted
        settle_s=1.0,
    )
    result = run(options)
    assert result["heartbeat"]["interval_told_s_max"] == 1.6
    jobs = result["jobs"]
    assert jobs["placed"] >= 2, jobs
    assert jobs["by_state_at_end"]["SUCCEEDED"] >= 1, jobs
    assert jobs["runs_succeeded"] >= 1, jobs
    beats = result["heartbeat"]
    assert beats["count"] > 0
    # Answers that started a run and the others are told apart; each answer counts once.
    assert beats["others"]["count"] > 0, beats
    assert beats["starting"]["count"] + beats["others"]["count"] <= beats["count"], beats
    assert beats["tail"]["slow"] >= 1 and beats["tail"]["seconds"] >= 1, beats["tail"]
    loop = result["bench_loop"]  # its own collector held while it measured
    assert loop["collections"] == 0 and loop["lag_max_ms"] >= 0, loop
    assert result["reconcile"]["passes"] > 0
    assert result["reconcile"]["actions"].get("PlaceJob", 0) >= 2
    assert result["nodes_by_state_at_end"]["ALIVE"] == 4
    registrations = result["setup"]["registrations"]
    assert registrations["tries"] >= 4 and registrations["refused"] == 0, registrations
    # The fleet's start, left out of the measurement, is reported apart.
    start = result["setup"]["fleet_start"]
    assert start["settle_s"] == 1.0 and start["seconds"] > 1.0, start
    assert start["heartbeats"] >= 4 and start["heartbeat_p99_ms"] > 0, start
    assert [r["phase"] for r in result["reads"]] == [
        "job list",
        "job list, If-None-Match",
        "job detail",
        "job detail, If-None-Match",
    ]
    assert all(r["requests"] > 0 and r["offered_per_s"] == 20 for r in result["reads"])
    assert result["controller"]["rss_mib_max"] > 0
    # Every process of the controller (its own, its reconciler's) runs the bench's tree.
    roots = result["code"]["processes_by_root"]
    assert list(roots) == [str(CODE_ROOT)] and roots[str(CODE_ROOT)] >= 2, roots
    load = result["offered"]
    assert load["runs_running_max"] >= 1 and load["runs_running_mean"] > 0, load
    assert load["runs_per_job_placed"] >= 1, load
    assert load["reports_per_s"] > 0 and load["heartbeats_per_s"] > 0, load
    assert 0 < result["machine"]["busy_share"] <= 1
    assert 0 <= result["machine"]["system_share"] < result["machine"]["busy_share"]
    print_table(result)  # the table prints what was measured, with the reads' offered rate


def test_quantiles_from_cumulative_buckets() -> None:
    # 10 observations: 5 at most 0.1 s, 9 at most 0.5 s, 1 above the last finite bound.
    cumulative = [(0.1, 5.0), (0.5, 9.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.5, cumulative) == pytest.approx(0.1)
    assert histogram_quantile(0.7, cumulative) == pytest.approx(0.1 + 0.4 * 2 / 4)
    assert histogram_quantile(0.99, cumulative) == 0.5  # in +Inf: the largest finite bound
    assert share_within(cumulative, 0.1) == 0.5
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) != 0.0  # NaN


def test_the_slowest_heartbeats_are_placed_in_the_seconds_they_were_sent() -> None:
    # Sent over three seconds from t = 100: second 1 holds the slow ones and two reports.
    beats = [(100.0, 10.0), (100.5, 12.0), (101.1, 300.0), (101.2, 250.0), (101.9, 11.0)]
    beats.append((102.3, 40.0))
    reports = [(101.0, 5.0), (101.5, 6.0), (102.0, 7.0)]
    tail = tail_of(beats, reports, p99_ms=250.0)
    assert (tail["slow"], tail["seconds"], tail["of_seconds"]) == (2, 1, 3)
    worst = tail["worst"]
    assert [w["second"] for w in worst] == [1, 2, 0]  # by their slowest heartbeat
    assert worst[0] == {
        "second": 1,
        "heartbeats": 3,
        "reports": 2,
        "p50_ms": 250.0,
        "max_ms": 300.0,
        "slow": 2,
    }
    # Only second 1 is whole (the first and the last may be cut short): three heartbeats.
    assert tail["per_second"] == {"min": 3, "p50": 3, "max": 3}
    # A second in which no heartbeat was sent (a stall) holds none, and is no worst one.
    gap = tail_of([(100.0, 10.0), (101.5, 20.0), (103.2, 30.0), (104.1, 5.0)], [], 30.0)
    assert gap["per_second"] == {"min": 0, "p50": 1, "max": 1}  # seconds 1, 2, 3
    assert gap["of_seconds"] == 5 and [w["second"] for w in gap["worst"]] == [3, 1, 0]
    assert tail_of([], [], p99_ms=float("nan")) == {
        "slow": 0,
        "seconds": 0,
        "worst": [],
        "per_second": {},
    }


def test_every_baseline_changes_fields_the_options_have() -> None:
    for flag, (changes, names, _) in BASELINES.items():
        assert flag.startswith("baseline_") and len(set(names)) == 2
        changed = replace(Options(), **changes)  # a field Options lacks raises TypeError
        assert all(getattr(changed, k) == v for k, v in changes.items()), flag
        if flag == "baseline_same":  # the one that changes nothing, on purpose
            assert changes == {}
            continue
        # The one pair that needs an option given (main refuses it without --controller-cores).
        given = Options(controller_cores=(0,)) if flag == "baseline_shared_cores" else Options()
        assert any(getattr(given, k) != v for k, v in changes.items()), flag


class _Answers(BaseHTTPRequestHandler):
    """200 with an ETag, or 304 when the request names it, after ``delay_s``; counts the
    requests under way at once."""

    delay_s = 0.0
    lock = threading.Lock()
    under_way = 0
    most_under_way = 0

    def do_GET(self) -> None:  # the name http.server calls
        cls = type(self)
        with cls.lock:
            cls.under_way += 1
            cls.most_under_way = max(cls.most_under_way, cls.under_way)
        time.sleep(cls.delay_s)
        with cls.lock:
            cls.under_way -= 1
        if self.headers.get("if-none-match") == '"v1"':
            self.send_response(304)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("etag", '"v1"')
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def answering() -> Iterator[str]:
    _Answers.delay_s, _Answers.under_way, _Answers.most_under_way = 0.0, 0, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_reader_that_starts_after_its_phase_still_sends_one_request(answering: str) -> None:
    latencies, not_modified, errors = poll(answering, "t", "/jobs", True, time.time() - 1.0)
    assert len(latencies) == 1 and not_modified == 0 and errors == {}


def test_a_conditional_reader_sends_back_the_etag_it_was_given(answering: str) -> None:
    latencies, not_modified, errors = poll(answering, "t", "/jobs", True, time.time() + 1.5)
    assert len(latencies) >= 2 and errors == {}
    assert not_modified == len(latencies) - 1  # only the first read is answered in full


def test_a_reader_at_a_fixed_rate_does_not_wait_for_answers_and_counts_from_when_due(
    answering: str,
) -> None:
    _Answers.delay_s = 0.3
    since = time.time()
    latencies, _, errors = poll(answering, "t", "/jobs", False, since + 0.5, rate=20, since=since)
    assert errors == {} and len(latencies) == 10  # 0.5 s at 20 a second
    assert _Answers.most_under_way > 1  # sent while earlier ones were still answered
    assert min(latencies) >= 300


def test_a_reader_back_to_back_has_one_read_under_way(answering: str) -> None:
    _Answers.delay_s = 0.05
    latencies, _, errors = poll(answering, "t", "/jobs", False, time.time() + 1.5)
    assert errors == {} and len(latencies) >= 2
    assert _Answers.most_under_way == 1


def test_a_reader_at_a_fixed_rate_that_starts_late_sends_what_was_due_at_once(
    answering: str,
) -> None:
    since = time.time() - 1.0  # the phase before overran its end by 1 s
    latencies, _, errors = poll(answering, "t", "/jobs", False, since + 1.5, rate=10, since=since)
    assert errors == {} and len(latencies) == 15  # as many as an on-time reader sends
    assert max(latencies) >= 900  # the late ones count from when they were due


def test_a_histogram_is_read_by_label_with_only_the_labels_that_have_samples() -> None:
    """What the bench prints of the pass's phases and of its thread's split: each label
    value's mean and p99 over the run, and nothing for a value with no sample."""
    name = "relaunch_reconcile_pass_split_seconds"

    def sample(
        suffix: str, value: float, **labels: str
    ) -> tuple[tuple[str, frozenset[tuple[str, str]]], float]:
        return (f"{name}{suffix}", frozenset({"state": "running", **labels}.items())), value

    before = dict([sample("_count", 2), sample("_sum", 0.01), sample("_bucket", 2, le="0.025")])
    after = dict(
        [
            sample("_count", 6),
            sample("_sum", 0.11),
            sample("_bucket", 4, le="0.025"),
            sample("_bucket", 6, le="0.05"),
            sample("_bucket", 6, le="+Inf"),
        ]
    )
    means, p99s = _by_label(before, after, name, "state", ("running", "blocked"))
    assert means == {"running": pytest.approx(25.0)}  # 0.1 s over 4 passes
    assert list(p99s) == ["running"] and 25.0 < p99s["running"] <= 50.0


def test_a_slow_heartbeat_is_counted_with_a_stall_of_the_bench_it_overlapped() -> None:
    # Slow ones (>= 100 ms): sent at 10.0 (to 10.3), at 20.0 (to 20.2), at 30.0 (to 30.1).
    beats = [(10.0, 300.0), (20.0, 200.0), (30.0, 100.0), (10.1, 5.0)]
    lags = [
        (10.25, 80.0),  # stalled from 10.17 to 10.25: within the first
        (19.9, 60.0),  # from 19.84 to 19.9: ended before the second was sent
        (30.2, 20.0),  # late, but not a stall
        (30.05, 40.0),  # nor this one
    ]
    assert during_stalls(beats, 100.0, lags) == 1
    # A stall that began before a heartbeat was sent and ended while it waited counts.
    assert during_stalls(beats, 100.0, [(20.05, 100.0)]) == 1
    # The fast heartbeat under way in the first stall is not one of the slowest.
    assert during_stalls(beats, 1000.0, lags) == 0
    assert during_stalls([], 100.0, lags) == 0


def test_a_pair_runs_in_turn_and_names_each_run(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str | None] = []

    def fake_run(options: Options) -> dict[str, object]:
        ran.append(options.code)
        return {"run": len(ran)}

    monkeypatch.setattr("bench.control_plane.run", fake_run)
    given = Options(runs_at_once=50)
    so_far: list[list[str]] = []
    runs = paired(
        given, {"code": "/old"}, ("old", "this tree"), 3, lambda r: so_far.append(list(r))
    )
    # Baseline first, then in turn, so that a drifting machine weighs on both alike.
    assert ran == ["/old", None, None, "/old", "/old", None]
    assert [len(names) for names in so_far] == [1, 2, 3, 4, 5, 6]  # told after each run
    assert so_far[2] == ["old (1)", "this tree (1)", "this tree (2)"]
    assert runs == {
        "old (1)": {"run": 1},
        "old (2)": {"run": 4},
        "old (3)": {"run": 5},
        "this tree (1)": {"run": 2},
        "this tree (2)": {"run": 3},
        "this tree (3)": {"run": 6},
    }
    assert paired(given, {}, ("a", "b"), rounds=1) == {"a": {"run": 7}, "b": {"run": 8}}


@pytest.mark.parametrize(
    "argv",
    [
        ["--rounds", "2"],  # rounds of no pair
        ["--baseline-same", "--baseline-no-gc-freeze"],  # two pairs at once
        ["--baseline-code", "/nonexistent"],  # no code there
        ["--runs-at-once", "0"],
        ["--step-spread", "1"],  # a step of no time
        ["--step-spread", "-0.1"],
        ["--db", "postgresql", "--api-processes", "4", "--api-threads", "40"],  # too many
        ["--baseline-shared-cores"],  # no cores to set apart
        ["--controller-cores", "one"],
        ["--controller-cores", "-1"],
        ["--controller-cores", str(max(os.sched_getaffinity(0)) + 1)],  # not this machine's
        ["--controller-cores", ",".join(map(str, os.sched_getaffinity(0)))],  # none left over
    ],
)
def test_the_bench_refuses_options_it_cannot_honour(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_controller_is_given_the_cores_asked_for_and_the_rest_keep_the_others() -> None:
    assert split_cores([0], [0, 1]) == ({0}, {1})
    assert split_cores([1, 3], [0, 1, 2, 3]) == ({1, 3}, {0, 2})
    for chosen, allowed, says in [
        ([], [0, 1], "at least one core"),
        ([2], [0, 1], "not this process's"),
        ([0, 1], [0, 1], "no core left"),
    ]:
        with pytest.raises(ValueError, match=says):
            split_cores(chosen, allowed)


def _affinity_of_a_child() -> set[int]:
    printed = subprocess.run(
        [sys.executable, "-c", "import os; print(*sorted(os.sched_getaffinity(0)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {int(core) for core in printed.split()}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to set one apart")
def test_what_starts_on_the_controllers_side_runs_on_its_cores_and_the_rest_on_the_others() -> None:
    every = os.sched_getaffinity(0)
    mine = min(every)
    database = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stand_in = psutil.Process(database.pid)
        with cores_apart([mine], lambda: [stand_in]) as controller_side:
            assert os.sched_getaffinity(0) == every - {mine}  # the fleet's side
            assert set(stand_in.cpu_affinity()) == every - {mine}
            with controller_side():
                assert _affinity_of_a_child() == {mine}  # a controller inherits it
            assert _affinity_of_a_child() == every - {mine}  # a reader the fleet starts
        assert os.sched_getaffinity(0) == every  # all put back
        assert set(stand_in.cpu_affinity()) == every
        with cores_apart(None) as unchanged, unchanged():  # the default moves nothing
            assert _affinity_of_a_child() == every
    finally:
        database.kill()
        database.wait()


def test_runs_that_end_in_waves_are_told_from_runs_that_end_evenly() -> None:
    even = per_second([100.0 + i / 2 for i in range(20)], start=100.0, wall=10.0)
    assert even == {"p50": 2.0, "max": 2.0, "busiest_fifth_share": 0.2}
    # The same 20 ends, all in two of the ten seconds; one before the window and one after
    # it are left out.
    waves = [102.1] * 10 + [107.5] * 10 + [99.0, 110.5]
    assert per_second(waves, start=100.0, wall=10.0) == {
        "p50": 0.0,
        "max": 10.0,
        "busiest_fifth_share": 1.0,
    }
