"""Snapshots: atomic save, pruning, newest-valid load, weights_only, crash leftovers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from worker.runtime import snapshot as snapshot_module
from worker.runtime.rng import RngState
from worker.runtime.snapshot import (
    Snapshot,
    list_snapshots,
    load_latest_snapshot,
    save_snapshot,
)


def make_snapshot(step: int) -> Snapshot:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return Snapshot(
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        step=step,
        epoch=step // 10,
        samples_consumed=(step % 10) * 8,
        world_size=2,
        seed=11,
        rng=RngState.capture(),
        scheduler_state={"last_epoch": step},
        extra={"attempt_id": "7"},
    )


def steps_in(directory: Path) -> list[int]:
    return [step for step, _ in list_snapshots(directory)]


def test_round_trip(tmp_path: Path) -> None:
    original = make_snapshot(12)
    path = save_snapshot(tmp_path, original)
    assert path == tmp_path / "snapshot-000000012.pt"
    loaded = load_latest_snapshot(tmp_path)
    assert loaded is not None
    assert (loaded.step, loaded.epoch, loaded.samples_consumed) == (12, 1, 16)
    assert (loaded.world_size, loaded.seed, loaded.extra) == (2, 11, {"attempt_id": "7"})
    assert loaded.scheduler_state == {"last_epoch": 12}
    for key, tensor in original.model_state.items():
        assert torch.equal(loaded.model_state[key], tensor)
    model = torch.nn.Linear(3, 2)
    model.load_state_dict(loaded.model_state)
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.load_state_dict(loaded.optimizer_state)
    assert torch.equal(loaded.rng.torch_cpu, original.rng.torch_cpu)


def test_file_is_plain_data_for_weights_only(tmp_path: Path) -> None:
    path = save_snapshot(tmp_path, make_snapshot(3))
    payload = torch.load(path, weights_only=True, map_location="cpu")
    assert isinstance(payload, dict)
    assert payload["step"] == 3
    assert Snapshot.from_payload(payload).step == 3


def test_keeps_the_newest(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        save_snapshot(tmp_path, make_snapshot(step), keep=2)
    assert steps_in(tmp_path) == [15, 20]
    save_snapshot(tmp_path, make_snapshot(25), keep=1)
    assert steps_in(tmp_path) == [25]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        save_snapshot(tmp_path, make_snapshot(1), keep=0)


def test_higher_step_files_are_not_pruned(tmp_path: Path) -> None:
    save_snapshot(tmp_path, make_snapshot(50))
    save_snapshot(tmp_path, make_snapshot(10), keep=1)
    assert steps_in(tmp_path) == [10, 50]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "not_a_snapshot"])
def test_unreadable_newest_falls_back(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    save_snapshot(tmp_path, make_snapshot(10))
    newest = save_snapshot(tmp_path, make_snapshot(20))
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        newest.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        newest.write_bytes(b"")
    else:
        torch.save({"step": 20}, newest)
    with caplog.at_level(logging.WARNING):
        loaded = load_latest_snapshot(tmp_path)
    assert loaded is not None and loaded.step == 10
    assert "snapshot-000000020.pt" in caplog.text


def test_nothing_to_load(tmp_path: Path) -> None:
    assert load_latest_snapshot(tmp_path / "missing") is None
    assert load_latest_snapshot(tmp_path) is None
    (tmp_path / "snapshot-000000001.pt").write_bytes(b"junk")
    assert load_latest_snapshot(tmp_path) is None


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_crash_leftovers_are_ignored_then_cleaned(tmp_path: Path) -> None:
    save_snapshot(tmp_path, make_snapshot(10))
    host = snapshot_module._host_tag()
    by_dead_writer = tmp_path / f".snapshot-000000020.pt.{host}.{dead_pid()}.ab12cd34.tmp"
    by_dead_writer.write_bytes(b"half a snapshot")
    too_old = tmp_path / ".snapshot-000000030.pt.otherhost.123.ab12cd34.tmp"
    too_old.write_bytes(b"half a snapshot")
    old = time.time() - snapshot_module.STALE_TMP_AGE_S - 60
    os.utime(too_old, (old, old))
    in_flight = tmp_path / f".snapshot-000000040.pt.{host}.{os.getppid()}.ab12cd34.tmp"
    in_flight.write_bytes(b"being written by a live process")

    loaded = load_latest_snapshot(tmp_path)
    assert loaded is not None and loaded.step == 10

    save_snapshot(tmp_path, make_snapshot(11))
    assert not by_dead_writer.exists()
    assert not too_old.exists()
    assert in_flight.exists()


def test_failed_write_leaves_previous_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_snapshot(tmp_path, make_snapshot(10))

    def broken_save(obj: object, handle: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(snapshot_module.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_snapshot(tmp_path, make_snapshot(20))
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["snapshot-000000010.pt"]
    loaded = load_latest_snapshot(tmp_path)
    assert loaded is not None and loaded.step == 10


def test_rng_state_restores_the_stream() -> None:
    torch.manual_seed(5)
    state = RngState.capture()
    expected = torch.rand(4)
    torch.rand(100)
    state.restore()
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("field,value", [("step", -1), ("samples_consumed", -5), ("world_size", 0)])
def test_snapshot_rejects_bad_progress(field: str, value: int) -> None:
    snapshot = make_snapshot(1)
    payload = snapshot.to_payload()
    payload[field] = value
    with pytest.raises(ValueError, match=field):
        Snapshot.from_payload(payload)


def test_host_tag_keeps_temp_names_parseable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_module.socket, "gethostname", lambda: "node-1.example.org")
    assert snapshot_module._host_tag() == "node-1_example_org"
