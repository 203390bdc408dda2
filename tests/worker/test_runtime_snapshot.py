"""Snapshots: manifest and checksum, pruning, newest verified load, crash points, storage."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.worker.helpers import make_snapshot
from worker.runtime import snapshot as snapshot_module
from worker.runtime import storage as storage_module
from worker.runtime.rng import RngState
from worker.runtime.snapshot import (
    FAULT_POINTS,
    Manifest,
    TrainingState,
    list_snapshots,
    load_latest_snapshot,
    manifest_name,
    save_snapshot,
)


def steps_in(directory: Path | str) -> list[int]:
    return [step for step, _ in list_snapshots(directory)]


def load(location: Path | str) -> tuple[TrainingState | None, list[tuple[int, str]]]:
    """The loaded snapshot and the (step, reason) of each one skipped."""
    skipped: list[tuple[int, str]] = []
    found = load_latest_snapshot(location, on_skip=lambda step, why: skipped.append((step, why)))
    return (found[0] if found else None), skipped


def test_round_trip(tmp_path: Path) -> None:
    original = make_snapshot(12)
    manifest = save_snapshot(tmp_path, original)
    assert manifest.step == 12 and manifest.world_size == 2 and manifest.attempt_id == "7"
    assert (tmp_path / manifest_name(12)).is_file()
    data = (tmp_path / manifest.file).read_bytes()
    assert manifest.size_bytes == len(data)
    assert manifest.sha256 == hashlib.sha256(data).hexdigest()
    found = load_latest_snapshot(tmp_path)
    assert found is not None
    loaded, loaded_manifest = found
    assert loaded_manifest == manifest
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


def test_data_file_is_plain_data_for_weights_only(tmp_path: Path) -> None:
    manifest = save_snapshot(tmp_path, make_snapshot(3))
    payload = torch.load(tmp_path / manifest.file, weights_only=True, map_location="cpu")
    assert isinstance(payload, dict)
    assert TrainingState.from_payload(payload).step == 3


def test_keeps_the_newest(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        save_snapshot(tmp_path, make_snapshot(step), keep=2)
    assert steps_in(tmp_path) == [15, 20]
    save_snapshot(tmp_path, make_snapshot(25), keep=1)
    assert steps_in(tmp_path) == [25]
    (only,) = list_snapshots(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([only[1].file, manifest_name(25)])


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        save_snapshot(tmp_path, make_snapshot(1), keep=0)


def test_higher_step_files_are_not_pruned(tmp_path: Path) -> None:
    save_snapshot(tmp_path, make_snapshot(50))
    save_snapshot(tmp_path, make_snapshot(10), keep=1)
    assert steps_in(tmp_path) == [10, 50]


def flip_one_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,reason",
    [
        ("truncate", "size mismatch"),
        ("bit_flip", "checksum mismatch"),
        ("empty", "size mismatch"),
        ("data_gone", "missing file"),
        ("manifest_garbage", "manifest is not JSON"),
        ("manifest_lies", "does not load"),
    ],
)
def test_damaged_newest_is_skipped_with_the_reason(
    tmp_path: Path, damage: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    save_snapshot(tmp_path, make_snapshot(10))
    newest = save_snapshot(tmp_path, make_snapshot(20))
    data_path, manifest_path = tmp_path / newest.file, tmp_path / manifest_name(20)
    if damage == "truncate":
        data_path.write_bytes(data_path.read_bytes()[:-100])
    elif damage == "bit_flip":
        flip_one_bit(data_path)
    elif damage == "empty":
        data_path.write_bytes(b"")
    elif damage == "data_gone":
        data_path.unlink()
    elif damage == "manifest_garbage":
        manifest_path.write_bytes(b"{half a manif")
    else:  # a manifest that matches bytes that are not a snapshot
        junk = os.urandom(4096)
        data_path.write_bytes(junk)
        fields = json.loads(manifest_path.read_bytes())
        fields.update(size=len(junk), sha256=hashlib.sha256(junk).hexdigest())
        manifest_path.write_text(json.dumps(fields))
    with caplog.at_level(logging.WARNING):
        loaded, skipped = load(tmp_path)
    assert loaded is not None and loaded.step == 10
    assert [step for step, _ in skipped] == [20]
    assert reason in skipped[0][1]
    assert "step 20" in caplog.text


def test_a_data_file_without_manifest_does_not_exist(tmp_path: Path) -> None:
    save_snapshot(tmp_path, make_snapshot(10))
    newest = save_snapshot(tmp_path, make_snapshot(20))
    (tmp_path / manifest_name(20)).unlink()
    loaded, skipped = load(tmp_path)
    assert loaded is not None and loaded.step == 10 and skipped == []
    assert (tmp_path / newest.file).exists()
    save_snapshot(tmp_path, make_snapshot(30))  # the orphan below the new step goes
    assert not (tmp_path / newest.file).exists()


def test_nothing_to_load(tmp_path: Path) -> None:
    assert load_latest_snapshot(tmp_path / "missing") is None
    assert load_latest_snapshot(tmp_path) is None
    (tmp_path / "snapshot-000000001.pt").write_bytes(b"junk")  # the old format: no manifest
    assert load_latest_snapshot(tmp_path) is None


def test_manifest_rejects_what_is_not_one() -> None:
    good = Manifest(1, 0, 0, 1, "snapshot-000000001-0123abcd.pt", 10, "a" * 64, "t")
    assert Manifest.from_json(good.to_json()) == good
    for bad in (b"[]", b'{"format": 99}', good.to_json().replace(b"0123abcd", b"../../x")):
        with pytest.raises(ValueError):
            Manifest.from_json(bad)


def test_the_manifest_file_keeps_its_size_key() -> None:
    """Manifests written before and after ``Manifest.size_bytes`` read the same."""
    manifest = Manifest(1, 0, 0, 1, "snapshot-000000001-0123abcd.pt", 10, "a" * 64, "t")
    stored = json.loads(manifest.to_json())
    assert stored["size"] == 10 and "size_bytes" not in stored
    assert Manifest.from_json(json.dumps(stored).encode()).size_bytes == 10


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_crash_leftovers_are_ignored_then_cleaned(tmp_path: Path) -> None:
    save_snapshot(tmp_path, make_snapshot(10))
    host = storage_module._host_tag()
    name = "snapshot-000000020-0123abcd.pt"
    by_dead_writer = tmp_path / f".{name}.{host}.{dead_pid()}.ab12cd34.tmp"
    by_dead_writer.write_bytes(b"half a snapshot")
    too_old = tmp_path / f".{name}.otherhost.123.ab12cd34.tmp"
    too_old.write_bytes(b"half a snapshot")
    old = time.time() - storage_module.STALE_TMP_AGE_S - 60
    os.utime(too_old, (old, old))
    in_flight = tmp_path / f".{name}.{host}.{os.getppid()}.ab12cd34.tmp"
    in_flight.write_bytes(b"being written by a live process")

    loaded, _ = load(tmp_path)
    assert loaded is not None and loaded.step == 10

    save_snapshot(tmp_path, make_snapshot(11))
    assert not by_dead_writer.exists()
    assert not too_old.exists()
    assert in_flight.exists()


def test_a_scripts_own_files_beside_the_snapshots_are_left_alone(tmp_path: Path) -> None:
    # The job's snapshot directory is also a script job's default working directory.
    own = {
        "snapshot.pt": b"the script's own checkpoint",
        "snapshot-latest.json": b"{}",
        "snapshot-000000005.json.bak": b"{}",
        "snapshot-000000005-0123abcd.pt.old": b"x",
        "metrics.jsonl": b"{}",
        ".cache.tmp": b"a script's hidden temporary",
        ".notes.host.1.tmp": b"three dots, no token",
    }
    for name, data in own.items():
        (tmp_path / name).write_bytes(data)
    old = time.time() - storage_module.STALE_TMP_AGE_S - 60
    for name in (".cache.tmp", ".notes.host.1.tmp"):
        os.utime(tmp_path / name, (old, old))

    assert load(tmp_path) == (None, [])
    for step in (10, 20, 30):
        save_snapshot(tmp_path, make_snapshot(step), keep=1)
    loaded, skipped = load(tmp_path)
    assert loaded is not None and loaded.step == 30 and skipped == []
    assert steps_in(tmp_path) == [30]
    for name, data in own.items():
        assert (tmp_path / name).read_bytes() == data, name


def test_failed_write_leaves_previous_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = save_snapshot(tmp_path, make_snapshot(10))

    def broken_save(obj: object, handle: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_module.torch, "save", broken_save)
    with pytest.raises(OSError, match="No space"):
        save_snapshot(tmp_path, make_snapshot(20))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.file, manifest_name(10)])
    loaded, _ = load(tmp_path)
    assert loaded is not None and loaded.step == 10


CRASH_AT = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from tests.worker.helpers import make_snapshot
from worker.runtime.snapshot import save_snapshot

def fault(point, step):
    if point == {point!r}:
        os.kill(os.getpid(), signal.SIGKILL)

save_snapshot({directory!r}, make_snapshot(20), fault=fault)
"""


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_a_writer_killed_at_any_point_leaves_the_previous_snapshot(
    tmp_path: Path, point: str
) -> None:
    save_snapshot(tmp_path, make_snapshot(10))
    repo = str(Path(__file__).resolve().parents[2])
    script = CRASH_AT.format(repo=repo, point=point, directory=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert steps_in(tmp_path) == [10]
    loaded, skipped = load(tmp_path)
    assert loaded is not None and loaded.step == 10 and skipped == []
    save_snapshot(tmp_path, make_snapshot(30))  # the next save cleans up after the crash
    names = [p.name for p in tmp_path.iterdir()]
    assert not [n for n in names if n.startswith(".")], names
    assert not [n for n in names if n.startswith("snapshot-000000020")], names


def test_fsspec_location_round_trips_and_falls_back() -> None:
    url = f"memory://relaunch-test-{uuid.uuid4().hex}/job-1"
    save_snapshot(url, make_snapshot(10))
    newest = save_snapshot(url, make_snapshot(20))
    save_snapshot(url, make_snapshot(30), keep=2)
    assert steps_in(url) == [20, 30]
    storage = storage_module.open_storage(url)
    assert isinstance(storage, storage_module.FsspecStorage)
    assert newest.file in storage.names()
    latest = list_snapshots(url)[-1][1]
    storage.fs.pipe_file(f"{storage.root}/{latest.file}", b"overwritten")
    loaded, skipped = load(url)
    assert loaded is not None and loaded.step == 20
    assert skipped and "size mismatch" in skipped[0][1]


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
        TrainingState.from_payload(payload)


def test_host_tag_keeps_temp_names_parseable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage_module.socket, "gethostname", lambda: "node-1.example.org")
    assert storage_module._host_tag() == "node-1_example_org"
