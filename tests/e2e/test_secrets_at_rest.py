"""A real controller keeps a job's env secret encrypted in its SQLite file, sends it in the
clear to the job's node (its workers read it), and refuses to start with a key that does
not open it."""

from __future__ import annotations

import stat
import uuid
from pathlib import Path

import httpx
import pytest
from cryptography.fernet import Fernet

from service.client import RelaunchClient
from service.local_cluster import LocalCluster, free_port
from tests.e2e.helpers import POLL_S, dump_logs, wait_terminal
from tests.helpers import wait_for

WRITES_ITS_SECRET = """\
import os
with open("secret.txt", "w") as out:
    out.write(os.environ["HF_TOKEN"])
"""
SPEC = {"name": "j", "task": {"name": "regression", "params": {"epochs": 1}}, "nnodes": "1"}


def _assignment_env(c: LocalCluster) -> dict[str, str]:
    """Register a node by hand (no agent: nothing runs) and heartbeat until it is given
    the job; the env of that assignment."""
    with httpx.Client(base_url=c.url, timeout=10.0) as http:
        reply = http.post(
            "/api/v1/nodes/register",
            json={"name": "n1", "address": "127.0.0.1", "slots": 1, "pid": 1},
            headers={"authorization": f"Bearer {c.enrolment_token}"},
        )
        reply.raise_for_status()
        node = reply.json()
        auth = {"authorization": f"Bearer {node['node_token']}"}

        def assignments() -> list[dict[str, str]]:
            beat = http.post(
                f"/api/v1/nodes/{node['node_id']}/heartbeat", json={"running": []}, headers=auth
            )
            beat.raise_for_status()
            found: list[dict[str, str]] = beat.json()["assignments"]
            return found

        wait_for("an assignment", lambda: assignments() != [], 30, POLL_S)
        env: dict[str, str] = assignments()[0]["env"]  # type: ignore[assignment]
        return env


def test_a_secret_is_encrypted_at_rest_and_a_wrong_key_stops_the_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    c = LocalCluster(data_dir=data, port=free_port())
    secret = f"hunter2-{uuid.uuid4().hex}"
    wrong = Fernet.generate_key().decode()
    try:
        c.start_controller()
        with c.client() as client:
            job = client.submit({**SPEC, "env": {"HF_TOKEN": secret}})
            assert client.job(job["id"])["spec"]["env"] == {"HF_TOKEN": "<redacted>"}
        assert _assignment_env(c) == {"HF_TOKEN": secret}
        c.stop("controller")

        assert stat.S_IMODE(data.stat().st_mode) == 0o711
        for name in ("relaunch.db", "secrets.key"):
            assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
        for each in data.glob("relaunch.db*"):
            assert secret.encode() not in each.read_bytes(), each

        with pytest.raises(RuntimeError, match="the controller exited"):
            c.start_controller({"RELAUNCH_SECRETS_KEYS": wrong})
        log = (data / "controller.log").read_text()
        assert "cannot start" in log and "RELAUNCH_SECRETS_KEYS" in log
        assert wrong not in log and secret not in log

        c.start_controller()  # the right key (its own key file) again
        with c.client() as client:
            assert client.job(job["id"])["spec"]["env"] == {"HF_TOKEN": "<redacted>"}
    finally:
        c.stop_all()
        dump_logs(data)


def test_the_workers_read_the_secret_and_no_log_or_database_file_holds_it(
    cluster: LocalCluster, client: RelaunchClient, tmp_path: Path
) -> None:
    script = tmp_path / "writes_its_secret.py"
    script.write_text(WRITES_ITS_SECRET)
    secret = f"hunter2-{uuid.uuid4().hex}"
    spec = {"name": "secret", "script": {"path": str(script)}, "env": {"HF_TOKEN": secret}}
    job_id = client.submit(spec)["id"]
    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    assert (cluster.snapshot_dir(job_id) / "secret.txt").read_text() == secret
    for each in [*cluster.data_dir.glob("*.log"), *cluster.data_dir.glob("relaunch.db*")]:
        assert secret.encode() not in each.read_bytes(), each
