"""The node's GPU inventory through a faked NVML, RELAUNCH_AGENT_GPUS/CPUS, and the rules that
give an attempt's workers their device and thread count."""

from __future__ import annotations

import ctypes.util
import logging
import os

import pytest
from pydantic import SecretStr, ValidationError

from contract.protocol import GpuInfo, GpuUsage
from tests.worker.fake_nvml import FakeGpu, FakeNvml, four_gpus
from tests.worker.helpers import an_assignment
from worker.gpus import (
    GpuInventory,
    cuda_version_text,
    device_refusal,
    device_variables,
    load_nvml,
    threads_per_worker,
)
from worker.settings import AgentSettings

GiB = 2**30
TOKEN = SecretStr("t")


def test_nvml_finds_each_gpus_model_uuid_and_memory_and_the_drivers_versions() -> None:
    nvml = FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(name=b"NVIDIA A100-SXM4-40GB", uuid="GPU-b")])
    nvml.gpus[1].memory_total = 40 * GiB
    inventory = GpuInventory.open(None, nvml)
    assert inventory.gpus == (
        GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-a", memory_total_bytes=80 * GiB),
        GpuInfo(index=1, name="NVIDIA A100-SXM4-40GB", uuid="GPU-b", memory_total_bytes=40 * GiB),
    )
    assert (inventory.driver, inventory.cuda_version) == ("550.54.15", "12.4")
    assert inventory.indices == (0, 1)


def test_cuda_versions_read_as_cuda_writes_them() -> None:
    assert [cuda_version_text(v) for v in (12040, 11080, 12000, 13010)] == [
        "12.4",
        "11.8",
        "12.0",
        "13.1",
    ]


def test_each_heartbeat_reads_the_gpus_use_with_nvml_started_once() -> None:
    nvml = FakeNvml(four_gpus())
    inventory = GpuInventory.open(None, nvml)
    first = inventory.usage()
    nvml.gpus[2].utilization = 95
    second = inventory.usage()
    assert first == [
        GpuUsage(index=i, utilization_pct=10.0 * i, memory_used_bytes=(i + 1) * GiB)
        for i in range(4)
    ]
    assert second[2].utilization_pct == 95.0
    assert (nvml.inits, nvml.shutdowns) == (1, 0)
    inventory.close()
    inventory.close()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)
    assert inventory.usage() == [GpuUsage(index=i) for i in range(4)]  # unknown once closed


def test_a_gpu_nvml_cannot_read_gives_unknown_use_for_that_gpu_only_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = FakeNvml(four_gpus())
    inventory = GpuInventory.open(None, nvml)
    nvml.gpus[1].broken = {"utilization", "memory"}
    nvml.gpus[3].broken = {"utilization"}
    with caplog.at_level(logging.INFO, logger="worker.gpus"):
        usage = inventory.usage()
        inventory.usage()
        nvml.gpus[1].broken = set()
        recovered = inventory.usage()
    assert usage[0] == GpuUsage(index=0, utilization_pct=0.0, memory_used_bytes=GiB)
    assert usage[1] == GpuUsage(index=1)
    assert usage[3] == GpuUsage(index=3, utilization_pct=None, memory_used_bytes=4 * GiB)
    assert recovered[1] == GpuUsage(index=1, utilization_pct=10.0, memory_used_bytes=2 * GiB)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("GPU 1: NVML cannot read" in m for m in messages) == 1
    assert sum("GPU 3: NVML cannot read" in m for m in messages) == 1
    assert "GPU 1: NVML reads its use again" in messages


def test_a_detail_nvml_cannot_tell_is_unknown_and_a_gpu_it_cannot_open_is_left_out() -> None:
    nvml = FakeNvml(four_gpus())
    nvml.gpus[0].broken = {"name", "uuid", "memory"}
    nvml.gpus[2].broken = {"handle"}
    inventory = GpuInventory.open(None, nvml)
    assert inventory.indices == (0, 1, 3)  # NVML's indices, not renumbered
    assert inventory.gpus[0] == GpuInfo(index=0)
    assert [u.index for u in inventory.usage()] == [0, 1, 3]


