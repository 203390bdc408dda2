"""Snapshot writes are fenced by a writer token on a real TCPStore."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from service.local_cluster import free_port
from worker.runtime.fence import SnapshotFenced, WriterToken, fence_key, writer_token_from_environ
from worker.runtime.rng import RngState
from worker.runtime.snapshot import TrainingState, list_snapshots, save_snapshot


@pytest.fixture
def store() -> Iterator[tuple[dist.TCPStore, int]]:
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    yield server, port
    del server


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False
    )


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
    store: tuple[dist.TCPStore, int], tmp_path: Path
) -> None:
    _, port = store
    old = WriterToken(_client(port), fence_key("7"))
    save_snapshot(tmp_path, _snapshot(5), before_commit=old.check)
    new = WriterToken(_client(port), fence_key("7"))  # the job re-formed with a new rank 0

    with pytest.raises(SnapshotFenced, match="newer rank 0"):
        save_snapshot(tmp_path, _snapshot(10), before_commit=old.check)
    save_snapshot(tmp_path, _snapshot(8), before_commit=new.check)
    assert [step for step, _ in list_snapshots(tmp_path)] == [5, 8]
    assert not list(tmp_path.glob(".*.tmp"))  # the refused file is gone


def test_tokens_of_other_jobs_do_not_interfere(store: tuple[dist.TCPStore, int]) -> None:
    _, port = store
    mine = WriterToken(_client(port), fence_key("1"))
    WriterToken(_client(port), fence_key("2"))
    mine.check()


def test_a_writer_that_cannot_reach_the_store_is_refused(
    store: tuple[dist.TCPStore, int], tmp_path: Path
) -> None:
    class Unreachable:
        def add(self, key: str, value: int) -> int:
            if value == 0:
                raise RuntimeError("connection reset by peer")
            return 1

    token = WriterToken(Unreachable(), fence_key("3"))
    with pytest.raises(SnapshotFenced, match="cannot reach the store"):
        save_snapshot(tmp_path, _snapshot(1), before_commit=token.check)
    assert list_snapshots(tmp_path) == []


def test_outside_relaunch_there_is_no_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELAUNCH_STORE_ENDPOINT", raising=False)
    assert writer_token_from_environ() is None
