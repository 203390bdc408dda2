"""Snapshot writes are fenced by a writer token that the controller counts per job."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.service.helpers import heartbeat, register, submit
from tests.worker.helpers import LiveController
from worker.runtime.fence import (
    ControllerCounter,
    SnapshotFenced,
    WriterToken,
    writer_token_from_environ,
)
from worker.runtime.rng import RngState
from worker.runtime.snapshot import TrainingState, list_snapshots, save_snapshot


@pytest.fixture
def job_worker_token(live_controller: LiveController) -> Iterator[tuple[int, str]]:
    """A running one-node job and the worker token its node was sent."""
    api = live_controller.api
    node = register(api, "fence-a")
    job_id = submit(api, "1")
    live_controller.reconciler.run_once()
    [assignment] = heartbeat(api, node)
    yield job_id, assignment["worker_token"]


def _snapshot(step: int) -> TrainingState:
    return TrainingState(
        model_state={"w": torch.zeros(2)},
        optimizer_state={},
        step=step,
        epoch=0,
        samples_consumed=0,
        world_size=1,
        seed=0,
        rng=RngState.capture(),
    )


def test_a_replaced_rank0_cannot_commit_a_snapshot(
    live_controller: LiveController, job_worker_token: tuple[int, str], tmp_path: Path
) -> None:
    job_id, token = job_worker_token
    url = live_controller.url
    old = WriterToken(ControllerCounter(url, job_id, token))
    save_snapshot(tmp_path, _snapshot(5), before_commit=old.check)
    new = WriterToken(ControllerCounter(url, job_id, token))  # the job re-formed with a new rank 0

    with pytest.raises(SnapshotFenced, match="newer rank 0"):
        save_snapshot(tmp_path, _snapshot(10), before_commit=old.check)
    save_snapshot(tmp_path, _snapshot(8), before_commit=new.check)
    assert [step for step, _ in list_snapshots(tmp_path)] == [5, 8]
    assert not list(tmp_path.glob(".*.tmp"))  # the refused file is gone


def test_a_writer_that_cannot_reach_the_controller_is_refused(tmp_path: Path) -> None:
    class Unreachable:
        def take(self) -> int:
            return 1

        def current(self) -> int:
            raise httpx.ConnectError("connection refused")

    token = WriterToken(Unreachable())
    with pytest.raises(SnapshotFenced, match="cannot check"):
        save_snapshot(tmp_path, _snapshot(1), before_commit=token.check)
    assert list_snapshots(tmp_path) == []


def test_outside_relaunch_there_is_no_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELAUNCH_WORKER_TOKEN", raising=False)
    assert writer_token_from_environ() is None
