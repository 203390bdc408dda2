"""EventWriter: JSON lines of contract.events, appended atomically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from contract.events import (
    EventKind,
    SnapshotSaved,
    TrainingProgress,
    TrainingStarted,
    parse_event,
)
from worker.runtime.events import MAX_LINE_BYTES, EventWriter, encode_event


def test_disabled_without_env(tmp_path: Path) -> None:
    writer = EventWriter.from_environ({})
    assert not writer.enabled
    writer.emit(TrainingStarted(world_size=1))
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_lines_parse_as_runtime_events(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"time":"2026-01-01T00:00:00Z","kind":"rendezvous","data":{}}\n')
    with EventWriter.from_environ({"RELAUNCH_EVENTS_FILE": str(path)}) as writer:
        writer.emit(
            TrainingStarted(world_size=2, restart_count=0, resumed_from_step=None, total_steps=9)
        )
        writer.emit(TrainingProgress(step=1, epoch=0, loss=0.5, samples_per_s=10.0, world_size=2))
    lines = path.read_text().splitlines()
    assert len(lines) == 3, "appends, never truncates"
    events = [parse_event(line) for line in lines]
    assert [e.kind for e in events] == [EventKind.RENDEZVOUS, EventKind.STARTED, EventKind.PROGRESS]
    assert isinstance(events[1].data, TrainingStarted) and events[1].data.resumed_from_step is None
    assert isinstance(events[2].data, TrainingProgress) and events[2].data.loss == 0.5
    assert events[2].time.utcoffset() is not None
    assert events[2].time.utcoffset().total_seconds() == 0  # type: ignore[union-attr]


def test_oversized_event_is_refused() -> None:
    with pytest.raises(ValueError, match="bytes"):
        encode_event(SnapshotSaved(path="x" * MAX_LINE_BYTES))


WRITER = """
import sys
from contract.events import SnapshotSaved
from worker.runtime.events import EventWriter
writer = EventWriter(sys.argv[1])
for step in range(300):
    writer.emit(SnapshotSaved(step=step, epoch=int(sys.argv[2]), path="y" * 900, world_size=1))
"""


def test_concurrent_writers_do_not_interleave(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    path = tmp_path / "events.jsonl"
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(i)], env=subprocess_env)
        for i in range(2)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    events = [parse_event(line).data for line in path.read_text().splitlines()]
    assert len(events) == 600
    for writer in (0, 1):
        steps = [e.step for e in events if isinstance(e, SnapshotSaved) and e.epoch == writer]
        assert steps == list(range(300))
