"""Two controller processes on one PostgreSQL database: one acts, the other stands by
and takes over when the first is SIGKILLed, while agents given both go on with the
second."""

from __future__ import annotations

import itertools
import pickle
import signal
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from cryptography.fernet import Fernet

from contract.rendezvous import RENDEZVOUS_PATH, RendezvousState, decode
from service.client import RelaunchClient
from service.local_cluster import LocalCluster, free_port
from tests.e2e.helpers import POLL_S, assert_trained, dump_logs, regression, wait_terminal
from tests.helpers import wait_for
from worker import node_token

pytestmark = pytest.mark.e2e
LEASE_S = 2.0
SECRETS_KEY = Fernet.generate_key().decode()


def _controller(
    data: Path, database_url: str, name: str, first: LocalCluster | None = None
) -> LocalCluster:
    """A controller; after the ``first``, one that shares its database and secrets (the
    first admin is made, and its token shown, only by the controller that starts first)."""
    c = LocalCluster(data_dir=data / name, port=free_port(), snapshot_root=data / "snapshots")
    if first is not None:
        c.admin_token, c.enrolment_token = first.admin_token, first.enrolment_token
    c.data_dir.mkdir(parents=True)
    c.start_controller(
        {
            "DATABASE_URL": database_url,
            "RELAUNCH_CONTROLLER_ID": name,
            "RELAUNCH_LEADER_LEASE_S": str(LEASE_S),
            "RELAUNCH_SECRETS_KEYS": SECRETS_KEY,  # the same on every controller
        }
    )
    return c


@pytest.fixture
def pair(tmp_path: Path, pg_database: str) -> Iterator[tuple[LocalCluster, LocalCluster]]:
    a = _controller(tmp_path, pg_database, "ctl-a")
    b = _controller(tmp_path, pg_database, "ctl-b", first=a)
    try:
        yield a, b
    finally:
        for c in (a, b):
            c.stop_all()
            dump_logs(c.data_dir)


def _health(c: LocalCluster) -> dict[str, Any]:
    with c.client() as client:
        return client.health()


def _leader_and_standby(a: LocalCluster, b: LocalCluster) -> tuple[LocalCluster, LocalCluster]:
    wait_for("a leader", lambda: _health(a)["leader"] is not None, 20, POLL_S)
    roles = {_health(c)["controller"]: _health(c)["role"] for c in (a, b)}
    assert sorted(roles.values()) == ["leader", "standby"], roles
    return (a, b) if roles["ctl-a"] == "leader" else (b, a)


def test_one_controller_acts_and_the_other_takes_over_when_it_dies(
    pair: tuple[LocalCluster, LocalCluster],
) -> None:
    leader, standby = _leader_and_standby(*pair)

    with standby.client() as client:  # the standby serves the API too
        node = {"name": "n1", "address": "127.0.0.1", "slots": 1, "pid": 1}
        enrol = {"authorization": f"Bearer {standby.enrolment_token}"}
        registered = httpx.post(f"{standby.url}/api/v1/nodes/register", json=node, headers=enrol)
        node_id, node_token = registered.json()["node_id"], registered.json()["node_token"]
        job_id = client.submit({"name": "j", "task": {"name": "regression"}, "nnodes": "1"})["id"]
        placed = wait_for("placement", lambda: client.job(job_id)["attempts"], 20, POLL_S)
        assert len(placed) == 1

        leader.stop("controller", signal.SIGKILL)
        health = wait_for(
            "the standby to take over",
            lambda: (h := client.health())["role"] == "leader" and h,
            LEASE_S * 10,
            POLL_S,
        )
        assert health["leader"] == health["controller"]
        second = client.submit({"name": "k", "task": {"name": "regression"}, "nnodes": "1"})["id"]
        client.cancel(job_id)  # frees n1 for the second job, which the new leader places
        beat = httpx.post(
            f"{standby.url}/api/v1/nodes/{node_id}/heartbeat",
            json={"running": []},
            headers={"authorization": f"Bearer {node_token}"},
        )
        assert beat.status_code == 200
        assert wait_for("placement by the new leader", lambda: client.job(second)["attempts"], 20)
        placed_events = [e for e in client.events(job_id) if e["kind"] == "placed"]
        assert len(placed_events) == 1  # never placed twice


@pytest.fixture
def nodes(tmp_path: Path, pair: tuple[LocalCluster, LocalCluster]) -> Iterator[LocalCluster]:
    """Where node agents run: their own directories, the controllers' snapshot root."""
    a, _ = pair
    c = LocalCluster(
        data_dir=tmp_path / "nodes",
        port=0,  # no controller of its own: each agent is told the controllers'
        snapshot_root=a.snapshots,
        enrolment_token=a.enrolment_token,
        admin_token=a.admin_token,
    )
    c.data_dir.mkdir()
    try:
        yield c
    finally:
        c.stop_all()
        dump_logs(c.data_dir)


def _spec(name: str, step_delay: float) -> dict[str, Any]:
    params = {"epochs": 4, "step_delay": step_delay, "log_every_steps": 1}
    return regression(name, "2:2", params=params, snapshot={"every_steps": 8})


def _kill_host(c: LocalCluster) -> list[str]:
    """SIGKILL the controller of ``c`` and every process under it, as if its host died;
    the command lines of what was killed."""
    controller = psutil.Process(c.procs["controller"].pid)
    host = [controller, *controller.children(recursive=True)]
    killed = [" ".join(p.cmdline()) for p in host]
    for proc in host:
        proc.kill()
    c.procs.pop("controller").wait()
    psutil.wait_procs(host, timeout=10)
    return killed


