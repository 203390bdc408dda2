"""A pass reads the queue only as far as the free nodes reach, and decides as a pass that
read it whole would: the same placements, and every PENDING job says why it waits."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from service import reconciler as reconciler_module
from service.db import transaction
from service.metrics import ReconcilerMetrics
from service.placement import Room
from service.reconciler import ExplainWait, NodeView, PlaceJob, Reconciler, load_views, plan
from service.settings import ControllerSettings
from service.states import NodeState
from tests.helpers import FakeClock
from tests.service.helpers import Cluster, event, heartbeat, job, register, report, submit

FREE = "waiting for nodes: needs {n}, too few are free; other jobs hold the rest"
TOO_FEW_ALIVE = "waiting for nodes: needs {n}, too few nodes are alive"


def test_a_room_left_after_taking_nodes_is_the_room_worked_out_afresh() -> None:
    """``Room.taking`` on "cpu" derives what is left from the room it took from; it must
    answer every question as a room worked out from the nodes again would."""
    now = FakeClock().now
    alive = [
        NodeView(1, NodeState.ALIVE, now, 1),
        NodeView(2, NodeState.ALIVE, now, 4, gpus=(0, 1)),
        NodeView(3, NodeState.ALIVE, now, 2),
        NodeView(4, NodeState.ALIVE, now, 4, gpus=(0, 1, 2, 3)),
        NodeView(5, NodeState.ALIVE, now, 4),
    ]
    room = Room(alive, whole={3}, held={4: {0}}, owners={4: {7}})
    assert room.openings() == 3 + 2 + 3  # nodes 1, 2, 5 idle; GPUs 0, 1 of 2, 1-3 of 4
    questions = [
        (device, per_node, owner, gpu_less)
        for device in ("cpu", "cuda")
        for per_node in (1, 2, 4)
        for owner in (None, 7, 8)
        for gpu_less in (False, True)
    ]
    # Asked before it is taken from, so that every answer it keeps is worked out.
    answers = [room.fitting(*asked) for asked in questions]  # type: ignore[arg-type]
    taken = room.taking("cpu", (1, 2), ())
    fresh = Room(alive, whole={1, 2, 3}, held={4: {0}}, owners={4: {7}})
    for asked in questions:
        assert taken.fitting(*asked) == fresh.fitting(*asked), asked  # type: ignore[arg-type]
    assert (taken.is_full(), taken.openings()) == (fresh.is_full(), fresh.openings()) == (False, 4)
    # The room taken from answers as it did.
    assert [room.fitting(*asked) for asked in questions] == answers  # type: ignore[arg-type]
    assert room.fitting("cpu", 1) == [(1, ()), (5, ()), (2, ())]
    assert room.taking("cpu", (1, 2, 5), ()).taking("cuda", (4,), ((1, 2, 3),)).is_full()


@pytest.mark.parametrize(("first_page_min", "page"), [(1, 2), (None, 16)])
def test_the_first_page_of_the_queue_is_sized_to_the_rooms_openings(
    api: Cluster,
    counted: Reconciler,
    monkeypatch: pytest.MonkeyPatch,
    first_page_min: int | None,
    page: int,
) -> None:
    """One node of three free and a deep queue: the pass reads a page of twice its one
    opening, or ``FIRST_PAGE_MIN`` (16) if that is more, not ``QUEUE_PAGE`` jobs, and places
    the oldest job."""
    if first_page_min is not None:
        monkeypatch.setattr(reconciler_module, "FIRST_PAGE_MIN", first_page_min)
    nodes = [register(api, name) for name in "abc"]
    api.user_token = api.add_user("queue", max_active_jobs=100, max_nodes=100)
    holders = [submit(api, "1:1") for _ in range(2)]
    counted.run_once()  # the first of a term reads the queue whole
    queued = [submit(api, "1:1") for _ in range(40)]
    counted.run_once()  # places the oldest of them, tells the others why they wait
    assert [job(api, i)["state"] for i in holders + queued[:2]] == ["RUNNING"] * 3 + ["PENDING"]
    finish(api, holders[0])
    limits: list[int | None] = []
    real = reconciler_module.read_queue

    def spied(*args: Any, limit: int | None = None, **kwargs: Any) -> list[Any]:
        limits.append(limit)
        return real(*args, limit=limit, **kwargs)

    monkeypatch.setattr(reconciler_module, "read_queue", spied)
    for node_id in nodes:
        heartbeat(api, node_id)
    actions = counted.run_once()
    assert [(type(a), a.job_id) for a in actions] == [(PlaceJob, queued[1])]
    assert limits == [None, page]  # the new jobs (none), then one page
    assert reads(counted)["head"] == 2


def test_a_room_is_full_when_no_node_and_no_gpu_is_free() -> None:
    cpu = [
        NodeView(1, NodeState.ALIVE, FakeClock().now, 1),
        NodeView(2, NodeState.ALIVE, FakeClock().now, 4),
    ]
    assert not Room(cpu, whole=set(), held={}).is_full()
    assert not Room(cpu, whole={1}, held={}).is_full()
    assert Room(cpu, whole={1, 2}, held={}).is_full()
    gpu = [NodeView(3, NodeState.ALIVE, FakeClock().now, 8, gpus=(0, 1))]
    assert not Room(gpu, whole=set(), held={3: {0}}).is_full()  # GPU 1 is free
    assert Room(gpu, whole=set(), held={3: {0, 1}}).is_full()
    assert Room(gpu, whole={3}, held={}).is_full()
    assert Room([], whole=set(), held={}).is_full()


@pytest.fixture(params=["one job", "twice the openings"])
def small_pages(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pages small enough that a queue of a few jobs has a head and a tail: of one job
    each, or a first page of twice the room's openings (as a pass reads a deep queue),
    then doubling."""
    if request.param == "one job":
        monkeypatch.setattr(reconciler_module, "QUEUE_PAGE", 1)
    else:
        monkeypatch.setattr(reconciler_module, "FIRST_PAGE_MIN", 1)
    yield


