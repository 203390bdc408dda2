"""Integration: the regression task started three ways, 2 CPU processes each, ends the same.

torchrun (the reference), the task's own ``--nproc 2`` (``mp.spawn``), and two plain
processes given the variables srun gives two tasks on one node. The runs are compared
for exact equality: each way gives rank r the same shard, seed and data, and gloo's
sum of two ranks' gradients is the same in either order, so nothing may differ by a bit.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import ON_CPU, subprocess_environ
from worker.runtime.slurm import port_for_job
from worker.tasks import regression

REGRESSION = [
    "-m", "worker.tasks.regression",
    "--samples", "128", "--features", "8", "--batch-size", "16", "--epochs", "2",
    "--seed", "5", "--lr", "0.1", "--log-every-steps", "1",
]  # fmt: skip
# 128 samples over 2 ranks in batches of 16: 4 steps per epoch, 8 in all
STEPS = 8

# What a launcher running inside a Slurm allocation passes on to its workers: if the
# workers took these over torchrun's, each would be rank 0 of a world of 1.
INHERITED_SLURM = {
    "SLURM_JOB_ID": "7",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "localhost",
    "SLURM_TASKS_PER_NODE": "1",
}


@dataclass(frozen=True)
class Run:
    """What one run left: its runtime events and its final model."""

    events: list[dict[str, Any]]
    model: dict[str, torch.Tensor]

    @property
    def world_sizes(self) -> list[int]:
        return [e["data"]["world_size"] for e in self.events if e["kind"] == "started"]

    @property
    def losses(self) -> list[float]:
        return [e["data"]["loss"] for e in self.events if e["kind"] == "progress"]


def finished_run(workdir: Path) -> Run:
    events_file = workdir / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines() if line]
    model: dict[str, torch.Tensor] = torch.load(workdir / "s" / "final.pt", weights_only=True)
    return Run(events, model)


def task_environ(workdir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {
        **subprocess_environ(),
        **ON_CPU,  # two ranks on one host
        "RELAUNCH_EVENTS_FILE": str(workdir / "events.jsonl"),
        **(extra or {}),
    }


def check(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    workdir = tmp_path_factory.mktemp("torchrun")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    check(
        subprocess.run(
            [*cmd, *REGRESSION, "--snapshot-dir", str(workdir / "s")],
            env=task_environ(workdir, INHERITED_SLURM),
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=180,
        )
    )
    return finished_run(workdir)


def test_torchrun_workers_in_a_slurm_allocation_take_torchruns_variables(
    torchrun_run: Run,
) -> None:
    assert torchrun_run.world_sizes == [2]
    assert len(torchrun_run.losses) == STEPS
    assert torchrun_run.losses[-1] < torchrun_run.losses[0]


def assert_same_run(actual: Run, expected: Run) -> None:
    assert actual.world_sizes == expected.world_sizes == [2]
    assert actual.losses == expected.losses
    assert actual.model.keys() == expected.model.keys()
    for key, tensor in expected.model.items():
        assert torch.equal(actual.model[key], tensor), key


def test_nproc_spawns_a_world_that_trains_as_torchruns_did(
    tmp_path: Path, torchrun_run: Run
) -> None:
    check(
        subprocess.run(
            [sys.executable, *REGRESSION, "--snapshot-dir", str(tmp_path / "s"), "--nproc", "2"],
            env=task_environ(tmp_path),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=180,
        )
    )
    assert_same_run(finished_run(tmp_path), torchrun_run)


def job_id_with_a_free_port() -> int:
    """A Slurm job id whose derived port nothing listens on now."""
    for job_id in random.sample(range(100_000, 120_000), 50):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port_for_job(job_id)))
            except OSError:
                continue
            return job_id
    raise AssertionError("no free port among 50 tried in 10000-29999")


def test_two_srun_tasks_train_as_torchruns_did(tmp_path: Path, torchrun_run: Run) -> None:
    job_id = str(job_id_with_a_free_port())
    tasks = []
    for rank in (0, 1):
        srun_task = {
            "SLURM_JOB_ID": job_id,
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_TASKS_PER_NODE": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2",
        }
        tasks.append(
            subprocess.Popen(
                [sys.executable, *REGRESSION, "--snapshot-dir", str(tmp_path / "s")],
                env=task_environ(tmp_path, srun_task),
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outputs = [task.communicate(timeout=180) for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    for task, (stdout, stderr) in zip(tasks, outputs, strict=True):
        assert task.returncode == 0, stdout[-3000:] + stderr[-5000:]
    assert "world_size=2" in outputs[1][1], "rank 1 joined the group of two"
    assert_same_run(finished_run(tmp_path), torchrun_run)


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize(
    "launcher_env",
    [
        {"WORLD_SIZE": "1", "RANK": "0"},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"},
    ],
    ids=["torchrun", "srun-with-2-tasks"],
)
def test_nproc_is_refused_where_a_launcher_started_the_world(
    launcher_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in launcher_env.items():
        monkeypatch.setenv(name, value)
    argv = [*REGRESSION[2:], "--snapshot-dir", str(tmp_path / "s"), "--nproc", "2"]
    assert regression.main(argv) == 2
    assert not (tmp_path / "s").exists()