def _keep_alives(nodes: LocalCluster, name: str, url: str, rdzv_id: str) -> list[datetime]:
    """When each launcher of a rendezvous last wrote its keep-alive, as torch keeps it in the
    rendezvous state, read at the controller ``url`` with node ``name``'s own token."""
    token = node_token.token_file(nodes.agent_dir(name)).read_text().strip()
    reply = httpx.get(
        f"{url}{RENDEZVOUS_PATH}/{rdzv_id}/state", headers={"authorization": f"Bearer {token}"}
    )
    reply.raise_for_status()
    stored = RendezvousState.model_validate_json(reply.content).state
    assert stored is not None
    # torch's own pickle of its _RendezvousState, written by this test's launchers
    state = pickle.loads(decode(stored))
    return sorted(state.last_heartbeats.values())


def _steps_around(metrics: list[dict[str, Any]], at: datetime) -> list[tuple[float, int]]:
    """(seconds after ``at``, step) of every step reported from 3 s before ``at`` to 10 s
    after it: the timeline of training around ``at``."""
    timeline = [
        ((datetime.fromisoformat(m["time"]) - at).total_seconds(), m["step"]) for m in metrics
    ]
    return [(t, step) for t, step in timeline if -3 <= t <= 10]


def test_a_job_trains_on_through_the_death_of_the_leaders_host(
    pair: tuple[LocalCluster, LocalCluster], nodes: LocalCluster
) -> None:
    """Agents that know both controllers: the leader's host dies (SIGKILL, everything on
    it) while a 2-node job trains; the job trains on in the same attempt with no restart,
    the standby takes over and places the next job, and both end with the model of an
    uninterrupted run."""
    leader, standby = _leader_and_standby(*pair)
    controllers = f"{leader.url},{standby.url}"  # the leader first: its death is felt
    for name in ("node-a", "node-b"):
        nodes.start_agent(name, controller=controllers)
    leader.wait_nodes(2)
    with leader.client() as before:
        job_id = before.submit(_spec("through", step_delay=0.2))["id"]
        wait_for("step 8", lambda: (before.job(job_id)["last_step"] or 0) >= 8, 120, POLL_S)
        attempts = before.job(job_id)["attempts"]
    assert len(attempts) == 1, attempts

    killed_at = datetime.now(UTC)
    killed = _kill_host(leader)
    # The rendezvous is kept in the database: the controller starts no store, nor any
    # other process that a job would lose with its host, only its reconciler's.
    assert len(killed) == 2 and "reconciler_process" in killed[1], killed

    with standby.client() as client:
        step_at_kill = client.job(job_id)["last_step"]
        wait_for(
            "the standby to take over",
            lambda: client.health()["role"] == "leader",
            LEASE_S * 10,
            POLL_S,
        )
        # Both launchers keep their rendezvous alive through the survivor: torch's elastic
        # agents would otherwise give up on the rendezvous once its retries ran out.
        rdzv_id = attempts[0]["rdzv_id"]
        wait_for(
            "every launcher's keep-alive after the kill",
            lambda: min(_keep_alives(nodes, "node-a", standby.url, rdzv_id)) > killed_at,
            30,
            POLL_S,
        )
        wait_for(
            "training to go on",
            lambda: (client.job(job_id)["last_step"] or 0) >= step_at_kill + 8,
            60,
            POLL_S,
        )
        later_id = client.submit(_spec("after", step_delay=0.0))["id"]
        job = wait_terminal(client, job_id)
        later = wait_terminal(client, later_id)
        _assert_no_restart(client, job, attempts[0], killed_at)
        assert_trained(client, job)
        assert_trained(client, later)
        # Placed after the kill, so by the one controller left, the new leader.
        placed = [e for e in client.events(later_id) if e["kind"] == "placed"]
        assert len(placed) == 1 and datetime.fromisoformat(placed[0]["time"]) > killed_at
        timeline = _steps_around(client.metrics(job_id), killed_at)
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(timeline)]
        print(f"step {step_at_kill} reported at the kill; (s after the kill, step): {timeline}")
        print(f"longest time between two steps around the kill: {max(gaps):.2f} s")
    for key, value in _final(nodes, later_id).items():
        torch.testing.assert_close(_final(nodes, job_id)[key], value, rtol=1e-4, atol=1e-5)


def _assert_no_restart(
    client: RelaunchClient, job: dict[str, Any], attempt: dict[str, Any], killed_at: datetime
) -> None:
    assert job["restart_count"] == 0, job
    assert [a["id"] for a in job["attempts"]] == [attempt["id"]], job["attempts"]
    events = client.events(job["id"])
    kinds = [e["kind"] for e in events]
    assert kinds.count("placed") == 1, kinds
    trouble = {
        "worker_failed",
        "restarting",
        "resumed",
        "hang_detected",
        "node_failed",
        "node_missing",
        "node_late",
        "node_left",
        "node_stopped",
        "snapshot_failed",
    }
    assert not trouble & set(kinds), kinds
    after = [e for e in events if datetime.fromisoformat(e["time"]) > killed_at]
    assert "rendezvous" not in {e["kind"] for e in after}, after  # no new round
    assert "snapshot_saved" in {e["kind"] for e in after}, after  # the fence answered
    # Every step reported. A report the dead leader committed but did not answer is sent
    # again (delivery is at least once), so a step may be reported twice.
    steps = {m["step"] for m in client.metrics(job["id"])}
    assert steps == set(range(1, job["total_steps"] + 1)), steps


def _final(c: LocalCluster, job_id: int) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(
        c.snapshot_dir(job_id) / "final.pt", weights_only=True
    )
    return state
