"""GPU nodes through the real app: inventory at registration, use in heartbeats, CUDA jobs
placed on disjoint GPUs, and what the API shows of it."""

from __future__ import annotations

from typing import Any

import pytest

from service.db import transaction
from service.errors import StaleState
from service.models import Role
from service.placing import place_jobs
from service.reconciler import AddMembers, PlaceJob, Reconciler
from service.settings import ControllerSettings
from tests.helpers import FakeClock
from tests.service.helpers import (
    Cluster,
    bearer,
    engines_of,
    heartbeat,
    job,
    register,
    report,
    statements,
    submit,
)

GIB = 1024**3


def gpus(count: int, name: str = "NVIDIA H100", memory_gib: int = 80) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "name": name,
            "uuid": f"GPU-{name[-4:]}-{i}",
            "memory_total_bytes": memory_gib * GIB,
        }
        for i in range(count)
    ]


def register_gpu_node(api: Cluster, name: str, count: int) -> int:
    return register(
        api,
        name,
        slots=count,
        gpus=gpus(count),
        gpu_driver="550.54",
        cuda_version="12.4",
        cpus=32,
    )


def nodes_by_name(api: Cluster, token: str | None = None) -> dict[str, dict[str, Any]]:
    headers = bearer(token) if token else {}
    r = api.get("/api/v1/nodes", headers=headers)
    assert r.status_code == 200, r.text
    return {n["name"]: n for n in r.json()["items"]}


def test_cuda_jobs_run_on_disjoint_gpus_and_the_api_shows_who_holds_which(
    api: Cluster, reconciler: Reconciler
) -> None:
    big, small = register_gpu_node(api, "big", 4), register_gpu_node(api, "small", 2)
    ones = [submit(api, "1", nproc_per_node=1) for _ in range(2)]
    four = submit(api, "1", nproc_per_node=4)
    reconciler.run_once()

    small_work = {a["job_id"]: a for a in heartbeat(api, small)}
    assert {j: (a["device"], a["gpus"]) for j, a in small_work.items()} == {
        ones[0]: ("cuda", [0]),
        ones[1]: ("cuda", [1]),
    }
    [on_big] = heartbeat(api, big)
    assert (on_big["job_id"], on_big["device"], on_big["gpus"]) == (four, "cuda", [0, 1, 2, 3])
    assert on_big["nproc_per_node"] == 4

    detail = job(api, four)
    assert (detail["state"], detail["spec"]["device"], detail["device"]) == (
        "RUNNING",
        "auto",
        "cuda",
    )
    [attempt] = detail["attempts"]
    assert attempt["device"] == "cuda"
    assert [(m["node_name"], m["gpus"]) for m in attempt["members"]] == [("big", [0, 1, 2, 3])]
    placed = api.get(f"/api/v1/jobs/{four}/events").json()["items"][-1]
    assert placed["kind"] == "placed"
    assert placed["message"].startswith("attempt 1 placed on big (GPUs 0, 1, 2, 3)")
    assert placed["data"]["gpus"] == {"big": [0, 1, 2, 3]}

    # One more job of two GPUs fits nowhere: it waits and says why.
    late = submit(api, "1", nproc_per_node=2)
    reconciler.run_once()
    assert (job(api, late)["state"], job(api, late)["message"]) == (
        "PENDING",
        "waiting for GPUs: needs 1 node with 2 free GPUs; "
        "no node has 2 free GPUs: other jobs hold them",
    )

    usage = [{"index": 0, "utilization_pct": 87.5, "memory_used_bytes": 30 * GIB}]
    r = api.post(f"/api/v1/nodes/{big}/heartbeat", json={"running": [], "gpus": usage})
    assert r.status_code == 200, r.text
    shown = nodes_by_name(api)
    assert (shown["big"]["gpu_driver"], shown["big"]["cuda_version"], shown["big"]["cpus"]) == (
        "550.54",
        "12.4",
        32,
    )
    assert shown["big"]["gpus"][0] == {
        "index": 0,
        "name": "NVIDIA H100",
        "uuid": "GPU-H100-0",
        "memory_total_bytes": 80 * GIB,
        "utilization_pct": 87.5,
        "memory_used_bytes": 30 * GIB,
        "held": True,
        "job_id": four,
    }
    assert [(g["index"], g["job_id"]) for g in shown["small"]["gpus"]] == [
        (0, ones[0]),
        (1, ones[1]),
    ]
    assert shown["small"]["busy"] and shown["small"]["job_id"] == ones[0]


