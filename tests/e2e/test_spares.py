"""Spares end to end: agents that keep a spare launcher and zygote loaded (root's, before any
job) hand them a job, whose workers then run as the job's user, survive a SIGKILL, and leave
nothing behind."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import psutil
import pytest

from service.client import RelaunchClient
from service.local_cluster import LocalCluster
from tests.e2e.helpers import POLL_S, regression_spec, running_cluster, wait_terminal
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
SPARES_ON = {"RELAUNCH_AGENT_SPARE_LAUNCHER": "true"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Each agent registers once its spares have loaded (at most 30 s after they start).
    with running_cluster(
        tmp_path_factory.mktemp("spares"), ("node-a", "node-b"), agent_env=SPARES_ON,
        wait_nodes_s=120,
    ) as c:  # fmt: skip
        yield c


def _workers(cluster: LocalCluster, attempt_ids: set[int]) -> list[psutil.Process]:
    """The live workers the attempts' launchers recorded (``workers.json``): a worker forked
    from a spare shows the spare's environment in /proc, without the job's variables."""
    found = []
    for record in cluster.nodes_dir.glob("agents/*/attempts/*/workers.json"):
        if int(record.parent.name) not in attempt_ids:
            continue
        for pid in json.loads(record.read_text()):
            try:
                proc = psutil.Process(int(pid))
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except psutil.NoSuchProcess:
                continue
    return found


def test_a_job_adopts_the_spares_survives_a_killed_worker_and_leaves_nothing(
    cluster: LocalCluster, client: RelaunchClient
) -> None:
    job_id = client.submit(regression_spec("spares", step_delay=0.15))["id"]
    wait_for("step 20", lambda: (client.job(job_id)["last_step"] or 0) >= 20, 120, POLL_S)
    events = client.events(job_id)
    zygotes = [e for e in events if e["kind"] == "zygote"]
    assert len(zygotes) == 2, zygotes
    assert all(e["data"]["spare"] for e in zygotes), zygotes
    assert all("the node's spare, loaded before" in e["message"] for e in zygotes), zygotes
    attempts = {a["id"] for a in client.job(job_id)["attempts"]}
    victims = _workers(cluster, attempts)
    assert len(victims) == 2, victims
    seen = list(victims)
    for proc in victims:
        assert set(proc.uids()) != {0}  # the job's user, not root's
        zygote = proc.parent()
        assert zygote.pid in {e["data"]["pid"] for e in zygotes}
        assert set(zygote.uids()) == set(proc.uids())
        seen += [zygote, zygote.parent()]  # and the launcher that was a spare
    victims[0].send_signal(signal.SIGKILL)

    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    assert job["restart_count"] >= 1
    kinds = [e["kind"] for e in client.events(job_id)]
    assert "cold_start" not in kinds  # the restarted worker was a fork of the adopted spare
    assert [m["step"] for m in client.metrics(job_id)][-1] == job["total_steps"]
    # The launchers that were spares, their zygotes and every worker are gone.
    wait_for("no process of the job", lambda: not any(p.is_running() for p in seen), 30, POLL_S)
