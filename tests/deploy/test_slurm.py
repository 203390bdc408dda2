"""deploy/slurm/relaunch-agents.sbatch on a real Slurm: two slurmd on this host, a real
controller, and the agents that srun starts, one per node, as Slurm starts and ends them."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from service.client import RelaunchClient
from service.local_cluster import LocalCluster
from tests.deploy.slurm import LocalSlurm
from tests.e2e.helpers import (
    NODE_TIMEOUT_S,
    POLL_S,
    assert_trained,
    newest_metric_id,
    regression,
    running_cluster,
    wait_no_processes,
    wait_terminal,
    wait_world_size,
)
from tests.helpers import wait_for

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "relaunch-agents.sbatch"
NODES = ("n1", "n2")
SUBMITTERS_SECRET = "SUBMITTERS_CLOUD_KEY"
KEPT = "NCCL_SOCKET_IFNAME"
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    s = LocalSlurm(tmp_path_factory.mktemp("slurm"), NODES)
    try:
        s.start()
        yield s
    finally:
        s.stop()
        print(s.logs())


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A controller and no agent: Slurm starts them. The node timeout is the e2e tests'
    short one, so that a node Slurm takes back is found lost in seconds, not ten."""
    env = {"RELAUNCH_NODE_TIMEOUT_S": str(NODE_TIMEOUT_S)}
    with running_cluster(tmp_path_factory.mktemp("cluster"), controller_env=env) as c:
        yield c


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[RelaunchClient]:
    with cluster.client() as c:
        yield c


def submit_agents(slurm: LocalSlurm, cluster: LocalCluster, tmp_path: Path) -> int:
    """The script as the README says to submit it; its Slurm job id."""
    token = tmp_path / "enrolment-token"
    token.write_text(cluster.enrolment_token)
    token.chmod(0o600)
    env = {
        "RELAUNCH_AGENT_CONTROLLER_URL": cluster.url,
        "RELAUNCH_AGENT_ENROLMENT_TOKEN_FILE": str(token),
        "RELAUNCH_AGENT_ISOLATION": cluster.isolation,
        "RELAUNCH_AGENT_ADDRESS": "127.0.0.1",  # every node is this host
        "RELAUNCH_COMMAND": f"{sys.executable} -m service.cli",
        "RELAUNCH_SLURM_WORK_ROOT": str(cluster.nodes_dir / "agents"),
        # The submitter's shell: a secret of its own must not reach any job; a name the
        # submitter asks to keep does.
        SUBMITTERS_SECRET: "s3cr3t-of-the-submitter",
        "RELAUNCH_SLURM_KEEP_ENV": KEPT,
        KEPT: "lo",
    }
    output = tmp_path / "agents-%j.out"
    return slurm.sbatch(SCRIPT, f"--nodes={len(NODES)}", f"--output={output}", env=env)


def node_states(client: RelaunchClient) -> dict[str, str]:
    return {n["name"]: n["state"] for n in client.nodes()}


def processes_of(cluster: LocalCluster) -> list[psutil.Process]:
    """Every process on this host that was told this controller's URL (batch shell, srun,
    agents, launchers, workers), the controller itself aside."""
    found = []
    for proc in psutil.process_iter():
        try:
            if cluster.url in proc.environ().values():
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_agents_gone(slurm: LocalSlurm, cluster: LocalCluster, job: int) -> dict[str, str]:
    """Until the Slurm job has ended and left no process behind; its final fields."""
    assert processes_of(cluster), "no process of the agents to begin with"
    fields: dict[str, str] = wait_for(
        f"Slurm job {job} to end",
        lambda: (f := slurm.job(job))["JobState"] not in ("PENDING", "RUNNING", "COMPLETING") and f,
        90,
        POLL_S,
    )
    wait_for("no process of the agents", lambda: not processes_of(cluster), 30, POLL_S)
    return fields


