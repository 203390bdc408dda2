"""Where a script job's workers run, so where its relative paths lead."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from service.client import RelaunchClient
from service.local_cluster import LocalCluster
from tests.e2e.helpers import wait_terminal

pytestmark = pytest.mark.e2e

WRITES_A_RELATIVE_FILE = """\
import json, os
rank = os.environ["RANK"]
with open(f"from-rank{rank}.json", "w") as out:
    json.dump({"cwd": os.getcwd(), "node": os.environ["RELAUNCH_NODE_NAME"]}, out)
"""


def _script(tmp_path: Path) -> str:
    path = tmp_path / "relative.py"
    path.write_text(WRITES_A_RELATIVE_FILE)
    return str(path)


def test_by_default_relative_paths_of_every_node_land_in_the_jobs_directory(
    cluster: LocalCluster, client: RelaunchClient, tmp_path: Path
) -> None:
    spec = {"name": "relative", "script": {"path": _script(tmp_path)}, "nnodes": "2:2"}
    job_id = client.submit(spec)["id"]
    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    job_dir = cluster.snapshot_dir(job_id)
    written = {n: json.loads((job_dir / f"from-rank{n}.json").read_text()) for n in (0, 1)}
    assert {w["node"] for w in written.values()} == {"node-a", "node-b"}
    assert {w["cwd"] for w in written.values()} == {str(job_dir)}


def test_the_workers_run_in_the_jobs_working_dir(
    cluster: LocalCluster, client: RelaunchClient, tmp_path: Path
) -> None:
    workdir = tmp_path / "runs"
    workdir.mkdir()
    # As root each job runs as a user of its own, which must be let in to write here.
    workdir.chmod(0o777)
    spec = {
        "name": "in-workdir",
        "script": {"path": _script(tmp_path)},
        "nnodes": "2:2",
        "working_dir": str(workdir),
    }
    job_id = client.submit(spec)["id"]
    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    assert sorted(p.name for p in workdir.iterdir()) == ["from-rank0.json", "from-rank1.json"]
    assert not list(cluster.snapshot_dir(job_id).glob("from-rank*"))


def test_a_working_dir_missing_on_a_node_fails_the_job_at_once(
    client: RelaunchClient, tmp_path: Path
) -> None:
    missing = tmp_path / "not-here"
    spec = {
        "name": "no-workdir",
        "script": {"path": _script(tmp_path)},
        "nnodes": "2:2",
        "max_restarts": 3,
        "working_dir": str(missing),
    }
    job_id = client.submit(spec)["id"]
    job = wait_terminal(client, job_id)
    assert job["state"] == "FAILED", job
    assert job["restart_count"] == 0, job
    assert f"working_dir {missing} does not exist on node node-" in job["message"], job
    assert not missing.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as their own users only under root")
def test_a_working_dir_the_jobs_user_cannot_enter_fails_the_job_at_once(
    client: RelaunchClient, tmp_path: Path
) -> None:
    closed = tmp_path / "closed"
    (closed / "runs").mkdir(parents=True)
    closed.chmod(0o700)
    spec = {
        "name": "closed-workdir",
        "script": {"path": _script(tmp_path)},
        "nnodes": "2:2",
        "max_restarts": 3,
        "working_dir": str(closed / "runs"),
    }
    job_id = client.submit(spec)["id"]
    job = wait_terminal(client, job_id)
    assert job["state"] == "FAILED", job
    assert job["restart_count"] == 0, job
    assert f"cannot enter working_dir {closed / 'runs'}: Permission denied" in job["message"], job
