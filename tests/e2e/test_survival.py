"""Jobs survive the loss and the arrival of whole nodes, controller restarts and hangs.

Each node is a real agent process with its launcher and workers under it.
"Killing a node" SIGKILLs every one of those processes at once.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from service.client import RelaunchClient
from service.local_cluster import LocalCluster
from tests.e2e.helpers import (
    NODE_TIMEOUT_S,
    POLL_S,
    all_logs,
    assert_trained,
    newest_metric_id,
    regression,
    running_cluster,
    wait_no_processes,
    wait_terminal,
    wait_world_size,
)
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    data = tmp_path_factory.mktemp("survival")
    with running_cluster(
        data, controller_env={"RELAUNCH_NODE_TIMEOUT_S": str(NODE_TIMEOUT_S)}
    ) as c:
        yield c


@pytest.fixture
def nodes(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """Names of agents this test starts; whatever is left of them is stopped after it."""
    started: list[str] = []
    yield started
    for name in started:
        cluster.stop(name)


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[RelaunchClient]:
    with cluster.client() as c:
        yield c


def alive_nodes(cluster: LocalCluster) -> set[str]:
    with cluster.client() as c:
        return {n["name"] for n in c.nodes() if n["state"] == "ALIVE"}


def start_nodes(cluster: LocalCluster, nodes: list[str], *names: str) -> None:
    """Start agents ``names``; first let the nodes of earlier tests be declared lost, so
    that no job is placed on a node that is already gone."""
    wait_for(
        "earlier tests' nodes to be lost",
        lambda: alive_nodes(cluster) <= set(nodes),
        NODE_TIMEOUT_S * 4,
        POLL_S,
    )
    for name in names:
        cluster.start_agent(name)
        nodes.append(name)
    wait_for(f"nodes {names} alive", lambda: set(names) <= alive_nodes(cluster), 60, POLL_S)


def node_of_rank(cluster: LocalCluster, job_id: int, rank: int) -> str:
    for proc in cluster.job_workers(job_id):
        env = cluster.worker_env(proc)
        if env.get("RANK") == str(rank):
            return env["RELAUNCH_NODE_NAME"]
    raise AssertionError(f"no worker of job {job_id} has rank {rank}")


@pytest.mark.parametrize("victim_rank", [0, 1], ids=["rank0-node", "other-node"])
def test_a_node_drops_out_and_a_new_one_joins_without_a_restart(
    cluster: LocalCluster,
    client: RelaunchClient,
    nodes: list[str],
    victim_rank: int,
) -> None:
    tag = f"drop{victim_rank}"
    start_nodes(cluster, nodes, f"{tag}-a", f"{tag}-b")
    # Slow enough steps that the job is still training at world size 1 when the new node's
    # agent, launcher and zygote have started: on a loaded 2-core machine that took up to
    # 12 s, and at 0.1 s a step the job used to finish first (about 8 s after the kill).
    job_id = client.submit(regression(tag, "1:2", params={"step_delay": 0.25}))["id"]
    wait_world_size(client, job_id, 2, after_step=6)
    victim = node_of_rank(cluster, job_id, victim_rank)

    seen = newest_metric_id(client, job_id)
    cluster.kill_node(victim)
    wait_world_size(client, job_id, 1, after_id=seen)
    seen = newest_metric_id(client, job_id)
    start_nodes(cluster, nodes, f"{tag}-c")
    wait_world_size(client, job_id, 2, after_id=seen)

    job = wait_terminal(client, job_id)
    assert_trained(client, job)
    assert job["restart_count"] == 0  # membership changes are not restarts
    assert job["membership_changes"] >= 2
    assert len(job["attempts"]) == 1  # the elastic agents re-formed in place
    kinds = [e["kind"] for e in client.events(job_id)]
    assert "node_left" in kinds and "node_joined" in kinds
    wait_no_processes(cluster, job_id)


def test_an_agent_stopped_with_sigterm_has_left_and_is_not_lost(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str]
) -> None:
    """``docker stop``: the agent says goodbye, so the node reads LEFT, not like a dead one."""
    start_nodes(cluster, nodes, "bye-a", "bye-b")
    job_id = client.submit(regression("goodbye", "1:2"))["id"]
    wait_world_size(client, job_id, 2, after_step=2)
    seen = newest_metric_id(client, job_id)
    cluster.stop("bye-b")  # SIGTERM, and wait for the agent to exit
    assert {n["name"]: n["state"] for n in client.nodes()}["bye-b"] == "LEFT"
    members = client.job(job_id)["attempts"][0]["members"]
    # On a loaded machine the node may have dropped out and rejoined before the stop, so
    # it can hold more than one membership: every one has ended as LEFT.
    states = [m["state"] for m in members if m["node_name"] == "bye-b"]
    assert states and set(states) == {"LEFT"}, members
    wait_world_size(client, job_id, 1, after_id=seen)
    client.cancel(job_id)
    wait_no_processes(cluster, job_id)


def test_below_min_the_job_waits_and_resumes_when_a_node_comes(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str]
) -> None:
    start_nodes(cluster, nodes, "min-a", "min-b")
    job_id = client.submit(regression("below-min", "2:2", wait_for_nodes_s=300))["id"]
    wait_for("a snapshot", lambda: client.snapshots(job_id), 120, POLL_S)
    cluster.kill_node("min-b")

    waiting = wait_for(
        "the job to wait", lambda: (j := client.job(job_id))["state"] == "WAITING" and j, 60
    )
    assert waiting["restart_count"] == 0
    wait_no_processes(cluster, job_id)  # the survivor stopped its part
    start_nodes(cluster, nodes, "min-c")

    job = wait_terminal(client, job_id)
    assert_trained(client, job)
    assert job["restart_count"] == 0
    assert [a["number"] for a in job["attempts"]] == [1, 2]
    resumed = [e for e in client.events(job_id) if e["kind"] == "resumed"]
    assert resumed and resumed[-1]["data"]["resumed_from_step"] > 0


def test_a_killed_agent_leaves_no_worker_behind(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str]
) -> None:
    start_nodes(cluster, nodes, "orphan-a")
    job_id = client.submit(regression("orphans", "1:1"))["id"]
    wait_for("training", lambda: (client.job(job_id)["last_step"] or 0) > 2, 120, POLL_S)
    workers = cluster.job_workers(job_id)
    assert workers

    cluster.procs["orphan-a"].send_signal(signal.SIGKILL)  # the agent alone
    cluster.procs["orphan-a"].wait()
    gone = psutil.wait_procs(workers, timeout=20)[1]
    assert gone == [], f"workers outlived their agent: {gone}"
    wait_no_processes(cluster, job_id)
    client.cancel(job_id)


def test_the_job_survives_a_controller_restart(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str]
) -> None:
    start_nodes(cluster, nodes, "ctl-a", "ctl-b")
    job_id = client.submit(regression("ctl-restart", "2:2", params={"step_delay": 0.15}))["id"]
    wait_for("training", lambda: (client.job(job_id)["last_step"] or 0) > 4, 120, POLL_S)
    workers = {p.pid for p in cluster.job_workers(job_id)}

    cluster.stop("controller", signal.SIGKILL)
    time.sleep(2)
    cluster.start_controller({"RELAUNCH_NODE_TIMEOUT_S": str(NODE_TIMEOUT_S)})
    started = time.monotonic()
    step = client.job(job_id)["last_step"] or 0
    wait_for("progress reported again", lambda: (client.job(job_id)["last_step"] or 0) > step)
    recovered_s = time.monotonic() - started
    assert client.job(job_id)["state"] == "RUNNING"
    assert {p.pid for p in cluster.job_workers(job_id)} == workers  # not even restarted

    job = wait_terminal(client, job_id)
    assert_trained(client, job)
    assert job["restart_count"] == 0
    print(f"state right again {recovered_s:.1f} s after the controller came back")


def test_a_paused_node_that_comes_back_is_fenced_out_of_its_old_attempt(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str]
) -> None:
    start_nodes(cluster, nodes, "pause-a", "pause-b")
    spec = regression("paused", "1:2", hang_timeout_s=5, params={"epochs": 5, "step_delay": 0.15})
    job_id = client.submit(spec)["id"]
    wait_world_size(client, job_id, 2, after_step=6)
    victim = node_of_rank(cluster, job_id, 0)
    seen = newest_metric_id(client, job_id)
    frozen = cluster.signal_node(victim, signal.SIGSTOP)
    try:
        # The survivor's collective blocks on the frozen peer until its hang detector
        # ends it; the controller drops the silent node; the survivor re-forms alone.
        wait_for(
            "the paused node to be lost",
            lambda: victim not in alive_nodes(cluster),
            NODE_TIMEOUT_S * 4,
            POLL_S,
        )
        wait_world_size(client, job_id, 1, after_id=seen)
    finally:
        for proc in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)

    def stale_part_stopped() -> bool:
        return any(
            e["kind"] == "node_stopped" and victim in e["message"] for e in client.events(job_id)
        )

    wait_for("the paused node to stop its stale part", stale_part_stopped, 60, POLL_S)
    job = wait_terminal(client, job_id)
    assert_trained(client, job)
    attempt = job["attempts"][0]
    victim_rows = [m for m in attempt["members"] if m["node_name"] == victim]
    # Its old membership is over; back and free, it may join the attempt again in
    # place, always with a new membership.
    assert victim_rows[0]["state"] == "LEFT"
    assert all(m["joined_at"] >= victim_rows[0]["left_at"] for m in victim_rows[1:])
    wait_no_processes(cluster, job_id)


def test_a_frozen_node_is_dropped_and_the_survivor_re_forms_at_once_without_a_restart(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str]
) -> None:
    """A whole node (agent, launcher, workers) freezes: no socket ever fails, and the
    job's default hang timeout (minutes) is far off. The controller's heartbeat timeout
    alone drops it, and the survivor's agent ends its stuck workers; they re-form alone
    from the newest snapshot. The node thaws and joins the attempt again in place."""
    start_nodes(cluster, nodes, "freeze-a", "freeze-b")
    spec = regression("frozen", "1:2", params={"epochs": 8, "step_delay": 0.15})
    assert "hang_timeout_s" not in spec
    job_id = client.submit(spec)["id"]
    wait_world_size(client, job_id, 2, after_step=6)
    victim = node_of_rank(cluster, job_id, 1)
    seen = newest_metric_id(client, job_id)
    frozen = cluster.signal_node(victim, signal.SIGSTOP)
    try:
        frozen_at = time.monotonic()
        wait_world_size(client, job_id, 1, after_id=seen)
        recovered_s = time.monotonic() - frozen_at
        job = client.job(job_id)
        assert (job["state"], job["restart_count"]) == ("RUNNING", 0)
        assert len(job["attempts"]) == 1
    finally:
        seen = newest_metric_id(client, job_id)
        for proc in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)
    print(f"the survivor trained again {recovered_s:.1f} s after the freeze")
    wait_world_size(client, job_id, 2, after_id=seen)
    job = wait_terminal(client, job_id)
    assert_trained(client, job)
    assert job["restart_count"] == 0
    assert len(job["attempts"]) == 1
    failed = [e for e in client.events(job_id) if e["kind"] == "worker_failed"]
    assert {e["data"]["cause"] for e in failed} <= {"membership_change", "peer_lost"}
    assert "membership_change" in {e["data"]["cause"] for e in failed}
    wait_no_processes(cluster, job_id)


def test_more_membership_changes_than_the_restart_budget_spend_no_restart_anywhere(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str]
) -> None:
    """A node leaves and comes back twice (four membership changes, each a new group of
    the other node's workers); max_restarts is 3, for relaunch and for torch's launchers
    alike, so changes that each spent a restart of either budget would end the job. The other
    node's launcher sees every departure (each broke its workers' collective), and nothing
    of either budget is spent: no launcher gives up."""
    start_nodes(cluster, nodes, "churn-a", "churn-b")
    spec = regression("churn", "1:2", params={"epochs": 20, "step_delay": 0.1})
    assert spec["max_restarts"] == 3
    job_id = client.submit(spec)["id"]
    wait_world_size(client, job_id, 2, after_step=2)
    for _ in range(2):
        name = "churn-b"
        seen = newest_metric_id(client, job_id)
        cluster.stop(name)  # SIGTERM: the agent stops its part and leaves
        wait_world_size(client, job_id, 1, after_id=seen)
        seen = newest_metric_id(client, job_id)
        cluster.start_agent(name)  # back under its name: it joins the attempt in place
        wait_world_size(client, job_id, 2, after_id=seen)
    job = wait_terminal(client, job_id)
    assert_trained(client, job)
    assert (job["restart_count"], len(job["attempts"])) == (0, 1)
    assert job["membership_changes"] >= 4
    kinds = [e["kind"] for e in client.events(job_id)]
    assert "node_failed" not in kinds and "restarting" not in kinds
    wait_no_processes(cluster, job_id)


def test_a_hung_worker_is_detected_dumped_and_restarted(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str]
) -> None:
    start_nodes(cluster, nodes, "hang-a", "hang-b")
    spec = regression(
        "hang",
        "2:2",
        hang_timeout_s=4,
        collective_timeout_s=45,
        params={"freeze_at_step": 12, "freeze_rank": 1},
    )
    job_id = client.submit(spec)["id"]

    job = wait_terminal(client, job_id)
    assert_trained(client, job)
    assert job["restart_count"] == 1
    events = client.events(job_id)
    hangs = [e for e in events if e["kind"] == "hang_detected"]
    assert hangs and hangs[0]["data"]["idle_s"] >= 4
    assert (hangs[0]["data"]["timeout_s"], hangs[0]["data"]["rule"]) == (4, "fixed")
    failed = [e for e in events if e["kind"] == "worker_failed"]
    assert {e["data"]["cause"] for e in failed} == {"hang"}
    dumps = [line for line in all_logs(client, job_id) if "most recent call" in line["line"]]
    assert dumps, "no stack dump in the job's logs"
    # The spec's collective timeout reached every worker's process group.
    joined = [line for line in all_logs(client, job_id) if "joined process group" in line["line"]]
    assert joined and all("collective timeout=45s" in line["line"] for line in joined), joined
    wait_no_processes(cluster, job_id)


def _script(tmp: Path, name: str, body: str) -> str:
    path = tmp / name
    path.write_text(body)
    return str(path)


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_script.py"


def wait_members_finished(client: RelaunchClient, job_id: int) -> None:
    """Both members of the job's one attempt end FINISHED with exit code 0. The job
    succeeds with the first node's success; the other node's comes when its launcher has
    ended (after a worker that a signal ended, or was ended as hung), a moment later."""

    def finished() -> bool:
        [attempt] = client.job(job_id)["attempts"]
        return [(m["state"], m["exit_code"]) for m in attempt["members"]] == [("FINISHED", 0)] * 2

    wait_for("both members FINISHED with exit code 0", finished, timeout_s=60)


def _example_then(tmp: Path, name: str, then: str) -> str:
    """A script that runs the example for 40 steps, then ``then`` (os, sys and time are
    imported)."""
    return _script(
        tmp,
        name,
        "import os, runpy, sys, time\n"
        f"sys.argv = [{str(EXAMPLE)!r}, '--steps', '40', '--step-delay', '0.05']\n"
        f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n" + then,
    )


def _example_with_prelude(tmp: Path, name: str, prelude: str) -> str:
    """A script that runs ``prelude`` (os, sys and time are imported), then the example
    for 40 steps."""
    return _script(
        tmp,
        name,
        "import os, runpy, sys, time\n" + prelude + "\n"
        f"sys.argv = [{str(EXAMPLE)!r}, '--steps', '40', '--step-delay', '0.05']\n"
        f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n",
    )


def _succeeds_after_one_stuck_worker(
    client: RelaunchClient, name: str, script: str
) -> tuple[int, dict[str, Any]]:
    """Run ``script`` on two nodes with an 8 s hang timeout, whose rank 1 never exits: the
    job succeeds without a restart or a failed worker, and one hang of rank 1 is on its
    timeline. Returns the job's id and that event."""
    spec = {
        "name": name,
        "script": {"path": script},
        "nnodes": "2:2",
        "max_restarts": 3,
        "hang_timeout_s": 8,
    }
    job_id = client.submit(spec)["id"]
    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    assert job["restart_count"] == 0
    events = client.events(job_id)
    [hang] = [e for e in events if e["kind"] == "hang_detected"]
    assert hang["data"]["global_rank"] == 1
    assert not [e for e in events if e["kind"] in ("worker_failed", "restarting")]
    return job_id, hang


