"""DistEnv and TrainerConfig read from the environment; process-group set-up."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.helpers import ON_CPU
from worker.runtime.config import TrainerConfig
from worker.runtime.devices import DeviceShortage
from worker.runtime.env import (
    DistEnv,
    Launcher,
    device_for,
    init_distributed,
    shutdown_distributed,
)

TORCHRUN_ENV = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
}


def test_defaults_without_launcher() -> None:
    env = DistEnv.from_environ({})
    assert env == DistEnv()
    assert (env.rank, env.world_size, env.restart_count, env.launched) == (0, 1, 0, False)
    assert env.is_rank_zero


def test_reads_torchrun_variables() -> None:
    env = DistEnv.from_environ(TORCHRUN_ENV)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.group_rank, env.restart_count) == (1, 2)
    assert (env.master_addr, env.master_port, env.launched) == ("10.0.0.1", 29400, True)
    assert not env.is_rank_zero


@pytest.mark.parametrize(
    "override,name",
    [
        ({"RANK": "x"}, "RANK"),
        ({"RANK": "4"}, "RANK"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE"),
        ({"TORCHELASTIC_RESTART_COUNT": "-1"}, "TORCHELASTIC_RESTART_COUNT"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT"),
        ({"RELAUNCH_COLLECTIVE_TIMEOUT_S": "soon"}, "RELAUNCH_COLLECTIVE_TIMEOUT_S"),
        ({"RELAUNCH_COLLECTIVE_TIMEOUT_S": "0"}, "RELAUNCH_COLLECTIVE_TIMEOUT_S"),
        ({"RELAUNCH_COLLECTIVE_TIMEOUT_S": "inf"}, "RELAUNCH_COLLECTIVE_TIMEOUT_S"),
    ],
)
def test_bad_variables_are_named(override: dict[str, str], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        DistEnv.from_environ({**TORCHRUN_ENV, **override})


def test_the_collective_timeout_comes_from_the_job_spec_through_the_environment() -> None:
    assert DistEnv.from_environ(TORCHRUN_ENV).collective_timeout == timedelta(minutes=5)
    env = DistEnv.from_environ({**TORCHRUN_ENV, "RELAUNCH_COLLECTIVE_TIMEOUT_S": "42.5"})
    assert env.collective_timeout == timedelta(seconds=42.5)


def test_the_process_group_waits_the_collective_timeout() -> None:
    """What the Trainer does: ``init_distributed(env)`` with the env it read."""
    init_distributed(DistEnv.from_environ({"RELAUNCH_COLLECTIVE_TIMEOUT_S": "42", **ON_CPU}))
    try:
        assert group_timeout() == timedelta(seconds=42)
    finally:
        shutdown_distributed()


def group_timeout() -> timedelta:
    group = dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cpu"))
    timeout: timedelta = backend.options._timeout
    return timeout


def test_single_process_group_without_launcher() -> None:
    device = init_distributed(DistEnv(device="cpu"))
    try:
        assert device == torch.device("cpu")
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        assert tensor.tolist() == [1.0, 1.0]
        with pytest.raises(RuntimeError, match="already"):
            init_distributed(DistEnv(device="cpu"))
    finally:
        shutdown_distributed()
    assert not dist.is_initialized()
    shutdown_distributed()  # idempotent


def test_config_snapshot_settings_from_env() -> None:
    environ = {
        "RELAUNCH_SNAPSHOT_DIR": "/data/snaps",
        "RELAUNCH_SNAPSHOT_EVERY_STEPS": "50",
        "RELAUNCH_SNAPSHOT_EVERY_EPOCHS": "2",
    }
    config = TrainerConfig.from_environ(environ, max_epochs=3, batch_size=8, lr=0.1)
    assert (config.snapshot_dir, config.snapshot_every_steps, config.snapshot_every_epochs) == (
        "/data/snaps",
        50,
        2,
    )
    assert str(config.final_output_path) == "/data/snaps/final.pt"
    explicit = TrainerConfig.from_environ(
        environ, max_epochs=3, batch_size=8, lr=0.1, snapshot_dir="mine", snapshot_every_steps=5
    )
    assert (explicit.snapshot_dir, explicit.snapshot_every_steps) == ("mine", 5)


def test_config_defaults_snapshot_every_epoch() -> None:
    config = TrainerConfig.from_environ({}, max_epochs=1, batch_size=1, lr=1.0, output_path="m.pt")
    assert (config.snapshot_dir, config.snapshot_every_steps, config.snapshot_every_epochs) == (
        "./snapshots",
        None,
        1,
    )
    assert str(config.final_output_path) == "m.pt"


@pytest.mark.parametrize(
    ("environ", "explicit_steps"),
    [({"RELAUNCH_SNAPSHOT_EVERY_STEPS": "20"}, None), ({}, 20)],
    ids=["from-env", "explicit"],
)
def test_config_step_interval_alone_drops_the_epoch_default(
    environ: dict[str, str], explicit_steps: int | None
) -> None:
    config = TrainerConfig.from_environ(
        environ, max_epochs=1, batch_size=1, lr=1.0, snapshot_every_steps=explicit_steps
    )
    assert (config.snapshot_every_steps, config.snapshot_every_epochs) == (20, 0)
    both = TrainerConfig.from_environ(
        {**environ, "RELAUNCH_SNAPSHOT_EVERY_EPOCHS": "3"},
        max_epochs=1,
        batch_size=1,
        lr=1.0,
        snapshot_every_steps=explicit_steps,
    )
    assert (both.snapshot_every_steps, both.snapshot_every_epochs) == (20, 3)


@pytest.mark.parametrize("value", ["soon", "-3"])
def test_config_bad_env_is_named(value: str) -> None:
    with pytest.raises(ValueError, match="RELAUNCH_SNAPSHOT_EVERY_STEPS"):
        TrainerConfig.from_environ(
            {"RELAUNCH_SNAPSHOT_EVERY_STEPS": value}, max_epochs=1, batch_size=1, lr=1.0
        )


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_epochs", 0),
        ("batch_size", 0),
        ("lr", 0.0),
        ("step_delay_s", -1.0),
        ("stop_after_steps", 0),
    ],
)
def test_config_validates(field: str, value: float) -> None:
    kwargs: dict[str, float] = {"max_epochs": 1, "batch_size": 1, "lr": 0.1, field: value}
    with pytest.raises(ValueError, match=field):
        TrainerConfig(**kwargs)  # type: ignore[arg-type]


SRUN_ENV = {
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "localhost",
    "SLURM_TASKS_PER_NODE": "2",
}


def test_reads_srun_variables_without_torchrun_ones() -> None:
    env = DistEnv.from_environ(SRUN_ENV)
    assert env.launcher is Launcher.SLURM and env.launched
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (1, 1, 2, 2)
    assert (env.group_rank, env.restart_count) == (0, 0)
    assert (env.master_addr, env.master_port) == ("localhost", 10000 + 4242)


def test_torchrun_variables_win_over_inherited_slurm_ones() -> None:
    """A launcher inside a Slurm allocation passes SLURM_* on to its workers."""
    assert DistEnv.from_environ({**SRUN_ENV, **TORCHRUN_ENV}) == DistEnv.from_environ(TORCHRUN_ENV)
    env = DistEnv.from_environ({**SRUN_ENV, "SLURM_NTASKS": "x", **TORCHRUN_ENV})
    assert env.launcher is Launcher.TORCHRUN and env.world_size == 4


def test_slurm_variables_without_a_task_are_no_launcher() -> None:
    """salloc's shell: an allocation, but no task of a step."""
    env = DistEnv.from_environ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert env == DistEnv() and env.launcher is Launcher.NONE


