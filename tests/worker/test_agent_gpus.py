"""The agent offers its GPUs and cores when it registers, reports the GPUs' use in every
heartbeat, and holds an attempt to the GPUs it offers (a faked NVML, a scripted client)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import SecretStr

from contract.protocol import (
    Assignment,
    AttemptReport,
    Entrypoint,
    GpuInfo,
    GpuUsage,
    Heartbeat,
    HeartbeatReply,
    NodeRegister,
    NodeRegistered,
    ReportAccepted,
)
from tests.worker.fake_nvml import FakeNvml, four_gpus
from tests.worker.helpers import an_assignment
from worker import agent as agent_module
from worker import gpus
from worker.agent import NodeAgent, run_agent
from worker.client import ControllerClient
from worker.settings import AgentSettings

GiB = 2**30


class RecordingClient(ControllerClient):
    """Keeps what the agent sends, as the controller would parse it (JSON and back)."""

    def __init__(self, assignments: list[Assignment] | None = None) -> None:
        super().__init__("http://unused.invalid", "enrolment-secret")
        self.registrations: list[NodeRegister] = []
        self.heartbeats: list[Heartbeat] = []
        self.reports: list[AttemptReport] = []
        self.assignments = assignments or []

    def register(self, body: NodeRegister) -> NodeRegistered:
        self.registrations.append(NodeRegister.model_validate_json(body.model_dump_json()))
        return NodeRegistered(node_id=7, heartbeat_interval_s=2.0, node_token="rln_seven")

    def heartbeat(self, node_id: int, body: Heartbeat) -> HeartbeatReply:
        self.heartbeats.append(Heartbeat.model_validate_json(body.model_dump_json()))
        return HeartbeatReply(assignments=self.assignments)

    def report(self, node_id: int, body: AttemptReport) -> ReportAccepted:
        self.reports.append(body)
        return ReportAccepted(accepted=True)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _settings(tmp_path: Path, **fields: object) -> AgentSettings:
    return AgentSettings.model_validate(
        {
            "enrolment_token": SecretStr("t"),
            "controller_url": "http://c:1",
            "name": "gpu-node",
            "work_dir": tmp_path,
            "cpus": 96,
            **fields,
        }
    )


def test_registration_offers_the_gpus_and_cores_and_each_heartbeat_their_use(
    tmp_path: Path,
) -> None:
    nvml = FakeNvml(four_gpus())
    inventory = gpus.GpuInventory.open((0, 2, 3), nvml)
    client, clock = RecordingClient(), Clock()
    agent = NodeAgent(_settings(tmp_path), client, clock=clock, inventory=inventory)
    agent.step()  # registers
    agent.step()  # first heartbeat
    nvml.gpus[2].utilization = 99
    clock.now += 2.0
    agent.step()
    [registration] = client.registrations
    assert registration.cpus == 96
    assert registration.gpus == [
        GpuInfo(index=i, name="NVIDIA H100 80GB HBM3", uuid=f"GPU-{i}", memory_total_bytes=80 * GiB)
        for i in (0, 2, 3)
    ]
    assert (registration.gpu_driver, registration.cuda_version) == ("550.54.15", "12.4")
    first, second = client.heartbeats
    assert first.gpus == [
        GpuUsage(index=0, utilization_pct=0.0, memory_used_bytes=1 * GiB),
        GpuUsage(index=2, utilization_pct=20.0, memory_used_bytes=3 * GiB),
        GpuUsage(index=3, utilization_pct=30.0, memory_used_bytes=4 * GiB),
    ]
    assert second.gpus[1] == GpuUsage(index=2, utilization_pct=99.0, memory_used_bytes=3 * GiB)
    assert (nvml.inits, nvml.shutdowns) == (1, 0)  # started once, not per heartbeat


def test_a_gpu_that_fails_its_query_leaves_the_heartbeat_going(tmp_path: Path) -> None:
    nvml = FakeNvml(four_gpus())
    client = RecordingClient()
    agent = NodeAgent(
        _settings(tmp_path), client, clock=Clock(), inventory=gpus.GpuInventory.open(None, nvml)
    )
    agent.step()
    nvml.gpus[1].broken = {"utilization", "memory"}
    agent.step()
    [heartbeat] = client.heartbeats
    assert heartbeat.gpus[1] == GpuUsage(index=1)
    assert [u.utilization_pct for u in heartbeat.gpus] == [0.0, None, 20.0, 30.0]


def test_a_cpu_node_registers_its_cores_and_no_gpus(tmp_path: Path) -> None:
    client = RecordingClient()
    agent = NodeAgent(_settings(tmp_path, cpus=3), client, clock=Clock())
    agent.step()
    agent.step()
    [registration] = client.registrations
    assert (registration.cpus, registration.gpus, registration.gpu_driver) == (3, [], None)
    assert client.heartbeats[0].gpus == []


def test_an_assignment_of_gpus_the_node_does_not_offer_fails_and_is_reported(
    tmp_path: Path,
) -> None:
    unoffered = an_assignment(
        attempt_id=5,
        entrypoint=Entrypoint(module="unused"),
        snapshot_dir=str(tmp_path / "snapshots"),
        device="cuda",
        gpus=[1, 2],
    )
    client = RecordingClient([unoffered])
    inventory = gpus.GpuInventory.open((0, 1), FakeNvml([], missing=True))
    clock = Clock()
    agent = NodeAgent(_settings(tmp_path), client, clock=clock, inventory=inventory)
    agent.step()  # registers
    agent.step()  # the heartbeat's reply starts the attempt, which fails at once
    clock.now += 0.5
    agent.step()  # and reports it
    [report] = client.reports
    assert report.exit is not None and report.exit.outcome == "failed"
    assert report.exit.message == "cannot start: GPU(s) [2] are not among this node's GPUs (0,1)"


def test_an_agent_told_of_a_gpu_nvml_does_not_find_does_not_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml(four_gpus())
    monkeypatch.setattr(gpus, "load_nvml", lambda: nvml)

    def no_client(*args: object, **kwargs: object) -> None:
        raise AssertionError("the agent may not reach the controller")

    monkeypatch.setattr(agent_module, "ControllerClient", no_client)
    settings = _settings(tmp_path, gpus="1,5", isolation="none")
    with caplog.at_level(logging.ERROR, logger="worker.agent"):
        assert run_agent(settings) == 1
    assert "RELAUNCH_AGENT_GPUS names GPU(s) 5, but NVML finds 4 GPU(s)" in caplog.text
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


class _Reached(Exception):
    """The agent went on to reach the controller."""


def test_cuda_visible_devices_in_the_agents_environment_is_said_to_limit_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml(four_gpus())
    monkeypatch.setattr(gpus, "load_nvml", lambda: nvml)

    def reached(*args: object, **kwargs: object) -> None:
        raise _Reached

    monkeypatch.setattr(agent_module, "ControllerClient", reached)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with caplog.at_level(logging.WARNING, logger="worker.agent"), pytest.raises(_Reached):
        run_agent(_settings(tmp_path, isolation="none"))
    assert "CUDA_VISIBLE_DEVICES=1 in the agent's environment limits nothing" in caplog.text
    assert (nvml.inits, nvml.shutdowns) == (1, 1)  # shut down however the agent ends