@pytest.mark.parametrize("nvml", [None, FakeNvml([], missing=True)], ids=["no-pynvml", "no-lib"])
def test_without_nvml_a_node_has_no_gpus_and_says_so_once(
    nvml: FakeNvml | None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="worker.gpus"):
        inventory = GpuInventory.open(None, nvml)
        assert inventory.usage() == []
    assert (inventory.gpus, inventory.driver, inventory.cuda_version) == ((), None, None)
    assert [(r.levelname, r.getMessage()[:11]) for r in caplog.records] == [("INFO", "GPUs: none ")]


def test_the_real_pynvml_opens_without_raising_and_finds_none_without_a_driver() -> None:
    nvml = load_nvml()
    assert nvml is not None  # nvidia-ml-py is a dependency of the agent
    inventory = GpuInventory.open(None, nvml)
    try:
        if ctypes.util.find_library("nvidia-ml") is None:
            assert (inventory.gpus, inventory.driver) == ((), None)
        else:
            assert inventory.driver is not None  # the driver answers NVML
    finally:
        inventory.close()


def test_a_node_whose_nvml_cannot_count_has_no_gpus_and_nvml_is_shut_down() -> None:
    nvml = FakeNvml(four_gpus())
    nvml.count_fails = True
    assert GpuInventory.open(None, nvml).gpus == ()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_none_offers_no_gpu_without_asking_nvml() -> None:
    nvml = FakeNvml(four_gpus())
    inventory = GpuInventory.open((), nvml)
    assert (inventory.gpus, inventory.usage(), nvml.inits) == ((), [], 0)


def test_a_list_offers_those_gpus_only() -> None:
    nvml = FakeNvml(four_gpus())
    inventory = GpuInventory.open((1, 3), nvml)
    assert [(g.index, g.uuid) for g in inventory.gpus] == [(1, "GPU-1"), (3, "GPU-3")]
    assert [(u.index, u.memory_used_bytes) for u in inventory.usage()] == [
        (1, 2 * GiB),
        (3, 4 * GiB),
    ]


def test_a_listed_gpu_that_nvml_does_not_find_stops_the_agent() -> None:
    nvml = FakeNvml(four_gpus())
    with pytest.raises(ValueError, match=r"names GPU\(s\) 4,7, but NVML finds 4 GPU"):
        GpuInventory.open((0, 4, 7), nvml)
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_without_nvml_listed_gpus_are_trusted_as_of_unknown_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="worker.gpus"):
        inventory = GpuInventory.open((0, 1), FakeNvml([], missing=True))
    assert inventory.gpus == (GpuInfo(index=0), GpuInfo(index=1))
    assert inventory.gpus[0].name == "" and inventory.gpus[0].memory_total_bytes is None
    assert inventory.usage() == [GpuUsage(index=0), GpuUsage(index=1)]
    assert "of unknown model" in caplog.text


