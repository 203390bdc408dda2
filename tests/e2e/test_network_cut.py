"""Nodes as hosts: each agent in its own network namespace, with its own address.

A bridge joins the namespaces to the controller's side. Cutting a node's link
is a real network partition: its workers' gloo connections stall instead of
closing, its heartbeats stop, and when the link comes back the node must find
itself fenced out of the attempt the others went on with.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.hosts import Hosts
from service.local_cluster import LocalCluster, free_port
from tests.e2e.helpers import (
    NODE_TIMEOUT_S,
    POLL_S,
    assert_trained,
    dump_logs,
    newest_metric_id,
    regression,
    wait_no_processes,
    wait_terminal,
    wait_world_size,
)
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    made = Hosts()
    try:
        made.open()
        for name in ("host-a", "host-b"):
            made.add(name)
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def cluster(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    data = tmp_path_factory.mktemp("netns")
    c = LocalCluster(data_dir=data, port=free_port(), host=hosts.controller)
    try:
        c.start_controller({"RELAUNCH_NODE_TIMEOUT_S": str(NODE_TIMEOUT_S)})
        for name, (_, _, address) in hosts.nodes.items():
            c.start_agent(name, address=address, prefix=hosts.exec_prefix(name))
        c.wait_nodes(len(hosts.nodes))
        yield c
    finally:
        c.stop_all()
        dump_logs(data)


def test_a_node_cut_off_the_network_is_left_behind_and_fenced_when_it_returns(
    cluster: LocalCluster, hosts: Hosts
) -> None:
    with cluster.client() as client:
        spec = regression("cut", "1:2", hang_timeout_s=5, params={"epochs": 5, "step_delay": 0.15})
        job_id = client.submit(spec)["id"]
        wait_world_size(client, job_id, 2, after_step=6)
        envs = [cluster.worker_env(p) for p in cluster.job_workers(job_id)]
        rank0 = next(env for env in envs if env.get("RANK") == "0")
        victim = rank0["RELAUNCH_NODE_NAME"]
        assert rank0["MASTER_ADDR"] == hosts.nodes[victim][2]  # really another host

        seen = newest_metric_id(client, job_id)
        hosts.cut(victim)
        try:
            wait_for(
                "the cut-off node to be lost",
                lambda: any(n["name"] == victim and n["state"] == "LOST" for n in client.nodes()),
                NODE_TIMEOUT_S * 4,
                POLL_S,
            )
            wait_world_size(client, job_id, 1, after_id=seen)
        finally:
            hosts.mend(victim)

        def stale_part_stopped() -> bool:
            return any(
                e["kind"] == "node_stopped" and victim in e["message"]
                for e in client.events(job_id)
            )

        wait_for("the returning node to stop its stale part", stale_part_stopped, 60, POLL_S)
        job = wait_terminal(client, job_id)
        assert_trained(client, job)
        members = job["attempts"][0]["members"]
        # Its old membership ended when it was lost; back and free, it may join the
        # attempt again in place, with a new membership.
        assert next(m["state"] for m in members if m["node_name"] == victim) == "LEFT"
        wait_no_processes(cluster, job_id)