def test_agents_on_an_allocation_run_a_job_and_leave_when_it_is_cancelled(
    slurm: LocalSlurm, cluster: LocalCluster, client: RelaunchClient, tmp_path: Path
) -> None:
    job = submit_agents(slurm, cluster, tmp_path)
    wait_for(
        "an agent per Slurm node", lambda: node_states(client) == dict.fromkeys(NODES, "ALIVE")
    )

    job_id = client.submit(regression("on-slurm", "2:2"))["id"]
    wait_world_size(client, job_id, 2)
    workers = cluster.job_workers(job_id)
    assert len(workers) == 2, workers
    for worker in workers:
        environ = worker.environ()
        assert not [k for k in environ if k.startswith("SLURM")], worker  # relaunch's ranks
        assert SUBMITTERS_SECRET not in environ, worker  # the agent started from an allow-list
        assert environ.get(KEPT) == "lo", worker  # ... that RELAUNCH_SLURM_KEEP_ENV extends
    assert_trained(client, wait_terminal(client, job_id))
    wait_no_processes(cluster, job_id)

    slurm.run("scancel", str(job))  # the allocation ends: SIGTERM, SIGKILL after KillWait
    fields = wait_agents_gone(slurm, cluster, job)
    assert fields["JobState"] == "CANCELLED"
    assert node_states(client) == dict.fromkeys(NODES, "LEFT")  # said goodbye, not timed out
    out = (tmp_path / f"agents-{job}.out").read_text()
    assert not re.search(r"task \d+: (Exited|Killed)", out), out  # every agent exited 0
    assert "agent stopped" in out


def test_sigterm_to_the_agents_step_while_a_job_runs_makes_them_leave(
    slurm: LocalSlurm, cluster: LocalCluster, client: RelaunchClient, tmp_path: Path
) -> None:
    """SIGTERM to the agents' step while a job runs (what --signal=TERM@120 sends before the
    time limit; sent here with scancel --signal=TERM, since a test cannot wait out a time
    limit): they stop their part of the job and leave, and the allocation ends cleanly."""
    job = submit_agents(slurm, cluster, tmp_path)
    wait_for(
        "an agent per Slurm node", lambda: node_states(client) == dict.fromkeys(NODES, "ALIVE")
    )
    spec = regression("until-warned", "1:2", params={"epochs": 50}, wait_for_nodes_s=300)
    job_id = client.submit(spec)["id"]
    wait_world_size(client, job_id, 2)

    slurm.run("scancel", "--signal=TERM", str(job))
    fields = wait_agents_gone(slurm, cluster, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0")  # srun: all 0
    assert node_states(client) == dict.fromkeys(NODES, "LEFT")
    members = client.job(job_id)["attempts"][-1]["members"]
    assert {m["state"] for m in members} == {"LEFT"}
    assert not cluster.job_processes(job_id)
    client.cancel(job_id)


def test_the_batch_shell_passes_sigterm_on_to_the_agents(
    slurm: LocalSlurm, cluster: LocalCluster, client: RelaunchClient, tmp_path: Path
) -> None:
    """--signal=B:TERM@... or scancel --batch signals only the batch shell; srun must not
    get it (it would kill its tasks at once), the agents must."""
    job = submit_agents(slurm, cluster, tmp_path)
    wait_for(
        "an agent per Slurm node", lambda: node_states(client) == dict.fromkeys(NODES, "ALIVE")
    )

    slurm.run("scancel", "--batch", "--signal=TERM", str(job))
    fields = wait_agents_gone(slurm, cluster, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0")
    assert node_states(client) == dict.fromkeys(NODES, "LEFT")


def test_a_node_slurm_takes_back_is_lost_and_the_job_goes_on_without_it(
    slurm: LocalSlurm, cluster: LocalCluster, client: RelaunchClient, tmp_path: Path
) -> None:
    """A node set DOWN (failed, or taken back): Slurm kills its agent without a warning;
    --no-kill keeps the allocation and the other agent; the controller finds the node lost
    when its heartbeats stop, and the job trains on with the node it has left."""
    job = submit_agents(slurm, cluster, tmp_path)
    wait_for(
        "an agent per Slurm node", lambda: node_states(client) == dict.fromkeys(NODES, "ALIVE")
    )
    spec = regression("taken-back", "1:2", params={"epochs": 50})
    job_id = client.submit(spec)["id"]
    wait_world_size(client, job_id, 2)

    seen = newest_metric_id(client, job_id)
    slurm.run("scontrol", "update", "nodename=n2", "state=down", "reason=taken back")
    try:
        wait_for("n2 lost", lambda: node_states(client) == {"n1": "ALIVE", "n2": "LOST"}, 60)
        wait_world_size(client, job_id, 1, after_id=seen)
        assert slurm.job(job)["JobState"] == "RUNNING"
        client.cancel(job_id)
        wait_no_processes(cluster, job_id)
        slurm.run("scancel", str(job))
        wait_agents_gone(slurm, cluster, job)
        assert node_states(client) == {"n1": "LEFT", "n2": "LOST"}
    finally:  # back in service for the next test (ReturnToService=2 on its next contact)
        wait_for("n2 back", lambda: slurm.node_states() == ["idle"] * len(NODES), 120, 1)