def test_a_worker_stuck_after_its_peers_finished_ends_without_a_restart(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str], tmp_path: Path
) -> None:
    """Rank 1 trains to the end, passes the last barrier, then never gets to its teardown
    (its ``destroy_process_group`` sleeps). Rank 0 has finished: it is in its teardown,
    which lasts past rank 1's hang timeout (gloo's can wait for the peer that never
    destroys its group), and then its node waits in torch's exit barrier. A restart would
    train the job again: the stuck worker is ended as hung, its node finishes, and the
    job succeeds without a restart."""
    start_nodes(cluster, nodes, "stuck-a", "stuck-b")
    prelude = (
        "import torch.distributed\n"
        "if os.environ['RANK'] == '1':\n"
        "    torch.distributed.destroy_process_group = lambda *a, **k: time.sleep(3600)\n"
        "else:\n"
        "    destroy = torch.distributed.destroy_process_group\n"
        "    def slow_destroy(*a, **k):\n"
        "        destroy(*a, **k)\n"
        "        time.sleep(12)\n"
        "    torch.distributed.destroy_process_group = slow_destroy\n"
    )
    script = _example_with_prelude(tmp_path, "stuck_before_teardown.py", prelude)
    job_id, hang = _succeeds_after_one_stuck_worker(client, "stuck-before-teardown", script)
    assert (hang["data"]["rule"], hang["data"]["peers_finished"]) == ("fixed", True)
    assert "without a restart" in hang["message"]
    # Both launchers ended as finished: the stuck worker's too, through torch's exit barrier.
    wait_members_finished(client, job_id)
    assert client.job(job_id)["last_step"] == 40
    wait_no_processes(cluster, job_id)


