"""The device a worker was placed for, and the check that each local rank has a GPU."""

from __future__ import annotations

import pytest

from worker.runtime.devices import (
    DeviceShortage,
    check_device_count,
    check_visible_devices,
    requested_device,
)


def _never_counted() -> int:
    raise AssertionError("devices were counted where no CUDA was asked for")


@pytest.mark.parametrize(
    ("environ", "device"),
    [({}, None), ({"RELAUNCH_DEVICE": " "}, None), ({"RELAUNCH_DEVICE": "cpu"}, "cpu"),
     ({"RELAUNCH_DEVICE": "cuda"}, "cuda")],
)  # fmt: skip
def test_the_requested_device_is_cpu_cuda_or_unsaid(
    environ: dict[str, str], device: str | None
) -> None:
    assert requested_device(environ) == device


@pytest.mark.parametrize("value", ["CUDA", "gpu", "cuda:0"])
def test_any_other_device_is_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match="RELAUNCH_DEVICE"):
        requested_device({"RELAUNCH_DEVICE": value})


@pytest.mark.parametrize("environ", [{}, {"RELAUNCH_DEVICE": "cpu", "LOCAL_WORLD_SIZE": "8"}])
def test_no_cuda_asked_for_counts_no_devices(environ: dict[str, str]) -> None:
    check_visible_devices(environ, _never_counted)


def test_one_gpu_per_local_rank_passes() -> None:
    environ = {"RELAUNCH_DEVICE": "cuda", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "3,5"}
    check_visible_devices(environ, lambda: 2)
    check_visible_devices({"RELAUNCH_DEVICE": "cuda"}, lambda: 1)  # one rank where unset


def test_fewer_gpus_than_local_ranks_is_a_shortage_that_says_what_it_saw() -> None:
    environ = {"RELAUNCH_DEVICE": "cuda", "LOCAL_WORLD_SIZE": "3", "CUDA_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(DeviceShortage) as raised:
        check_visible_devices(environ, lambda: 2)
    message = str(raised.value)
    assert "2 CUDA device(s) visible" in message
    assert "CUDA_VISIBLE_DEVICES='0,1'" in message
    assert "3 local rank(s) need one each" in message


def test_a_shortage_without_cuda_visible_devices_says_it_was_unset() -> None:
    with pytest.raises(DeviceShortage) as raised:
        check_device_count(0, 1, {})
    assert "0 CUDA device(s) visible (CUDA_VISIBLE_DEVICES=unset)" in str(raised.value)


def test_a_bad_local_world_size_is_named() -> None:
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        check_visible_devices({"RELAUNCH_DEVICE": "cuda", "LOCAL_WORLD_SIZE": "two"}, lambda: 2)
