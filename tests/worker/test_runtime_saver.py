"""Asynchronous snapshots: off the training path, never doubled, failures that do not stop
training, and resuming mid-epoch by sample id at the same and at a new world size."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import ON_CPU, REPO_ROOT, subprocess_environ
from tests.worker.helpers import assert_same_state, final_state, make_snapshot, train
from worker.runtime import saver as saver_module
from worker.runtime.config import TrainerConfig
from worker.runtime.env import DistEnv
from worker.runtime.fence import SnapshotFenced
from worker.runtime.model_prep import seed_everything
from worker.runtime.saver import SnapshotSaver, copy_off
from worker.runtime.snapshot import Manifest, list_snapshots, load_latest_snapshot
from worker.runtime.state_capture import capture_state, restore_state
from worker.runtime.trainer import Trainer
from worker.tasks import regression


class Recorder:
    def __init__(self) -> None:
        self.saved: list[tuple[Manifest, bool]] = []
        self.failed: list[tuple[int, str]] = []

    def on_saved(self, manifest: Manifest, seconds: float, background: bool) -> None:
        self.saved.append((manifest, background))

    def on_failed(self, step: int, error: str) -> None:
        self.failed.append((step, error))


def test_copy_off_detaches_from_the_live_tensors() -> None:
    live = torch.nn.Linear(2, 2)
    copied = copy_off({"state": live.state_dict(), "list": [live.weight], "n": 3})
    with torch.no_grad():
        live.weight.add_(1.0)
    assert not torch.equal(copied["state"]["weight"], live.weight)
    assert not torch.equal(copied["list"][0], live.weight)
    assert copied["n"] == 3


def test_copy_off_keeps_the_structure_and_waits_for_no_gpu_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_cuda(*_: Any) -> None:
        raise AssertionError("a CPU-only state waited for a GPU")

    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    weight = torch.arange(6.0).reshape(2, 3).requires_grad_()
    strided = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    state = {"w": weight, "pair": (strided, "adam"), "steps": [torch.tensor(3), 7]}
    copied = copy_off(state)
    assert copied.keys() == state.keys() and isinstance(copied["pair"], tuple)
    assert copied["pair"][1] == "adam" and copied["steps"][1] == 7
    assert torch.equal(copied["w"], weight) and not copied["w"].requires_grad
    assert torch.equal(copied["pair"][0], strided)
    assert torch.equal(copied["steps"][0], torch.tensor(3))
    assert copied["w"].data_ptr() != weight.data_ptr()


def test_a_captured_state_waits_for_the_gpu_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor of the model, optimizer, scheduler and scaler is queued first, then
    one wait for the whole state (each tensor taken here for one on GPU 0)."""
    gpu = torch.device("cuda", 0)
    waits: list[torch.device] = []

    def as_if_on_the_gpu(tensor: torch.Tensor, devices: set[torch.device]) -> torch.Tensor:
        devices.add(gpu)
        return tensor.to("cpu", copy=True)

    monkeypatch.setattr(saver_module, "_copy_tensor", as_if_on_the_gpu)
    monkeypatch.setattr(torch.cuda, "synchronize", waits.append)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 2)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    snapshot = capture_state(
        model, optimizer, scheduler, scaler=scaler, step=1, epoch=0, samples_consumed=3,
        world_size=1, seed=0, device=torch.device("cpu"),
    )  # fmt: skip
    assert waits == [gpu]
    assert_same_state(snapshot.model_state, model.state_dict())
    assert snapshot.optimizer_state["state"][0]["step"] == 1
    assert snapshot.scheduler_state == scheduler.state_dict()
    assert snapshot.scaler_state == scaler.state_dict()