def test_another_users_gpus_show_as_held_without_the_job(
    api: Cluster, reconciler: Reconciler
) -> None:
    register_gpu_node(api, "g", 2)
    mine = submit(api, "1")
    reconciler.run_once()
    other = api.add_user("someone", Role.USER)
    [gpu0, gpu1] = nodes_by_name(api, other)["g"]["gpus"]
    assert (gpu0["held"], gpu0["job_id"], gpu1["held"], gpu1["job_id"]) == (True, None, False, None)
    assert nodes_by_name(api)["g"]["gpus"][0]["job_id"] == mine


def test_a_cuda_job_on_a_cluster_without_gpus_waits_and_a_cpu_job_runs(
    api: Cluster, reconciler: Reconciler
) -> None:
    a = register(api, "a")
    cuda = submit(api, "1", device="cuda")
    auto = submit(api, "1")
    reconciler.run_once()
    assert (job(api, cuda)["state"], job(api, cuda)["message"]) == (
        "PENDING",
        "waiting for GPUs: needs 1 node with 1 free GPU; no alive node has GPUs",
    )
    detail = job(api, auto)
    assert (detail["state"], detail["device"], detail["attempts"][0]["device"]) == (
        "RUNNING",
        "cpu",
        "cpu",
    )
    [assignment] = heartbeat(api, a)
    assert (assignment["device"], assignment["gpus"]) == ("cpu", [])
    assert nodes_by_name(api)["a"]["gpus"] == []


def test_a_cpu_job_and_a_cuda_job_never_share_a_node(api: Cluster, reconciler: Reconciler) -> None:
    register_gpu_node(api, "g", 4)
    cuda = submit(api, "1")
    cpu = submit(api, "1", device="cpu")
    reconciler.run_once()
    assert job(api, cuda)["state"] == "RUNNING"
    assert (job(api, cpu)["state"], job(api, cpu)["message"]) == (
        "PENDING",
        "waiting for nodes: needs 1, too few are free; other jobs hold the rest",
    )
    assert job(api, cpu)["nodes_now"] == {"alive": 1, "idle": 0}


def test_a_cuda_job_grows_onto_a_new_gpu_node_on_cuda(api: Cluster, reconciler: Reconciler) -> None:
    register_gpu_node(api, "g1", 2)
    job_id = submit(api, "1:2", nproc_per_node=2)
    reconciler.run_once()
    g2 = register_gpu_node(api, "g2", 2)
    reconciler.run_once()
    [assignment] = heartbeat(api, g2)
    assert (assignment["job_id"], assignment["device"], assignment["gpus"]) == (
        job_id,
        "cuda",
        [0, 1],
    )
    [attempt] = job(api, job_id)["attempts"]
    assert [(m["node_name"], m["gpus"]) for m in attempt["members"]] == [
        ("g1", [0, 1]),
        ("g2", [0, 1]),
    ]


def test_a_registration_replaces_the_inventory(api: Cluster) -> None:
    register_gpu_node(api, "g", 4)
    register(api, "g", slots=2, gpus=gpus(2, name="NVIDIA A100", memory_gib=40))
    node = nodes_by_name(api)["g"]
    assert [(g["index"], g["name"]) for g in node["gpus"]] == [
        (0, "NVIDIA A100"),
        (1, "NVIDIA A100"),
    ]
    assert (node["gpu_driver"], node["cuda_version"], node["cpus"]) == (None, None, None)


def test_the_gpu_use_is_written_with_the_heartbeat_itself(api: Cluster, clock: FakeClock) -> None:
    """A heartbeat that brings new GPU use sends the statements of one that does not: the
    use goes into the UPDATE that records the heartbeat."""
    engines = engines_of(api.app)
    node_id = register_gpu_node(api, "g", 2)
    # The first heartbeat also counts the ALIVE nodes for the pace (every few seconds).
    assert api.post(f"/api/v1/nodes/{node_id}/heartbeat", json={"running": []}).is_success
    clock.advance(1)
    with statements(*engines) as bare:
        assert api.post(f"/api/v1/nodes/{node_id}/heartbeat", json={"running": []}).is_success
    clock.advance(1)
    usage = [{"index": i, "utilization_pct": 50.0, "memory_used_bytes": GIB} for i in (0, 1)]
    with statements(*engines) as with_use:
        body = {"running": [], "gpus": usage}
        assert api.post(f"/api/v1/nodes/{node_id}/heartbeat", json=body).is_success
    assert len(with_use) == len(bare), (bare, with_use)
    updates = [s for s in with_use if "UPDATE nodes" in s]  # in a WITH on PostgreSQL
    assert len(updates) == 1 and "gpu_usage" in updates[0] and "last_heartbeat_at" in updates[0]
    shown = nodes_by_name(api)["g"]["gpus"]
    assert [(g["utilization_pct"], g["memory_used_bytes"]) for g in shown] == [(50.0, GIB)] * 2


