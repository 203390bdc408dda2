"""bench.recovery's figures: a recovery's phases from the probe's own lines and the
controller's, the throughput window, and the JSON with every trial and the medians."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path

from bench.recovery import Trial, TrialResult, figures, probe_recovery
from service import anatomy


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def write_lines(path: Path, *lines: dict[str, object]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def probe_trial(tmp_path: Path) -> Trial:
    trial = Trial(tmp_path / "x.steps", tmp_path / "x.pt")
    startup = {"process_started": 103.0, "imported": 105.0, "process_group": 105.5}
    write_lines(
        trial.steps_file,
        {"t": 90.0, "world": 2, "pid": 1, "startup": {"process_started": 80.0}},
        *({"t": 90.0 + i * 0.5, "step": i, "world": 2, "pid": 1} for i in range(1, 21)),
        {"t": 106.0, "world": 2, "pid": 2, "startup": {**startup, "snapshot_loaded": 105.75}},
        {"t": 106.5, "step": 21, "world": 2, "pid": 2},
        {"t": 107.0, "step": 22, "world": 2, "pid": 2},
    )
    return trial


def test_the_window_counts_steps_between_its_first_and_last(tmp_path: Path) -> None:
    trial = probe_trial(tmp_path)
    assert trial.steps_per_s(91.0, 95.0) == 2.0
    assert trial.steps_per_s(200.0, 300.0) is None


def test_raw_torchrun_has_only_the_probes_moments_so_its_first_phase_runs_from_the_fault(
    tmp_path: Path,
) -> None:
    recovery = probe_recovery(probe_trial(tmp_path), fault_at=100.0, world=2)
    phases = {p.name: (p.since, p.seconds) for p in recovery.phases}
    assert phases["detection"] == ("fault", None)
    assert phases["rendezvous"] == ("fault", None)
    assert phases["process_start"] == ("fault", 3.0)
    assert phases["first_step"] == ("snapshot_loaded", 0.75)
    assert recovery.total_s == 6.5


def test_relaunch_adds_the_controllers_failure_and_rendezvous(tmp_path: Path) -> None:
    reported_moments = {"failed": (at(101.0), "node 2"), "rendezvous": (at(102.5), "node 1")}
    reported = anatomy.Recovery("worker_failed", reported_moments, anatomy.phases(reported_moments))
    recovery = probe_recovery(probe_trial(tmp_path), 100.0, 2, reported)
    seconds = [p.seconds for p in recovery.phases]
    assert seconds == [1.0, 1.5, 0.5, 2.0, 0.5, 0.25, 0.75]

    trials = [
        TrialResult(
            "worker_kill",
            "raw torchrun",
            1,
            None,
            2.0,
            probe_recovery(probe_trial(tmp_path), 100.0, 2),
        ),
        TrialResult("worker_kill", "relaunch", 1, 6.5, 1.9, recovery),
    ]
    args = argparse.Namespace(
        repeats=1, scenarios="worker_kill", timeout=60.0, window=5.0, spare=False
    )
    data = json.loads(json.dumps(figures(trials, args)))
    assert [t["recovery_s"] for t in data["trials"]] == [None, 6.5]
    medians = data["medians"]["worker_kill"]
    assert medians["relaunch"]["phases"]["rendezvous"]["median_s"] == 1.5
    assert medians["raw torchrun"]["phases"]["rendezvous"]["median_s"] is None
    assert medians["raw torchrun"]["phases"]["process_start"]["since"] == "fault"
    assert data["throughput_steps_per_s"]["relaunch / raw torchrun"] == 0.95