def test_bad_srun_variables_are_named() -> None:
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        DistEnv.from_environ({**SRUN_ENV, "SLURM_PROCID": "2"})


def test_a_slurm_env_needs_its_master() -> None:
    with pytest.raises(ValueError, match="master"):
        DistEnv(launcher=Launcher.SLURM)


@pytest.mark.parametrize(
    ("local_rank", "visible", "index"), [(0, 4, 0), (3, 4, 3), (1, 1, 0), (5, 2, 1)]
)
def test_the_gpu_is_the_local_rank_among_those_the_process_sees(
    monkeypatch: pytest.MonkeyPatch, local_rank: int, visible: int, index: int
) -> None:
    """srun --gpus-per-task=1 shows each task only its own GPU, as cuda:0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    rank = {"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": "0"}
    env = DistEnv.from_environ({**TORCHRUN_ENV, **rank, "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"})
    assert device_for(env) == torch.device("cuda", index)


def test_the_device_the_agent_asked_for_is_read() -> None:
    assert DistEnv.from_environ({**TORCHRUN_ENV, "RELAUNCH_DEVICE": "cuda"}).device == "cuda"
    assert DistEnv.from_environ({**TORCHRUN_ENV, **ON_CPU}).device == "cpu"
    assert DistEnv.from_environ(TORCHRUN_ENV).device is None
    with pytest.raises(ValueError, match="RELAUNCH_DEVICE"):
        DistEnv.from_environ({**TORCHRUN_ENV, "RELAUNCH_DEVICE": "tpu"})


def _gpus(monkeypatch: pytest.MonkeyPatch, visible: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)


def test_cpu_asked_for_is_the_cpu_where_gpus_are_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 4)
    assert device_for(DistEnv.from_environ({**TORCHRUN_ENV, **ON_CPU})) == torch.device("cpu")


@pytest.mark.parametrize(("local_rank", "index"), [(0, 0), (1, 1)])
def test_cuda_asked_for_is_the_local_ranks_own_gpu(
    monkeypatch: pytest.MonkeyPatch, local_rank: int, index: int
) -> None:
    """The agent shows the attempt exactly its GPUs: local rank n is visible device n."""
    _gpus(monkeypatch, 2)
    rank = {"LOCAL_RANK": str(local_rank), "RELAUNCH_DEVICE": "cuda"}
    assert device_for(DistEnv.from_environ({**TORCHRUN_ENV, **rank})) == torch.device("cuda", index)


@pytest.mark.parametrize("visible", [0, 1])
def test_cuda_asked_for_with_too_few_gpus_is_a_device_shortage(
    monkeypatch: pytest.MonkeyPatch, visible: int
) -> None:
    _gpus(monkeypatch, visible)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    env = DistEnv.from_environ({**TORCHRUN_ENV, "LOCAL_RANK": "0", "RELAUNCH_DEVICE": "cuda"})
    with pytest.raises(DeviceShortage, match=f"{visible} CUDA device.*'5'.*2 local rank"):
        device_for(env)


def test_nothing_asked_for_keeps_cuda_where_available(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    assert device_for(DistEnv.from_environ(TORCHRUN_ENV)) == torch.device("cpu")
    _gpus(monkeypatch, 1)
    assert device_for(DistEnv.from_environ(TORCHRUN_ENV)) == torch.device("cuda", 0)
