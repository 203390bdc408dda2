"""worker.report: a script's own reports, sent by rank 0 only, and only under relaunch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from contract.events import EventKind, parse_event
from worker import report
from worker.runtime import startup


@pytest.fixture
def events_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's reporter writes here, as rank 0 of a world of 2."""
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv("RELAUNCH_EVENTS_FILE", str(path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(report, "_reporter", report.Reporter())
    startup.forget()
    return path


def test_rank_0_reports_steps_with_loss_speed_and_named_metrics(events_file: Path) -> None:
    report.step(7, loss=0.5, samples_per_s=100.0, epoch=1, metrics={"acc": 0.9})
    [line] = events_file.read_text().splitlines()
    event = parse_event(line)
    assert event.kind is EventKind.PROGRESS
    assert event.data.model_dump(exclude={"startup"}) == {
        "step": 7,
        "epoch": 1,
        "loss": 0.5,
        "samples_per_s": 100.0,
        "world_size": 2,
        "step_time_s": None,
        "metrics": {"acc": 0.9},
    }
    assert report.process_reporter().explicit_steps


def test_the_first_report_of_a_process_carries_its_start_and_the_next_ones_do_not(
    events_file: Path,
) -> None:
    startup.mark(startup.Moment.FIRST_STEP)
    report.step(1)
    report.step(2)
    first, second = (parse_event(line).data for line in events_file.read_text().splitlines())
    assert first.startup is not None  # type: ignore[union-attr]
    assert first.startup.first_step_at is not None  # type: ignore[union-attr]
    assert first.startup.process_started_at is not None  # type: ignore[union-attr]
    assert second.startup is None  # type: ignore[union-attr]


def test_a_step_reported_before_the_first_optimizer_step_leaves_the_start_for_the_next(
    events_file: Path,
) -> None:
    report.step(0)
    startup.mark(startup.Moment.FIRST_STEP)
    report.step(1)
    report.step(2)
    lines = events_file.read_text().splitlines()
    early, first, second = (parse_event(line).data for line in lines)
    assert early.startup is not None  # type: ignore[union-attr]
    assert early.startup.first_step_at is None  # type: ignore[union-attr]
    assert first.startup is not None  # type: ignore[union-attr]
    assert first.startup.first_step_at is not None  # type: ignore[union-attr]
    assert second.startup is None  # type: ignore[union-attr]


def test_resumed_names_the_step_of_the_snapshot(events_file: Path) -> None:
    report.resumed(40, total_steps=100)
    [line] = events_file.read_text().splitlines()
    event = parse_event(line)
    assert event.kind is EventKind.STARTED
    assert event.data.resumed_from_step == 40
    assert event.data.total_steps == 100
    assert event.data.world_size == 2
    assert not report.process_reporter().explicit_steps
    moments = event.data.startup
    assert moments is not None and moments.snapshot_loaded_at is not None
    assert moments.first_step_at is None


def test_other_ranks_report_nothing(events_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    report.resumed(3)
    report.step(4, loss=1.0)
    assert not events_file.exists()


def test_outside_relaunch_a_report_does_nothing(
    events_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RELAUNCH_EVENTS_FILE")
    report.step(1, loss=1.0)
    report.resumed(1)
    assert not events_file.exists()


def test_a_report_out_of_bounds_raises_value_error(events_file: Path) -> None:
    with pytest.raises(ValueError, match="metrics"):
        report.step(1, metrics={f"m{i}": 1.0 for i in range(report.MAX_NAMED_METRICS + 1)})
    with pytest.raises(ValueError, match="step"):
        report.step(-1)
    assert not events_file.exists()


def test_importing_the_api_pulls_in_neither_torch_nor_the_controller() -> None:
    heavy = ("torch", "service", "fastapi", "sqlalchemy")
    code = f"import sys; from worker import report; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
