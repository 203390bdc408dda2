"""The runtime on a CUDA GPU: the device rule, the pinned copy off the GPU, and a one-rank
Trainer (NCCL, ``cuda:0``) that snapshots and resumes. Skipped where torch sees no GPU
(see ``tests/conftest.py``); run them with ``pytest -m gpu`` on a GPU host."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.helpers import train
from worker.runtime.devices import DeviceShortage
from worker.runtime.env import DistEnv, device_for
from worker.runtime.saver import copy_off
from worker.runtime.snapshot import list_snapshots, load_latest_snapshot, manifest_name

pytestmark = pytest.mark.gpu


def test_device_for_honours_relaunch_device() -> None:
    assert device_for(DistEnv.from_environ({"RELAUNCH_DEVICE": "cuda"})) == torch.device("cuda", 0)
    assert device_for(DistEnv.from_environ({"RELAUNCH_DEVICE": "cpu"})) == torch.device("cpu")
    assert device_for(DistEnv.from_environ({})) == torch.device("cuda", 0)  # unset: CUDA here
    ranks = str(torch.cuda.device_count() + 1)
    one_too_many = {
        "WORLD_SIZE": ranks, "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": ranks,
        "RELAUNCH_DEVICE": "cuda",
    }  # fmt: skip
    with pytest.raises(DeviceShortage, match=f"{ranks} local rank"):
        device_for(DistEnv.from_environ(one_too_many))


def test_the_pinned_copy_off_the_gpu_is_complete_and_equal_when_it_returns() -> None:
    expected = torch.randn(2048, 2048)
    live = expected.to("cuda")
    torch.cuda._sleep(100_000_000)  # the stream is busy a while: the copies queue behind it
    live.add_(1.0)
    half = torch.randn(64, 32, device="cuda").half()
    strided = torch.randn(16, 8, device="cuda").t()
    state = {"w": live, "more": [(half, "adam"), strided], "cpu": torch.arange(4), "n": 3}
    copied = copy_off(state)
    # Read at once, with no other wait: copy_off itself waited for the copies.
    assert torch.equal(copied["w"], expected + 1.0)
    assert copied["w"].device.type == "cpu" and copied["w"].is_pinned()
    (half_copy, name), strided_copy = copied["more"]
    assert name == "adam" and half_copy.dtype == torch.float16
    assert torch.equal(half_copy, half.cpu()) and torch.equal(strided_copy, strided.cpu())
    assert torch.equal(copied["cpu"], torch.arange(4)) and copied["n"] == 3
    live.add_(1.0)  # training goes on: the copy keeps what it took
    torch.cuda.synchronize()
    assert torch.equal(copied["w"], expected + 1.0)


def test_a_one_rank_trainer_on_cuda_snapshots_and_resumes(
    tmp_path: Path, read_events: Callable[[Path], list[dict[str, Any]]]
) -> None:
    events = tmp_path / "events.jsonl"
    # Saves in the training thread, so that none is dropped while one is in flight; the
    # copy off the GPU (capture_state) is the same in either mode.
    stopped = train(
        tmp_path, events, device="cuda", snapshot_every_steps=4, stop_after_steps=11,
        snapshot_background=False,
    )  # fmt: skip
    assert not stopped.finished and stopped.step == 11
    assert [s for s, _ in list_snapshots(tmp_path)] == [8, 11]
    (tmp_path / manifest_name(11)).unlink()  # as if it crashed before step 11's save
    found = load_latest_snapshot(tmp_path)
    assert found is not None
    snapshot = found[0]
    assert snapshot.step == 8
    weights = [t for t in snapshot.model_state.values() if t.is_floating_point()]
    assert weights and all(t.device.type == "cpu" for t in weights)
    assert snapshot.rng.torch_cuda is not None  # the GPU's generator is kept too

    resumed = train(tmp_path, events, device="cuda", snapshot_every_steps=4)
    assert resumed.finished and resumed.step == 24
    assert resumed.loss is not None and math.isfinite(resumed.loss)
    started = [e["data"] for e in read_events(events) if e["kind"] == "started"]
    assert [s["resumed_from_step"] for s in started] == [None, 8]
    assert resumed.output_path is not None
    final = torch.load(resumed.output_path, weights_only=True)
    assert all(t.device.type == "cpu" for t in final.values())
