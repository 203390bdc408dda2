"""GPU nodes on CPU machines: agents told they have GPUs (``RELAUNCH_AGENT_GPUS``, which a
host without NVML takes on trust) register them, CUDA jobs are placed by free GPUs and get
them as ``CUDA_VISIBLE_DEVICES``, and a worker that finds fewer devices than local ranks
fails the job at start-up without spending a restart. CPU jobs get a thread count."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.client import RelaunchClient
from service.local_cluster import LocalCluster
from tests.e2e.helpers import (
    POLL_S,
    assert_trained,
    dumped_on_failure,
    regression,
    running_cluster,
    wait_terminal,
    wait_world_size,
)
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

CPUS = 6
NODES = {"gpus-4": "0,1,2,3", "gpus-2": "0,1"}

WRITES_ITS_ENVIRONMENT = """\
import json, os
names = ("RELAUNCH_DEVICE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "RELAUNCH_NODE_NAME")
with open(f"env-rank{os.environ['RANK']}.json", "w") as out:
    json.dump({name: os.environ.get(name) for name in names}, out)
"""


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("gpus")) as c:
        for name, gpus in NODES.items():
            settings = {
                "RELAUNCH_AGENT_GPUS": gpus,
                "RELAUNCH_AGENT_CPUS": str(CPUS),
                "RELAUNCH_AGENT_SLOTS": "2",
            }
            # The agents of the other tests inherit OMP_NUM_THREADS=1, which holds for all
            # their jobs; these find the thread count by the rule.
            c.start_agent(name, prefix=["env", "-u", "OMP_NUM_THREADS"], extra_env=settings)
        c.wait_nodes(len(NODES))
        yield c


@pytest.fixture
def client(gpu_cluster: LocalCluster) -> Iterator[RelaunchClient]:
    with gpu_cluster.client() as c:
        yield c


def _script(tmp_path: Path) -> str:
    path = tmp_path / "env.py"
    path.write_text(WRITES_ITS_ENVIRONMENT)
    return str(path)


def test_the_nodes_show_the_gpus_their_agents_were_given(client: RelaunchClient) -> None:
    nodes = {n["name"]: n for n in client.nodes() if n["state"] == "ALIVE"}
    assert {name: [g["index"] for g in nodes[name]["gpus"]] for name in NODES} == {
        "gpus-4": [0, 1, 2, 3],
        "gpus-2": [0, 1],
    }
    assert all(nodes[name]["cpus"] == CPUS for name in NODES)


def test_a_cuda_worker_that_sees_fewer_devices_than_local_ranks_fails_without_a_restart(
    client: RelaunchClient, tmp_path: Path
) -> None:
    """This host has no CUDA, so a worker of a job placed on two of a node's GPUs finds none:
    the job fails at once, with a message that names the devices it was given."""
    spec = {
        "name": "needs-2-gpus",
        "script": {"path": _script(tmp_path)},
        "device": "cuda",
        "nproc_per_node": 2,
        "max_restarts": 3,
    }
    job_id = client.submit(spec)["id"]
    job = wait_terminal(client, job_id)
    assert job["state"] == "FAILED", job
    assert job["restart_count"] == 0, job
    assert "DeviceShortage" in job["message"], job
    assert "CUDA_VISIBLE_DEVICES='0,1'" in job["message"], job


def test_a_cuda_job_no_node_can_hold_waits_with_its_reason(client: RelaunchClient) -> None:
    spec = {
        "name": "needs-8-gpus",
        "script": {"module": "examples.ddp_script"},
        "device": "cuda",
        "nproc_per_node": 8,
    }
    job_id = client.submit(spec)["id"]
    with dumped_on_failure(client, job_id):
        job = wait_for(
            "the job's waiting reason",
            lambda: "8 free GPUs" in (j := client.job(job_id))["message"] and j,
            30,
            POLL_S,
        )
    assert job["state"] == "PENDING", job
    client.cancel(job_id)
    assert wait_terminal(client, job_id)["state"] == "CANCELLED"


def _environments(job_dir: Path, ranks: int) -> list[dict[str, Any]]:
    return [json.loads((job_dir / f"env-rank{r}.json").read_text()) for r in range(ranks)]


def test_a_cpu_job_sees_no_gpu_and_gets_its_share_of_the_cores(
    gpu_cluster: LocalCluster, client: RelaunchClient, tmp_path: Path
) -> None:
    spec = {
        "name": "cpu-on-gpu-nodes",
        "script": {"path": _script(tmp_path)},
        "device": "cpu",
        "nproc_per_node": 2,
    }
    job_id = client.submit(spec)["id"]
    assert wait_terminal(client, job_id)["state"] == "SUCCEEDED"
    for env in _environments(gpu_cluster.snapshot_dir(job_id), 2):
        assert env["RELAUNCH_DEVICE"] == "cpu"
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["OMP_NUM_THREADS"] == str(CPUS // 2)


def test_a_thread_count_the_job_sets_is_kept(
    gpu_cluster: LocalCluster, client: RelaunchClient, tmp_path: Path
) -> None:
    spec = {
        "name": "own-threads",
        "script": {"path": _script(tmp_path)},
        "device": "cpu",
        "env": {"OMP_NUM_THREADS": "1"},
    }
    job_id = client.submit(spec)["id"]
    assert wait_terminal(client, job_id)["state"] == "SUCCEEDED"
    (env,) = _environments(gpu_cluster.snapshot_dir(job_id), 1)
    assert env["OMP_NUM_THREADS"] == "1"


@pytest.mark.gpu
def test_on_a_gpu_host_a_one_gpu_job_survives_a_worker_kill_and_a_bigger_one_waits(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """One agent that finds this host's GPUs itself (NVML): a CUDA job of one worker is
    placed on GPU 0, trains on it, survives a SIGKILL of its worker; a job that wants one
    GPU more than the node has waits with its reason."""
    with running_cluster(tmp_path_factory.mktemp("gpu-host")) as cluster:
        cluster.start_agent("gpu-node", extra_env={"RELAUNCH_AGENT_GPUS": ""})
        cluster.wait_nodes(1)
        with cluster.client() as client:
            (node,) = [n for n in client.nodes() if n["state"] == "ALIVE"]
            assert node["gpus"], node
            too_many = len(node["gpus"]) + 1
            big = client.submit(regression("too-big", "1", device="cuda", nproc_per_node=too_many))
            job_id = client.submit(regression("one-gpu", "1", device="cuda"))["id"]
            wait_world_size(client, job_id, 1, after_step=6)
            (worker,) = cluster.job_workers(job_id)
            worker.send_signal(signal.SIGKILL)
            job = wait_terminal(client, job_id)
            assert_trained(client, job)
            assert job["restart_count"] == 1, job
            assert job["device"] == "cuda", job
            waiting = client.job(big["id"])
            assert waiting["state"] == "PENDING", waiting
            assert f"{too_many} free GPU" in waiting["message"], waiting
            client.cancel(big["id"])