def test_bad_gpu_input_is_refused_with_a_reason(api: Cluster) -> None:
    twice = [{"index": 0, "name": "a"}, {"index": 0, "name": "b"}]
    body = {"name": "g", "address": "h", "slots": 1, "pid": 1, "gpus": twice}
    r = api.post("/api/v1/nodes/register", json=body)
    assert r.status_code == 422 and "GPU indices must be distinct" in r.text
    r = api.post(
        "/api/v1/jobs",
        json={"name": "j", "task": {"name": "regression"}, "device": "tpu"},
    )
    assert r.status_code == 422 and "device" in r.text
    node_id = register_gpu_node(api, "g", 1)
    hot = {"running": [], "gpus": [{"index": 0, "utilization_pct": 250}]}
    r = api.post(f"/api/v1/nodes/{node_id}/heartbeat", json=hot)
    assert r.status_code == 422 and "utilization_pct" in r.text


def test_a_placement_decided_on_stale_gpus_is_skipped(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    """The apply step checks again, under the node's lock, that the GPUs are the node's and
    free, and that no CPU job holds the node (nor a CUDA job one a CPU job would take)."""
    node_id = register_gpu_node(api, "g", 2)
    first = submit(api, "1")
    reconciler.run_once()
    assert job(api, first)["attempts"][0]["members"][0]["gpus"] == [0]
    late = submit(api, "1", device="cuda")
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    for stale in [
        PlaceJob(late, (node_id,), "cuda", ((0,),)),  # held by the first job
        PlaceJob(late, (node_id,), "cuda", ((5,),)),  # not a GPU of the node
        PlaceJob(late, (node_id,), "cuda", ((1, 1),)),  # one GPU twice
        PlaceJob(late, (node_id,), "cpu"),  # a CUDA job holds the node
    ]:
        with pytest.raises(StaleState), transaction(factory) as session:
            reconciler.apply(session, stale, clock())
    assert job(api, late)["state"] == "PENDING"
    with transaction(factory) as session:
        reconciler.apply(session, PlaceJob(late, (node_id,), "cuda", ((1,),)), clock())
    assert [m["gpus"] for m in job(api, late)["attempts"][0]["members"]] == [[1]]


def submit_as(api: Cluster, token: str, nnodes: str = "1", **extra: Any) -> int:
    spec = {"name": "j", "task": {"name": "regression"}, "nnodes": nnodes, **extra}
    r = api.post("/api/v1/jobs", json=spec, headers=bearer(token))
    assert r.status_code == 201, r.text
    job_id: int = r.json()["id"]
    return job_id


def test_cuda_jobs_of_two_users_never_share_a_node(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    """CUDA_VISIBLE_DEVICES is no isolation: another user's job gets a node of its own, or
    waits, in the plan and again under the node's lock when it is applied."""
    g1 = register_gpu_node(api, "g1", 4)
    mine = submit(api, "1")
    reconciler.run_once()
    someone = api.add_user("someone", Role.USER)
    theirs = submit_as(api, someone, device="cuda")
    reconciler.run_once()
    assert (job(api, theirs)["state"], job(api, theirs)["message"]) == (
        "PENDING",
        "waiting for GPUs: needs 1 node with 1 free GPU; "
        "no node has 1 free GPU: other jobs hold them",
    )
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with pytest.raises(StaleState), transaction(factory) as session:
        reconciler.apply(session, PlaceJob(theirs, (g1,), "cuda", ((1,),)), clock())
    register_gpu_node(api, "g2", 4)
    again = submit(api, "1")
    reconciler.run_once()
    placed_on = {
        j: [m["node_name"] for m in job(api, j)["attempts"][0]["members"]]
        for j in (mine, theirs, again)
    }
    assert placed_on == {mine: ["g1"], theirs: ["g2"], again: ["g1"]}


def test_a_succeeded_attempts_finishing_member_holds_its_gpus_until_it_reports(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    """An attempt that SUCCEEDED keeps its other members ACTIVE while their launchers finish:
    their GPUs stay held (placement, apply and the nodes' view) until they report."""
    g1 = register_gpu_node(api, "g1", 1)
    g2 = register_gpu_node(api, "g2", 1)
    first = submit(api, "2")
    reconciler.run_once()
    attempt_id = job(api, first)["attempts"][0]["id"]
    done = {"outcome": "succeeded", "exit_code": 0}
    assert report(api, g1, attempt_id, exit=done).status_code == 200
    assert job(api, first)["state"] == "SUCCEEDED"
    second, third = submit(api, "1"), submit(api, "1")
    reconciler.run_once()
    assert [m["node_name"] for m in job(api, second)["attempts"][0]["members"]] == ["g1"]
    assert job(api, third)["state"] == "PENDING"
    shown = nodes_by_name(api)["g2"]
    assert (shown["busy"], shown["gpus"][0]["held"]) == (True, True)
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with pytest.raises(StaleState), transaction(factory) as session:
        reconciler.apply(session, PlaceJob(third, (g2,), "cuda", ((0,),)), clock())
    assert report(api, g2, attempt_id, exit=done).status_code == 200
    reconciler.run_once()
    assert [m["node_name"] for m in job(api, third)["attempts"][0]["members"]] == ["g2"]


def test_a_shared_node_shows_the_callers_own_zygote_memory(
    api: Cluster, reconciler: Reconciler, settings: ControllerSettings
) -> None:
    """Where users may share GPU nodes, the zygote memory a user sees is that of the
    attempt shown, the caller's own, never another user's."""
    settings.share_gpu_nodes_across_users = True
    g = register_gpu_node(api, "g", 2)
    someone, me = api.add_user("someone", Role.USER), api.add_user("me", Role.USER)
    theirs = submit_as(api, someone)
    reconciler.run_once()
    mine = submit_as(api, me)
    reconciler.run_once()
    attempts = {j: job(api, j)["attempts"][0]["id"] for j in (theirs, mine)}
    ready = {"state": "ready", "pid": 7, "import_s": 1.0, "rss_bytes": 300 * 2**20}
    zygote = {"time": "2026-01-01T00:00:00+00:00", "kind": "zygote", "data": ready}
    assert report(api, g, attempts[theirs], events=[zygote]).status_code == 200
    shown = nodes_by_name(api, me)["g"]
    assert (shown["job_id"], shown["zygote_rss_bytes"]) == (mine, None)
    assert nodes_by_name(api, someone)["g"]["zygote_rss_bytes"] == 300 * 2**20
    ready["rss_bytes"] = 200 * 2**20
    assert report(api, g, attempts[mine], events=[zygote]).status_code == 200
    assert nodes_by_name(api, me)["g"]["zygote_rss_bytes"] == 200 * 2**20


def test_a_cpu_attempt_is_not_grown_onto_a_gpu_node_even_by_a_stale_action(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    a = register(api, "a")
    cpu = submit(api, "1:2", device="cpu")
    reconciler.run_once()
    g = register_gpu_node(api, "g", 2)
    reconciler.run_once()
    [attempt] = job(api, cpu)["attempts"]
    assert [m["node_name"] for m in attempt["members"]] == ["a"]
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with pytest.raises(StaleState), transaction(factory) as session:
        reconciler.apply(session, AddMembers(cpu, attempt["id"], (g,)), clock())
    assert heartbeat(api, a) and heartbeat(api, g) == []


def test_a_batch_of_placements_checks_each_against_the_ones_before_it(
    api: Cluster, clock: FakeClock
) -> None:
    """Placements applied together each count the GPUs and owners of those before them in
    the batch: another user's job on the node, and a GPU given twice, are skipped."""
    node_id = register_gpu_node(api, "g", 2)
    mine, again, third = (submit(api, "1", device="cuda") for _ in range(3))
    someone = api.add_user("someone", Role.USER)
    theirs = submit_as(api, someone, device="cuda")
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        skipped = place_jobs(
            session,
            [
                PlaceJob(mine, (node_id,), "cuda", ((0,),)),
                PlaceJob(theirs, (node_id,), "cuda", ((1,),)),
                PlaceJob(again, (node_id,), "cuda", ((0,),)),
                PlaceJob(third, (node_id,), "cuda", ((1,),)),
            ],
            clock(),
            share_gpu_nodes=False,
        )
    assert skipped == {
        theirs: f"node {node_id} serves another user's job on cuda",
        again: f"GPUs [0] of node {node_id} are taken",
    }
    states = {j: job(api, j)["state"] for j in (mine, theirs, again, third)}
    assert states == {mine: "RUNNING", theirs: "PENDING", again: "PENDING", third: "RUNNING"}
    assert [m["gpus"] for m in job(api, third)["attempts"][0]["members"]] == [[1]]