def test_a_save_due_while_one_is_in_flight_is_dropped_not_doubled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    writing = threading.Event()
    active = Counter[str]()
    real_save = saver_module.save_snapshot

    def slow_save(*args: Any, **kwargs: Any) -> Manifest:
        active["now"] += 1
        active["max"] = max(active["max"], active["now"])
        writing.set()
        release.wait(30)
        try:
            return real_save(*args, **kwargs)
        finally:
            active["now"] -= 1

    monkeypatch.setattr(saver_module, "save_snapshot", slow_save)
    record = Recorder()
    saver = SnapshotSaver(tmp_path, keep=3, on_saved=record.on_saved)
    assert saver.submit(make_snapshot(10))
    assert writing.wait(30) and saver.in_flight
    assert not saver.submit(make_snapshot(20))
    assert saver.dropped == 1
    assert saver.drop_if_busy(25), "the trainer's check before it copies the state"
    assert saver.dropped == 2
    release.set()
    saver.wait()
    assert not saver.drop_if_busy(30)
    assert saver.submit(make_snapshot(30))
    saver.wait()
    assert active["max"] == 1
    assert [m.step for m, background in record.saved] == [10, 30]
    assert all(background for _, background in record.saved)
    assert [step for step, _ in list_snapshots(tmp_path)] == [10, 30]