def test_a_worker_stuck_in_its_teardown_is_ended_as_finished(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str], tmp_path: Path
) -> None:
    """Rank 1 destroys its process group and then never exits, using no CPU (as a process
    group's destructor that waits for a thread can leave it). Its beats stopped long
    before, but a worker in its teardown is not judged by the hang timeout (8 s here):
    after 30 s without CPU it is ended as finished, and the job succeeds without a
    restart."""
    start_nodes(cluster, nodes, "teardown-a", "teardown-b")
    then = "if os.environ['RANK'] == '1':\n    time.sleep(3600)\n"
    script = _example_then(tmp_path, "stuck_in_teardown.py", then)
    job_id, hang = _succeeds_after_one_stuck_worker(client, "stuck-in-teardown", script)
    assert hang["data"]["rule"] == "teardown"
    assert "after it destroyed its process group" in hang["message"]
    assert "ended as finished, without a restart" in hang["message"]
    wait_members_finished(client, job_id)
    assert client.job(job_id)["last_step"] == 40
    wait_no_processes(cluster, job_id)


def test_a_worker_that_aborts_after_its_script_returned_has_finished(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str], tmp_path: Path
) -> None:
    """Rank 1's script returns, then its process aborts in its teardown, as torch's gloo
    can at exit: the job has done its work and succeeds, with no restart, whichever user
    its workers run as (the mark lies in the job's own directory under isolation)."""
    start_nodes(cluster, nodes, "abort-a", "abort-b")
    script = _example_then(
        tmp_path,
        "aborts_at_exit.py",
        "class AbortsWhenFreed:\n"  # freed in the teardown, after the exit handlers
        "    def __del__(self, abort=os.abort):\n"
        "        abort()\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.keep_until_teardown = AbortsWhenFreed()\n",
    )
    spec = {
        "name": "aborts-at-exit",
        "script": {"path": script},
        "nnodes": "2:2",
        "max_restarts": 3,
    }
    job_id = client.submit(spec)["id"]

    job = wait_terminal(client, job_id)
    assert job["state"] == "SUCCEEDED", job
    assert job["restart_count"] == 0
    events = client.events(job_id)
    assert not [e for e in events if e["kind"] in ("worker_failed", "restarting")]
    wait_members_finished(client, job_id)
    # The job succeeds with the first node's exit; rank 0's last step may come with the
    # other node's reports, which every member's exit has followed.
    assert client.job(job_id)["last_step"] == 40
    wait_no_processes(cluster, job_id)


