"""What an attempt's launcher and workers are given of the node's devices: RELAUNCH_DEVICE,
CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER (the agent's, whatever the job's env says) and
OMP_NUM_THREADS (the job's if it sets it), and the warm starts that keep working with them."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from contract.protocol import Assignment
from tests.worker.helpers import an_assignment
from worker import attempt as attempt_module
from worker.attempt import Attempt, build_launcher_env
from worker.sandbox import job_env_overlay, merge_worker_env
from worker.settings import AgentSettings
from worker.warm import cold_start_reason

JOB_ASKS = {
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    "CUDA_DEVICE_ORDER": "FASTEST_FIRST",
    "RELAUNCH_DEVICE": "cuda",
}


def _settings(tmp_path: Path, cpus: int = 32) -> AgentSettings:
    return AgentSettings(
        enrolment_token=SecretStr("t"),
        controller_url="http://c:1",
        name="node-a",
        work_dir=tmp_path / "agent",
        cpus=cpus,
        isolation="none",
    )


def _envs(
    assignment: Assignment, tmp_path: Path, node_gpus: int, base: dict[str, str] | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """The workers' and the launcher's environments, built as ``Attempt.start`` builds them."""
    settings = _settings(tmp_path)
    built = [
        build_launcher_env(
            a,
            settings=settings,
            events_file=tmp_path / "e",
            base_env=base or {"PATH": "/bin"},
            node_gpus=node_gpus,
        )
        for a in (assignment, assignment.model_copy(update={"env": {}}))
    ]
    return built[0], built[1]


def test_a_gpu_attempts_workers_see_its_gpus_numbered_as_nvml_does(tmp_path: Path) -> None:
    workers, _ = _envs(an_assignment(device="cuda", gpus=[2, 3]), tmp_path, node_gpus=4)
    assert workers["RELAUNCH_DEVICE"] == "cuda"
    assert workers["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert workers["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert workers["OMP_NUM_THREADS"] == "8"  # 32 cores * 2 of 4 GPUs / 2 workers
    assert workers["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_a_cpu_attempt_on_a_gpu_node_sees_no_gpu(tmp_path: Path) -> None:
    workers, _ = _envs(an_assignment(nproc_per_node=4), tmp_path, node_gpus=8)
    assert workers["RELAUNCH_DEVICE"] == "cpu"
    assert workers["CUDA_VISIBLE_DEVICES"] == ""
    assert workers["OMP_NUM_THREADS"] == "8"  # 32 cores / 4 workers


def test_the_jobs_env_cannot_choose_the_devices_nor_can_the_agents_own(tmp_path: Path) -> None:
    inherited = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "7"}
    for assignment, visible in (
        (an_assignment(env=JOB_ASKS), ""),
        (an_assignment(env=JOB_ASKS, device="cuda", gpus=[5, 6]), "5,6"),
    ):
        workers, launcher = _envs(assignment, tmp_path, node_gpus=8, base=inherited)
        for env in (workers, launcher):
            assert env["CUDA_VISIBLE_DEVICES"] == visible
            assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            assert env["RELAUNCH_DEVICE"] == assignment.device
        # What reaches the workers from the job's env alone holds none of them.
        assert not set(JOB_ASKS) & set(job_env_overlay(workers, launcher))


def test_the_jobs_own_omp_num_threads_stands(tmp_path: Path) -> None:
    assignment = an_assignment(env={"OMP_NUM_THREADS": "3"}, device="cuda", gpus=[0, 1])
    workers, launcher = _envs(assignment, tmp_path, node_gpus=2)
    assert workers["OMP_NUM_THREADS"] == "3"
    assert launcher["OMP_NUM_THREADS"] == "16"  # the launcher's own: 32 cores, 2 workers
    assert job_env_overlay(workers, launcher)["OMP_NUM_THREADS"] == "3"


def test_an_omp_num_threads_the_agent_was_started_with_holds_for_every_job(
    tmp_path: Path,
) -> None:
    """Its operator's choice (the tests' agents run with 1): only a job's own beats it."""
    inherited = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    workers, launcher = _envs(an_assignment(), tmp_path, node_gpus=0, base=inherited)
    assert workers["OMP_NUM_THREADS"] == launcher["OMP_NUM_THREADS"] == "1"
    own = an_assignment(env={"OMP_NUM_THREADS": "6"})
    workers, _ = _envs(own, tmp_path, node_gpus=0, base=inherited)
    assert workers["OMP_NUM_THREADS"] == "6"


