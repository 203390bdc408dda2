"""The bootstrap counts optimizer steps: rank 0 reports them, rate-limited, with a step time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.events import EventKind, TrainingProgress, parse_event
from worker import report
from worker.runtime.step_counter import StepCounter

REPO = Path(__file__).resolve().parents[2]


def progress_in(path: Path) -> list[TrainingProgress]:
    if not path.exists():
        return []
    events = [parse_event(line) for line in path.read_text().splitlines()]
    return [e.data for e in events if isinstance(e.data, TrainingProgress)]


@pytest.fixture
def reporter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> report.Reporter:
    monkeypatch.setenv("RELAUNCH_EVENTS_FILE", str(tmp_path / "events.jsonl"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    return report.Reporter()


def test_the_first_step_is_reported_then_at_most_once_per_interval(
    reporter: report.Reporter, tmp_path: Path
) -> None:
    counter = StepCounter(reporter, interval_s=1.0)
    for now in (10.0, 10.2, 10.4, 10.6, 10.8, 11.0, 11.2):
        counter.on_step(now)
    counter.flush(11.5)
    reports = progress_in(tmp_path / "events.jsonl")
    assert [(p.step, p.step_time_s) for p in reports] == [
        (1, None),
        (6, pytest.approx(0.2)),  # 5 steps in 1 s
        (7, pytest.approx(0.5)),  # at exit: the one step since
    ]


def test_explicit_reports_win_over_the_count(reporter: report.Reporter, tmp_path: Path) -> None:
    counter = StepCounter(reporter, interval_s=1.0)
    counter.on_step(0.0)
    reporter.explicit_steps = True  # what report.step and the Trainer do
    for now in (2.0, 4.0):
        counter.on_step(now)
    counter.flush(5.0)
    assert [p.step for p in progress_in(tmp_path / "events.jsonl")] == [1]


def test_the_count_goes_on_from_the_step_a_resume_named(
    reporter: report.Reporter, tmp_path: Path
) -> None:
    reporter.resumed_from_step = 100
    counter = StepCounter(reporter, interval_s=1.0)
    counter.on_step(0.0)
    counter.on_step(2.0)
    assert [p.step for p in progress_in(tmp_path / "events.jsonl")] == [101, 102]


def test_a_script_that_calls_nothing_shows_its_optimizer_steps(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(25):\n"
        "    opt.zero_grad(); model(torch.ones(4, 2)).sum().backward(); opt.step()\n"
    )
    events = tmp_path / "events.jsonl"
    progress_dir = tmp_path / "progress"
    env = {
        **os.environ,
        "RELAUNCH_EVENTS_FILE": str(events),
        "RELAUNCH_PROGRESS_DIR": str(progress_dir),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "PYTHONPATH": str(REPO),
    }
    subprocess.run(
        [sys.executable, "-m", "worker.bootstrap", str(script)], env=env, check=True, timeout=120
    )
    reports = progress_in(events)
    assert reports[0].step == 1
    assert reports[-1].step == 25  # the last count is reported at exit
    assert all(p.world_size == 1 for p in reports)
    assert (progress_dir / "local-0").exists()  # hang detection saw it beat
    assert parse_event(events.read_text().splitlines()[0]).kind is EventKind.PROGRESS