@pytest.mark.parametrize(
    ("value", "selection"),
    [("none", ()), (" None ", ()), ("2,0", (0, 2)), ("3", (3,)), (" 1 , 2 ", (1, 2)), ("", None)],
)
def test_relaunch_agent_gpus_selects(
    value: str, selection: tuple[int, ...] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAUNCH_AGENT_GPUS", value)
    assert AgentSettings(enrolment_token=TOKEN).gpus == selection


def test_relaunch_agent_gpus_unset_finds_every_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELAUNCH_AGENT_GPUS", raising=False)
    assert AgentSettings(enrolment_token=TOKEN).gpus is None


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("all", "expected 'none' or GPU indices"),
        ("0,x", "expected 'none' or GPU indices"),
        ("-1", "expected 'none' or GPU indices"),
        ("0,,1", "expected 'none' or GPU indices"),
        ("1.5", "expected 'none' or GPU indices"),
        ("1,1", "must be distinct"),
        ("64", "beyond the 64"),
    ],
)
def test_a_bad_relaunch_agent_gpus_is_a_settings_error(
    value: str, error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAUNCH_AGENT_GPUS", value)
    with pytest.raises(ValidationError, match=error):
        AgentSettings(enrolment_token=TOKEN)


def test_relaunch_agent_cpus_defaults_to_the_cores_the_agent_may_run_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RELAUNCH_AGENT_CPUS", raising=False)
    assert AgentSettings(enrolment_token=TOKEN).cpus == len(os.sched_getaffinity(0))
    monkeypatch.setenv("RELAUNCH_AGENT_CPUS", "12")
    assert AgentSettings(enrolment_token=TOKEN).cpus == 12
    monkeypatch.setenv("RELAUNCH_AGENT_CPUS", "0")
    with pytest.raises(ValidationError, match="cpus"):
        AgentSettings(enrolment_token=TOKEN)


@pytest.mark.parametrize(
    ("cpus", "nproc", "device", "attempt_gpus", "node_gpus", "threads"),
    [
        (32, 1, "cpu", 0, 0, 32),  # a CPU attempt has the node
        (32, 4, "cpu", 0, 8, 8),  # ... a GPU node too
        (32, 3, "cpu", 0, 0, 10),
        (2, 4, "cpu", 0, 0, 1),  # never less than one
        (64, 2, "cuda", 2, 8, 8),  # 2 of 8 GPUs: 16 cores, 8 per worker
        (64, 8, "cuda", 8, 8, 8),
        (64, 1, "cuda", 1, 8, 8),
        (12, 2, "cuda", 2, 3, 4),
        (4, 1, "cuda", 1, 8, 1),
        (16, 2, "cuda", 2, 0, 8),  # no inventory to share by: the node's cores
    ],
)  # fmt: skip
def test_each_worker_gets_its_share_of_the_cores(
    cpus: int, nproc: int, device: str, attempt_gpus: int, node_gpus: int, threads: int
) -> None:
    got = threads_per_worker(
        cpus=cpus,
        nproc_per_node=nproc,
        device="cuda" if device == "cuda" else "cpu",
        attempt_gpus=attempt_gpus,
        node_gpus=node_gpus,
    )
    assert got == threads


def test_a_gpu_attempt_sees_its_gpus_in_nvmls_order() -> None:
    variables = device_variables(an_assignment(device="cuda", gpus=[5, 2]), cpus=64, node_gpus=8)
    assert variables == {
        "RELAUNCH_DEVICE": "cuda",
        "CUDA_VISIBLE_DEVICES": "5,2",  # local rank 0 on GPU 5, local rank 1 on GPU 2
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "OMP_NUM_THREADS": "8",
    }


def test_a_cpu_attempt_sees_no_gpu() -> None:
    variables = device_variables(an_assignment(nproc_per_node=4), cpus=64, node_gpus=8)
    assert variables == {
        "RELAUNCH_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "OMP_NUM_THREADS": "16",
    }


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        ({"device": "cuda", "gpus": [0, 1]}, None),
        ({"device": "cpu"}, None),
        ({"device": "cuda", "gpus": [0]}, "2 process(es) per node was given 1 GPU(s)"),
        ({"device": "cuda", "gpus": [1, 1]}, "one GPU twice"),
        ({"device": "cuda", "gpus": [0, 4]}, "GPU(s) [4] are not among this node's GPUs (0,1,2,3)"),
        ({"device": "cpu", "gpus": [0, 1]}, "a CPU attempt was given GPUs"),
    ],
)
def test_a_gpu_attempt_must_hold_this_nodes_gpus_one_per_local_rank(
    fields: dict[str, object], refusal: str | None
) -> None:
    got = device_refusal(an_assignment(**fields), [0, 1, 2, 3])
    if refusal is None:
        assert got is None
    else:
        assert got is not None and refusal in got


def test_a_gpu_attempt_on_a_node_without_gpus_is_refused() -> None:
    got = device_refusal(an_assignment(device="cuda", gpus=[0, 1]), [])
    assert got == "GPU(s) [0, 1] are not among this node's GPUs (none)"
