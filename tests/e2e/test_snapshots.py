"""Snapshots end to end: rank 0 killed mid-save, a damaged newest snapshot, a full disk.

The cluster's snapshot root is a small tmpfs mounted for this module (root is
needed to mount it), so that a full disk is a real ENOSPC from the kernel.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from service.client import RelaunchClient
from service.local_cluster import LocalCluster
from tests.e2e.helpers import (
    POLL_S,
    regression_spec,
    running_cluster,
    wait_no_processes,
    wait_terminal,
)
from tests.helpers import wait_for
from worker.runtime.snapshot import list_snapshots

pytestmark = pytest.mark.e2e
TMPFS_SIZE = "16m"


@pytest.fixture(scope="module")
def snapshot_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("snapshot-tmpfs")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0755", "tmpfs", str(root)],
        check=True,
    )
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, snapshot_root: Path
) -> Iterator[LocalCluster]:
    data = tmp_path_factory.mktemp("cluster")
    with running_cluster(data, ("snap-a", "snap-b"), snapshot_root=snapshot_root) as c:
        yield c


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[RelaunchClient]:
    with cluster.client() as c:
        yield c


def spec(name: str, every_steps: int, **params: Any) -> dict[str, Any]:
    job = regression_spec(name, step_delay=0.15)
    job["task"]["params"].update(params)
    job["snapshot"] = {"every_steps": every_steps, "keep": 3}
    return job


def kinds(client: RelaunchClient, job_id: int) -> list[str]:
    return [e["kind"] for e in client.events(job_id)]


def assert_succeeded_from_a_snapshot(client: RelaunchClient, job_id: int) -> dict[str, Any]:
    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    assert job["last_step"] == job["total_steps"] == 64
    resumed = [e for e in client.events(job_id) if e["kind"] == "resumed"]
    assert resumed and resumed[0]["data"]["resumed_from_step"] > 0, kinds(client, job_id)
    return job


def worker_of_rank(cluster: LocalCluster, job_id: int, rank: int) -> psutil.Process:
    for proc in cluster.job_workers(job_id):
        if cluster.worker_env(proc).get("RANK") == str(rank):
            return proc
    raise AssertionError(f"no worker of job {job_id} has rank {rank}")


def test_rank_0_killed_between_data_and_manifest_resumes_from_a_verified_snapshot(
    cluster: LocalCluster, client: RelaunchClient
) -> None:
    job_id = client.submit(
        spec("crash-in-save", 4, crash_in_save="before_manifest", crash_in_save_step=20)
    )["id"]
    job = assert_succeeded_from_a_snapshot(client, job_id)
    assert job["restart_count"] == 1
    directory = cluster.snapshot_dir(job_id)
    (marker,) = directory.glob(".crashed-before_manifest-*")
    crashed_step = int(marker.name.rsplit("-", 1)[1])  # the first save at or after step 20
    resumed = next(e for e in client.events(job_id) if e["kind"] == "resumed")
    # the crashed save's data file had no manifest: the snapshot before it was used
    recorded = [s["step"] for s in client.snapshots(job_id)]
    from_step = resumed["data"]["resumed_from_step"]
    assert from_step < crashed_step and from_step in recorded
    assert "snapshot_skipped" not in kinds(client, job_id)
    assert recorded.count(crashed_step) <= 1  # at most the save after the resume
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    wait_no_processes(cluster, job_id)


def test_a_bit_flipped_newest_snapshot_is_skipped_and_the_one_before_used(
    cluster: LocalCluster, client: RelaunchClient
) -> None:
    job_id = client.submit(spec("bit-flip", 8))["id"]
    directory = cluster.snapshot_dir(job_id)
    wait_for("two snapshots", lambda: len(list_snapshots(directory)) >= 2, 120, POLL_S)
    workers = cluster.job_workers(job_id)
    for proc in workers:  # nothing may commit a newer snapshot while we damage this one
        proc.send_signal(signal.SIGSTOP)
    try:
        newest_step, newest = list_snapshots(directory)[-1]
        data = directory / newest.file
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
        worker_of_rank(cluster, job_id, 0).send_signal(signal.SIGKILL)
    finally:
        for proc in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)

    assert_succeeded_from_a_snapshot(client, job_id)
    events = client.events(job_id)
    skipped = [e for e in events if e["kind"] == "snapshot_skipped"]
    assert skipped and skipped[0]["data"]["step"] == newest_step
    assert "checksum mismatch" in skipped[0]["message"]
    resumed = next(e for e in events if e["kind"] == "resumed")
    assert resumed["data"]["resumed_from_step"] < newest_step


def fill(directory: Path) -> Path:
    """Write into ``directory`` until its file system is full; return the filler file."""
    filler = directory / "filler.bin"
    chunk = b"\0" * (1 << 16)
    with open(filler, "wb") as handle:
        try:
            while True:
                handle.write(chunk)
                handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    with contextlib.suppress(OSError), open(filler, "ab") as handle:
        while True:  # the last few bytes too
            handle.write(b"\0" * 512)
            handle.flush()
    return filler


def test_a_full_disk_is_reported_and_training_goes_on(
    cluster: LocalCluster, client: RelaunchClient, snapshot_root: Path
) -> None:
    filler = fill(snapshot_root)
    try:
        job_id = client.submit(spec("disk-full", 4))["id"]
        wait_for(
            "a failed snapshot", lambda: "snapshot_failed" in kinds(client, job_id), 120, POLL_S
        )
        step = client.job(job_id)["last_step"] or 0
        wait_for("training past it", lambda: (client.job(job_id)["last_step"] or 0) > step + 4)
        assert client.job(job_id)["state"] == "RUNNING"
        assert client.job(job_id)["restart_count"] == 0
    finally:
        os.unlink(filler)

    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    assert job["restart_count"] == 0
    events = client.events(job_id)
    failed = [e for e in events if e["kind"] == "snapshot_failed"]
    assert failed and "No space left on device" in failed[0]["message"]
    saved = [e for e in events if e["kind"] == "snapshot_saved"]
    assert saved and saved[-1]["id"] > failed[-1]["id"]
    directory = cluster.snapshot_dir(job_id)
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert (directory / "final.pt").exists()