@pytest.mark.parametrize("background", [True, False])
def test_an_io_error_is_reported_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    record = Recorder()
    saver = SnapshotSaver(
        tmp_path,
        keep=2,
        background=background,
        on_saved=record.on_saved,
        on_failed=record.on_failed,
    )
    saver.submit(make_snapshot(10))
    saver.wait()

    def full_disk(obj: object, handle: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("worker.runtime.snapshot.torch.save", full_disk)
    saver.submit(make_snapshot(20))
    saver.wait()  # does not raise
    assert record.failed and record.failed[0][0] == 20 and "No space" in record.failed[0][1]
    found = load_latest_snapshot(tmp_path)
    assert found is not None and found[0].step == 10


def test_a_fenced_background_save_is_raised_in_the_training_thread(tmp_path: Path) -> None:
    def fenced() -> None:
        raise SnapshotFenced("a newer rank 0 owns the snapshots")

    saver = SnapshotSaver(tmp_path, keep=2, before_commit=fenced)
    saver.submit(make_snapshot(10))
    with pytest.raises(SnapshotFenced):
        saver.wait()
    assert list_snapshots(tmp_path) == []


def test_amp_grad_scaler_state_is_kept() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    scaler.scale(model(torch.randn(3, 2)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    snapshot = capture_state(
        model, optimizer, None, scaler=scaler, step=1, epoch=0, samples_consumed=3,
        world_size=1, seed=0, device=torch.device("cpu"),
    )  # fmt: skip
    fresh = torch.amp.GradScaler("cpu")
    restore_state(snapshot, model, optimizer, None, torch.device("cpu"), fresh)
    assert fresh.state_dict() == scaler.state_dict()
    assert fresh.get_scale() == scaler.get_scale()


def test_background_snapshots_do_not_change_what_is_trained(
    tmp_path: Path, read_events: Callable[[Path], list[dict[str, Any]]]
) -> None:
    synchronous = train(tmp_path / "sync", snapshot_every_steps=2, snapshot_background=False)
    events = tmp_path / "events.jsonl"
    background = train(tmp_path / "async", events, snapshot_every_steps=2, snapshot_background=True)
    assert_same_state(final_state(background), final_state(synchronous))
    saved = [e["data"] for e in read_events(events) if e["kind"] == "snapshot"]
    assert saved and saved[-1]["step"] == 24
    assert any(s["background"] for s in saved)
    for s in saved:
        assert len(s["sha256"]) == 64 and s["bytes"] > 0 and s["world_size"] == 1


def test_a_full_disk_leaves_training_going(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    read_events: Callable[[Path], list[dict[str, Any]]],
) -> None:
    real_save = torch.save
    calls = Counter[str]()

    def fails_after_two(obj: object, handle: Any) -> None:
        calls["n"] += 1
        if 2 < calls["n"] < 6:
            raise OSError(28, "No space left on device")
        real_save(obj, handle)

    monkeypatch.setattr("worker.runtime.snapshot.torch.save", fails_after_two)
    events = tmp_path / "events.jsonl"
    result = train(tmp_path / "s", events, snapshot_every_steps=2, snapshot_background=False)
    assert result.finished and result.step == 24
    log = read_events(events)
    failed = [e["data"] for e in log if e["kind"] == "snapshot_failed"]
    assert [f["step"] for f in failed] == [6, 8, 10]
    assert all("No space left" in f["error"] for f in failed)
    assert [e["data"]["step"] for e in log if e["kind"] == "snapshot"][:3] == [2, 4, 12]


def read_seen(out: Path) -> list[tuple[int, int]]:
    seen = []
    for path in sorted(out.glob("rank-*.jsonl")):
        seen.extend(tuple(json.loads(line)) for line in path.read_text().splitlines())
    return seen  # type: ignore[return-value]


SAMPLE_IDS_JOB = REPO_ROOT / "tests" / "worker" / "sample_ids_job.py"


def run_sample_ids_job(nproc: int, out: Path, snapshots: Path, *extra: str) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(SAMPLE_IDS_JOB), "--out", str(out),
        "--snapshots", str(snapshots), *extra,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, env={**subprocess_environ(), **ON_CPU}, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@dataclass(frozen=True)
class StoppedRun:
    """The samples two ranks trained on before they stopped after step 15, and the
    snapshots they left."""

    seen: list[tuple[int, int]]
    snapshots: Path


@pytest.fixture(scope="module")
def stopped_after_step_15(tmp_path_factory: pytest.TempPathFactory) -> StoppedRun:
    """The first half of each resume below is the same run: made once, its snapshots
    copied for each resume, which adds its own."""
    root = tmp_path_factory.mktemp("stopped")
    run_sample_ids_job(2, root / "first", root / "snapshots", "--stop-after-steps", "15")
    return StoppedRun(read_seen(root / "first"), root / "snapshots")


@pytest.mark.parametrize("resume_world", [2, 3])
def test_resuming_mid_epoch_neither_skips_nor_repeats_a_sample(
    tmp_path: Path, stopped_after_step_15: StoppedRun, resume_world: int
) -> None:
    """96 samples, batches of 4. Two ranks stop after step 15: 12 steps make epoch 0,
    3 steps (24 samples) of epoch 1 are done. The resumed run, at 2 or 3 ranks, must
    see the other 72 samples of epoch 1 exactly once, then all of epoch 2."""
    snapshots, second = tmp_path / "snapshots", tmp_path / "second"
    shutil.copytree(stopped_after_step_15.snapshots, snapshots)
    before = stopped_after_step_15.seen
    assert Counter(epoch for epoch, _ in before) == {0: 96, 1: 24}
    run_sample_ids_job(resume_world, second, snapshots)
    after = read_seen(second)
    assert {epoch for epoch, _ in after} == {1, 2}
    epoch1 = [s for e, s in before if e == 1] + [s for e, s in after if e == 1]
    assert sorted(epoch1) == list(range(96)), "each sample of the interrupted epoch once"
    assert sorted(s for e, s in after if e == 2) == list(range(96))
    assert sorted(s for e, s in before if e == 0) == list(range(96))


def test_a_resumed_trainer_restores_its_grad_scaler(tmp_path: Path) -> None:
    def trainer(scaler: torch.amp.GradScaler, **overrides: Any) -> Trainer:
        seed_everything(3)
        dataset, _, _ = regression.make_dataset(64, features=4, noise=0.1)
        config = TrainerConfig(
            max_epochs=2, batch_size=8, lr=0.05, seed=3, snapshot_dir=str(tmp_path),
            snapshot_background=False, **overrides,
        )  # fmt: skip
        return Trainer(
            nn.Linear(4, 1),
            lambda ps: torch.optim.SGD(ps, lr=0.05),
            dataset,
            nn.functional.mse_loss,
            config,
            DistEnv(device="cpu"),
            grad_scaler=scaler,
        )

    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    assert trainer(scaler).train().finished
    saved = scaler.state_dict()
    assert saved["scale"] != 256.0  # it grew while training
    fresh = torch.amp.GradScaler("cpu")
    resumed = trainer(fresh)
    assert resumed.resumed_from_step == 16
    assert fresh.state_dict() == saved
    assert resumed.train().step == 16  # nothing left to train; ends the process group
