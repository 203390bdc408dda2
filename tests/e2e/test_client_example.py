"""examples/client_example.py, run as a user runs it, against a real controller and node."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import running_cluster

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_the_client_example_submits_waits_and_prints_the_final_loss(tmp_path: Path) -> None:
    with running_cluster(tmp_path, ("node-a",)) as cluster:
        assert cluster.admin_token is not None
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "RELAUNCH_URL": cluster.url.removeprefix("http://"),  # HOST:PORT is enough
            "RELAUNCH_TOKEN": cluster.admin_token,
        }
        done = subprocess.run(
            [sys.executable, str(REPO / "examples" / "client_example.py"), "--timeout", "240"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        found = re.search(r"job (\d+) succeeded: final loss ([\d.]+) at step (\d+)", done.stdout)
        assert found, done.stdout
        with cluster.client() as client:
            job = client.job(int(found.group(1)))
            metrics = client.metrics(job["id"])
        assert job["state"] == "SUCCEEDED"
        last = [m for m in metrics if m["loss"] is not None][-1]
        assert (found.group(2), int(found.group(3))) == (f"{last['loss']:.4f}", last["step"])
        assert last["loss"] < metrics[0]["loss"]  # it trained
