"""The variables each spawned worker gets: torchrun's, for one node; how each ends."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from worker.runtime.env import DistEnv, Launcher
from worker.runtime.local_launch import spawn_workers, worker_environ


def test_each_worker_reads_as_a_torchrun_worker_of_one_node() -> None:
    envs = [DistEnv.from_environ(worker_environ(rank, 3, 29511)) for rank in range(3)]
    assert [(e.rank, e.local_rank, e.group_rank) for e in envs] == [(0, 0, 0), (1, 1, 0), (2, 2, 0)]
    for env in envs:
        assert env.launcher is Launcher.TORCHRUN
        assert (env.world_size, env.local_world_size) == (3, 3)
        assert (env.master_addr, env.master_port) == ("127.0.0.1", 29511)


def test_spawned_workers_win_over_an_inherited_srun_task() -> None:
    srun = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "9"}
    env = DistEnv.from_environ({**srun, **worker_environ(1, 2, 29511)})
    assert env.launcher is Launcher.TORCHRUN and (env.rank, env.world_size) == (1, 2)


@pytest.mark.parametrize("rank,nproc", [(2, 2), (-1, 2)])
def test_a_rank_outside_the_world_is_refused(rank: int, nproc: int) -> None:
    with pytest.raises(ValueError, match="local rank"):
        worker_environ(rank, nproc, 29511)


def test_no_world_of_zero() -> None:
    with pytest.raises(ValueError, match="nproc"):
        spawn_workers(print, 0)


class _AbortsWhenFreed:
    def __del__(self, abort: Callable[[], None] = os.abort) -> None:
        abort()


def _returns_then_aborts_in_teardown(out: str) -> None:
    """Works, then leaves an object that aborts the process when the interpreter's
    teardown frees it (as torch's gloo can at exit)."""
    with open(os.path.join(out, os.environ["RANK"]), "w") as handle:
        handle.write("done")
    sys.keep_until_teardown = _AbortsWhenFreed()  # type: ignore[attr-defined]


def test_a_world_whose_work_returned_ends_without_its_teardown(tmp_path: Path) -> None:
    spawn_workers(_returns_then_aborts_in_teardown, 2, (str(tmp_path),))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]
