"""Progress beats: a block that is progress without steps beats from a thread."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tests.helpers import wait_for
from worker.runtime import progress
from worker.runtime.progress import progress_file


@pytest.fixture
def beats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RELAUNCH_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(progress, "_path", None)
    monkeypatch.setattr(progress, "_disabled", False)
    return progress_file(tmp_path, 1)


def _beat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "progress-beat"]


def test_a_block_in_beating_beats_until_it_ends(beats: Path) -> None:
    with progress.beating(interval_s=0.01):
        assert beats.exists()
        os.utime(beats, (0, 0))  # as if the last beat were long ago
        wait_for("a beat from the thread", lambda: beats.stat().st_mtime > 0)
    assert not _beat_threads()


def test_beating_ends_its_thread_when_the_block_raises(beats: Path) -> None:
    with pytest.raises(RuntimeError, match="evaluation failed"), progress.beating(0.01):
        raise RuntimeError("evaluation failed")
    assert not _beat_threads()


def test_outside_relaunch_beating_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RELAUNCH_PROGRESS_DIR", raising=False)
    monkeypatch.setattr(progress, "_path", None)
    monkeypatch.setattr(progress, "_disabled", False)
    with progress.beating(interval_s=0.01):
        pass
    assert list(tmp_path.iterdir()) == []