@pytest.mark.parametrize("job_env", [{}, {"OMP_NUM_THREADS": "3"}], ids=["agents", "jobs"])
def test_workers_thread_count_needs_no_cold_start(tmp_path: Path, job_env: dict[str, str]) -> None:
    """The zygote starts with the launcher's environment and the job's overlay, as each
    worker does (worker.sandbox): both hold one OMP_NUM_THREADS, so torch in the zygote
    sized its pool for the workers, and nothing about devices makes a worker start cold."""
    assignment = an_assignment(env={"FOO": "bar", **job_env}, device="cuda", gpus=[0, 1])
    workers, launcher = _envs(assignment, tmp_path, node_gpus=4)
    overlay = job_env_overlay(workers, launcher)
    zygote = merge_worker_env(launcher, overlay, launcher)
    per_worker = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    worker = merge_worker_env({**launcher, **per_worker}, overlay, launcher)
    args = [sys.executable, "-u", "-m", "worker.bootstrap", "-m", "pkg.train"]
    assert cold_start_reason(args, worker, zygote) is None
    assert (
        worker["OMP_NUM_THREADS"]
        == zygote["OMP_NUM_THREADS"]
        == job_env.get("OMP_NUM_THREADS", "8")
    )
    assert worker["CUDA_VISIBLE_DEVICES"] == zygote["CUDA_VISIBLE_DEVICES"] == "0,1"


def _never_launched(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str]]:
    envs: list[dict[str, str]] = []

    def popen(command: list[str], *, env: dict[str, str], **kwargs: object) -> None:
        envs.append(env)
        raise OSError("not started in this test")

    monkeypatch.setattr(attempt_module.subprocess, "Popen", popen)
    return envs


def test_an_attempt_on_gpus_this_node_does_not_offer_fails_without_a_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    envs = _never_launched(monkeypatch)
    attempt = Attempt(
        an_assignment(device="cuda", gpus=[3, 4]), _settings(tmp_path), node_gpus=(0, 1, 2, 3)
    )
    attempt.start()
    assert envs == []
    assert attempt.exit is not None
    assert (attempt.exit.outcome, attempt.exit.fatal) == ("failed", False)
    assert attempt.exit.message == (
        "cannot start: GPU(s) [4] are not among this node's GPUs (0,1,2,3)"
    )


def test_a_started_attempt_gives_the_launcher_and_the_workers_the_agents_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    envs = _never_launched(monkeypatch)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the agent's environment is ours
    assignment = an_assignment(
        env={**JOB_ASKS, "OMP_NUM_THREADS": "5"}, device="cuda", gpus=[1, 2], working_dir=None
    )
    attempt = Attempt(
        assignment.model_copy(update={"snapshot_dir": str(tmp_path / "snap")}),
        _settings(tmp_path, cpus=48),
        node_gpus=(0, 1, 2),
    )
    with caplog.at_level(logging.WARNING, logger="worker.attempt"):
        attempt.start()
    [launcher] = envs
    assert (launcher["CUDA_VISIBLE_DEVICES"], launcher["RELAUNCH_DEVICE"]) == ("1,2", "cuda")
    assert launcher["OMP_NUM_THREADS"] == "16"  # 48 cores * 2 of 3 GPUs / 2 workers
    overlay = json.loads((attempt.dir / "job-env.json").read_text())
    assert overlay["OMP_NUM_THREADS"] == "5"
    assert not set(JOB_ASKS) & set(overlay)
    [warning] = [r.getMessage() for r in caplog.records if "replace" in r.getMessage()]
    assert "CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES, RELAUNCH_DEVICE" in warning
    assert "0,1,2,3" not in warning and "FASTEST_FIRST" not in warning  # names, no values