@pytest.fixture
def one_job_pages(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pages of one job: a queue of one job is read as a page, not found whole."""
    monkeypatch.setattr(reconciler_module, "QUEUE_PAGE", 1)
    yield


@pytest.fixture
def counted(api: TestClient, settings: ControllerSettings, clock: FakeClock) -> Reconciler:
    """A reconciler whose metrics count how much of the queue each pass read."""
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    return Reconciler(factory, settings, clock, ReconcilerMetrics(CollectorRegistry()))


def reads(reconciler: Reconciler) -> dict[str, float]:
    """Passes so far by how much of the queue they read: {"whole": n, "head": m}."""
    metrics = reconciler._metrics
    assert metrics is not None
    return {
        read: metrics.reconcile_queue_reads.labels(read)._value.get() for read in ("whole", "head")
    }


def whole_plan(api: Cluster, settings: ControllerSettings, clock: FakeClock) -> list[Any]:
    """What a pass that read the whole queue would decide now."""
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        nodes, jobs = load_views(session, None, settings.heartbeat_interval_s)
    return plan(clock.now, nodes, jobs, timedelta(seconds=settings.node_timeout_s))


def finish(api: Cluster, job_id: int) -> None:
    """Every member of the job's attempt reports that it succeeded: its nodes are free."""
    attempt = job(api, job_id)["attempts"][-1]
    for member in attempt["members"]:
        r = report(
            api,
            member["node_id"],
            attempt["id"],
            events=[event("finished", step=10, loss=0.1)],
            exit={"outcome": "succeeded", "exit_code": 0},
        )
        assert r.status_code == 200, r.text
    assert job(api, job_id)["state"] == "SUCCEEDED"


def pending_messages(api: Cluster, ids: list[int]) -> dict[int, str]:
    return {i: job(api, i)["message"] for i in ids if job(api, i)["state"] == "PENDING"}


def test_a_pass_that_reads_the_head_places_and_explains_as_a_whole_read_would(
    api: Cluster,
    counted: Reconciler,
    settings: ControllerSettings,
    clock: FakeClock,
    small_pages: None,
) -> None:
    """Four nodes of 1 and 2 slots and a queue of mixed sizes, drained as jobs finish: each
    pass's placements are the ones a whole read decides, and after each pass no PENDING
    job's message differs from its reason (a whole read would explain nothing)."""
    api.user_token = api.add_user("queue", max_active_jobs=100, max_nodes=100)
    nodes = [
        register(api, "a"),
        register(api, "b", slots=2),
        register(api, "c"),
        register(api, "d"),
    ]
    shapes = [("2:2", 1), ("1:1", 2), ("1:1", 1), ("3:3", 1), ("1:2", 1), ("1:1", 2), ("2:2", 2)]
    queued = [submit(api, nnodes, nproc_per_node=nproc) for nnodes, nproc in shapes * 3]
    first = counted.run_once()  # the first pass of a term reads the queue whole
    placed = [a.job_id for a in first if isinstance(a, PlaceJob)]
    for _ in range(20):
        for node_id in nodes:
            heartbeat(api, node_id)
        expected = [a for a in whole_plan(api, settings, clock) if not isinstance(a, ExplainWait)]
        actions = counted.run_once()
        assert [a for a in actions if not isinstance(a, ExplainWait)] == expected
        assert [a for a in whole_plan(api, settings, clock) if isinstance(a, ExplainWait)] == []
        placed += [a.job_id for a in expected]
        running = [i for i in placed if job(api, i)["state"] == "RUNNING"]
        if not running:
            break
        finish(api, running[0])
    assert reads(counted)["head"] >= 5  # the head was read, not the whole queue each time
    assert len(placed) > 8
    assert all(message for message in pending_messages(api, queued).values())


def test_a_reason_that_the_nodes_change_is_rewritten_while_no_node_is_free(
    api: Cluster, counted: Reconciler, clock: FakeClock, small_pages: None
) -> None:
    """Three nodes, all held; two jobs of three nodes wait because too few are free. A
    node is lost: now too few are alive, and both jobs say so, though no node is free
    and the second job is past the head a pass would read."""
    a, b = register(api, "a"), register(api, "b")
    register(api, "c")
    pair, single = submit(api, "2:2"), submit(api, "1:1")
    counted.run_once()
    first, second = submit(api, "3:3"), submit(api, "3:3")
    counted.run_once()  # explains the new jobs, reading no more of the queue
    assert pending_messages(api, [first, second]) == {
        first: FREE.format(n=3),
        second: FREE.format(n=3),
    }
    assert reads(counted)["head"] >= 1
    assert {job(api, pair)["state"], job(api, single)["state"]} == {"RUNNING"}

    clock.advance(11)  # past the node timeout; c is silent
    heartbeat(api, a)
    heartbeat(api, b)
    whole_before = reads(counted)["whole"]
    counted.run_once()
    assert job(api, single)["state"] == "WAITING"
    assert reads(counted)["whole"] == whole_before + 1
    assert pending_messages(api, [first, second]) == {
        first: TOO_FEW_ALIVE.format(n=3),
        second: TOO_FEW_ALIVE.format(n=3),
    }


def test_a_new_job_says_why_it_waits_without_a_whole_read(
    api: Cluster, counted: Reconciler, small_pages: None
) -> None:
    """With every node held, a pass reads none of the queue but its new jobs."""
    a = register(api, "a")
    holder, old = submit(api, "1:1"), submit(api, "1:1")
    counted.run_once()
    assert job(api, holder)["state"] == "RUNNING"
    assert job(api, old)["message"] == FREE.format(n=1)
    new = [submit(api, "1:1"), submit(api, "2:2")]
    heartbeat(api, a)
    before = reads(counted)
    counted.run_once()
    assert reads(counted) == {"whole": before["whole"], "head": before["head"] + 1}
    assert pending_messages(api, new) == {
        new[0]: FREE.format(n=1),
        new[1]: TOO_FEW_ALIVE.format(n=2),
    }


def test_a_free_node_that_no_queued_job_fits_does_not_make_each_pass_read_the_queue(
    api: Cluster, counted: Reconciler, small_pages: None
) -> None:
    """Node b stays free: every queued job needs two slots, which no node has. Once a
    whole read has seen what the queue asks, a pass reads none of it."""
    a, b = register(api, "a"), register(api, "b")
    holder = submit(api, "1:1")
    wide = [submit(api, "1:1", nproc_per_node=2) for _ in range(4)]
    counted.run_once()  # whole: places the holder on a
    assert job(api, holder)["state"] == "RUNNING"
    counted.run_once()  # the holder's ask is gone only after the queue is read to its end
    before = reads(counted)
    for _ in range(3):
        heartbeat(api, a)
        heartbeat(api, b)
        assert counted.run_once() == []
    assert reads(counted) == {"whole": before["whole"], "head": before["head"] + 3}
    assert set(pending_messages(api, wide).values()) == {
        "waiting for nodes: needs 1 with 2 slots each, too few alive nodes have that many slots"
    }


def test_what_a_page_read_asks_is_kept(
    api: Cluster, counted: Reconciler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job first read on a page, not as a new one (on PostgreSQL a submit may commit
    between the two reads), still counts among what the queue asks: later passes read as
    far as it when the room fits it. Here the read of the new jobs misses them all."""
    monkeypatch.setattr(reconciler_module, "QUEUE_PAGE", 2)
    a, b = register(api, "a"), register(api, "b")
    holder = submit(api, "1:1")
    counted.run_once()  # whole: the holder on a
    assert job(api, holder)["state"] == "RUNNING"
    first, wide = submit(api, "1:1"), submit(api, "1:1", nproc_per_node=2)
    submit(api, "1:1")
    real = reconciler_module.read_queue

    def missing_new(*args: Any, unexplained: bool = False, **kwargs: Any) -> list[Any]:
        return [] if unexplained else real(*args, **kwargs)

    monkeypatch.setattr(reconciler_module, "read_queue", missing_new)
    heartbeat(api, a)
    heartbeat(api, b)
    actions = counted.run_once()  # a head read: one page, the first job fills b
    assert [(type(x).__name__, x.job_id) for x in actions if isinstance(x, PlaceJob)] == [
        ("PlaceJob", first)
    ]
    assert job(api, wide)["message"] != ""  # read on the page, and explained there
    assert counted._whole_read is not None
    assert ("auto", 2, 1, None) in {(d, n, m, None) for d, n, m, _ in counted._whole_read.told}


def test_a_waiting_job_queued_before_the_unread_jobs_is_placed_as_a_whole_read_would(
    api: Cluster,
    counted: Reconciler,
    settings: ControllerSettings,
    clock: FakeClock,
    one_job_pages: None,
) -> None:
    """A job that lost a node WAITs; it is older than a PENDING job that asks the same. When
    a node is freed (no change of the nodes' shape: a head read), the waiting job is placed
    first, as a whole read would place it, and the younger one keeps waiting."""
    a, b = register(api, "a"), register(api, "b")
    register(api, "c")
    holder, waiting, younger = submit(api, "1:1"), submit(api, "2:2"), submit(api, "2:2")
    counted.run_once()  # whole: the holder on a, the waiting job on b and c
    assert [job(api, i)["state"] for i in (holder, waiting, younger)] == [
        "RUNNING",
        "RUNNING",
        "PENDING",
    ]
    clock.advance(11)  # past the node timeout; c is silent
    heartbeat(api, a)
    heartbeat(api, b)
    counted.run_once()  # c lost: a whole read; one node left of two, the job waits
    assert job(api, waiting)["state"] == "WAITING"
    finish(api, holder)  # a is free again: the nodes' shape is the same
    heartbeat(api, a)
    heartbeat(api, b)
    expected = [x for x in whole_plan(api, settings, clock) if not isinstance(x, ExplainWait)]
    assert expected == [PlaceJob(waiting, (a, b))]
    before = reads(counted)
    assert [x for x in counted.run_once() if not isinstance(x, ExplainWait)] == expected
    assert reads(counted) == {"whole": before["whole"], "head": before["head"] + 1}
    assert (job(api, waiting)["state"], job(api, younger)["state"]) == ("RUNNING", "PENDING")
    shown = job(api, waiting)
    assert (shown["attempt_count"], shown["message"]) == (2, "")
    placed = api.get(f"/api/v1/jobs/{waiting}/events").json()["items"][-1]
    assert (placed["kind"], placed["message"]) == (
        "placed",
        f"attempt 2 placed on a, b (rendezvous id relaunch-job{waiting}-attempt2) "
        "and resumes from its newest snapshot",
    )


def test_a_new_node_makes_a_whole_read_no_sooner_than_shape_read_every_s_after_the_last(
    api: Cluster, counted: Reconciler, clock: FakeClock, small_pages: None
) -> None:
    """While a fleet starts, every registration changes the nodes' shape; a pass still
    places on a new node at once (the head read), and the reasons of the jobs past the
    head are rewritten once ``SHAPE_READ_EVERY_S`` has passed since the last whole read."""
    a = register(api, "a")
    holder, wide, later = submit(api, "1:1"), submit(api, "3:3"), submit(api, "1:1")
    for _ in range(4):
        submit(api, "1:1")  # the queue goes on past the head
    counted.run_once()  # whole: the holder on a
    assert job(api, wide)["message"] == TOO_FEW_ALIVE.format(n=3)
    before = reads(counted)
    b = register(api, "b")
    counted.run_once()
    assert reads(counted) == {"whole": before["whole"], "head": before["head"] + 1}
    assert [m["node_name"] for m in job(api, later)["attempts"][0]["members"]] == ["b"]
    register(api, "c")
    clock.advance(reconciler_module.SHAPE_READ_EVERY_S)
    for node_id in (a, b):
        heartbeat(api, node_id)
    counted.run_once()
    assert reads(counted)["whole"] == before["whole"] + 1
    assert job(api, wide)["message"] == FREE.format(n=3)
    assert job(api, holder)["state"] == "RUNNING"


def test_a_node_lost_and_back_that_changes_no_reason_reads_no_more_of_the_queue(
    api: Cluster,
    counted: Reconciler,
    settings: ControllerSettings,
    clock: FakeClock,
    small_pages: None,
) -> None:
    """Three nodes of one slot, each held, and a queue of one-node jobs past the head,
    which wait because too few are free. A node is lost and comes back: the nodes
    changed, but no queued job's reason did (one node still fits each job), so no pass
    reads the queue whole, and a whole read would explain nothing. A job that needs all
    three nodes, submitted before, is told its new reason by a whole read once the loss
    makes it one that too few nodes are alive for."""
    nodes = [register(api, name) for name in "abc"]
    holders = [submit(api, "1:1") for _ in nodes]
    queued = [submit(api, "1:1") for _ in range(4)]
    counted.run_once()  # the first pass of a term: whole
    assert {job(api, i)["state"] for i in holders} == {"RUNNING"}
    assert set(pending_messages(api, queued).values()) == {FREE.format(n=1)}
    lost = job(api, holders[0])["attempts"][0]["members"][0]["node_id"]
    clock.advance(settings.node_timeout_s + 1)
    for node_id in nodes:
        if node_id != lost:
            heartbeat(api, node_id)
    before = reads(counted)
    counted.run_once()  # the node is lost; its job waits for nodes
    assert job(api, holders[0])["state"] == "WAITING"
    heartbeat(api, lost)  # and it is back
    counted.run_once()
    assert reads(counted)["whole"] == before["whole"]
    assert [a for a in whole_plan(api, settings, clock) if isinstance(a, ExplainWait)] == []
    assert set(pending_messages(api, queued).values()) == {FREE.format(n=1)}

    wide = submit(api, "3:3")
    counted.run_once()  # a new job: told at once, without a whole read
    assert job(api, wide)["message"] == FREE.format(n=3)
    clock.advance(settings.node_timeout_s + 1)
    for node_id in nodes[1:]:
        heartbeat(api, node_id)
    counted.run_once()  # a lost: three nodes are no longer alive
    assert reads(counted)["whole"] == before["whole"] + 1
    assert job(api, wide)["message"] == TOO_FEW_ALIVE.format(n=3)
    assert set(pending_messages(api, queued).values()) == {FREE.format(n=1)}