def test_fatal_errors_fail_at_once_and_crashes_spend_the_budget(
    cluster: LocalCluster, client: RelaunchClient, nodes: list[str], tmp_path: Path
) -> None:
    start_nodes(cluster, nodes, "fatal-a", "fatal-b")
    crash = _script(tmp_path, "crash.py", "import sys\nsys.exit(3)\n")
    cases = {
        "missing-script": ({"path": str(tmp_path / "nope.py")}, {}),
        "import-error": ({"path": _script(tmp_path, "imp.py", "import no_such_mod_x\n")}, {}),
        "fatal-code": ({"path": _script(tmp_path, "f.py", "raise SystemExit(42)\n")}, {}),
        "budget": ({"path": crash}, {}),
    }
    ids = {}
    for name, (script, _) in cases.items():
        spec: dict[str, Any] = {
            "name": name,
            "script": script,
            "nnodes": "1",
            "max_restarts": 2,
            "restart_backoff_s": 0.5,
            "fatal_exit_codes": [42],
        }
        ids[name] = client.submit(spec)["id"]
    jobs = {name: wait_terminal(client, job_id) for name, job_id in ids.items()}

    for name in ("missing-script", "import-error", "fatal-code"):
        job = jobs[name]
        assert job["state"] == "FAILED", job
        assert job["restart_count"] == 0, job
    assert "does not exist" in jobs["missing-script"]["message"]
    assert "startup error" in jobs["import-error"]["message"]
    assert "no_such_mod_x" in jobs["import-error"]["message"]
    assert "fatal exit code" in jobs["fatal-code"]["message"]
    budget = jobs["budget"]
    assert budget["state"] == "FAILED"
    assert budget["restart_count"] == 3 and "restart budget spent" in budget["message"]
    restarts = [e for e in client.events(ids["budget"]) if e["kind"] == "restarting"]
    assert [e["data"]["backoff_s"] for e in restarts] == [0, 0.5]
    for job_id in ids.values():
        wait_no_processes(cluster, job_id)
