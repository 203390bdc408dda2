"""Placements applied a batch at a time: a few statements however many jobs, and each
placement checked under the locks against the database and the placements before it."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from service import reconciler as reconciler_module
from service.db import transaction
from service.placing import PlaceJob, place_jobs
from service.reconciler import Reconciler
from tests.helpers import FakeClock
from tests.service.helpers import Cluster, job, kinds, register, statements, submit


def placed_on(api: Cluster, job_id: int) -> list[str]:
    """The names of the nodes of the job's attempts' members, oldest attempt first."""
    return [m["node_name"] for a in job(api, job_id)["attempts"] for m in a["members"]]


def test_a_pass_placing_twelve_jobs_sends_as_many_statements_as_one_placing_three(
    api: Cluster, reconciler: Reconciler
) -> None:
    engine = api.app.state.session_factory.kw["bind"]  # type: ignore[attr-defined]
    api.user_token = api.add_user("queue", max_active_jobs=100, max_nodes=100)
    for i in range(18):
        register(api, f"n{i:02d}")
    reconciler.run_once()  # takes the lease and reads the (empty) queue whole
    # Each pass reads the specs of the jobs the pass before it placed: three each time.
    first = [submit(api, "1") for _ in range(3)]
    reconciler.run_once()
    few = [submit(api, "1") for _ in range(3)]
    with statements(engine) as placing_few:
        assert len(reconciler.run_once()) == 3
    many = [submit(api, "1") for _ in range(12)]
    with statements(engine) as placing_many:
        assert len(reconciler.run_once()) == 12

    assert len(placing_many) == len(placing_few), (placing_few, placing_many)
    nodes = [placed_on(api, j) for j in first + few + many]
    assert sorted(n for on in nodes for n in on) == [f"n{i:02d}" for i in range(18)]
    for job_id in first + few + many:
        shown = job(api, job_id)
        assert (shown["state"], shown["attempt_count"]) == ("RUNNING", 1)
        assert kinds(api, job_id) == ["submitted", "placed"]


def test_a_pass_applies_its_placements_in_batches_of_place_batch(
    api: Cluster, reconciler: Reconciler
) -> None:
    api.user_token = api.add_user("queue", max_active_jobs=100, max_nodes=100)
    for i in range(5):
        register(api, f"n{i}")
    jobs = [submit(api, "1") for _ in range(5)]
    reconciler.place_batch = 2
    engine = api.app.state.session_factory.kw["bind"]  # type: ignore[attr-defined]
    with statements(engine) as sent:
        reconciler.run_once()
    attempts = [s for s in sent if s.startswith("INSERT INTO attempts ")]
    assert len(attempts) == 3  # 2 + 2 + 1
    assert sorted(n for j in jobs for n in placed_on(api, j)) == [f"n{i}" for i in range(5)]


def test_a_stale_placement_is_skipped_and_the_rest_of_its_batch_placed(
    api: Cluster, clock: FakeClock
) -> None:
    """A cancelled job, and a node an earlier placement of the same batch took, are skipped;
    nothing of theirs is written, and the others are placed in full."""
    a, b, c = register(api, "a"), register(api, "b"), register(api, "c")
    first, cancelled, late, last = (submit(api, "1") for _ in range(4))
    assert api.post(f"/api/v1/jobs/{cancelled}/cancel").status_code == 200
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        skipped = place_jobs(
            session,
            [
                PlaceJob(first, (a,)),
                PlaceJob(cancelled, (b,)),
                PlaceJob(late, (a,)),  # the placement before it took a
                PlaceJob(last, (c,)),
            ],
            clock(),
            share_gpu_nodes=False,
        )
    assert skipped == {
        cancelled: f"job {cancelled} is CANCELLED, not waiting to be placed",
        late: f"nodes {[a]} are no longer free",
    }
    assert (placed_on(api, first), placed_on(api, last)) == (["a"], ["c"])
    shown: dict[int, Any] = {j: job(api, j) for j in (first, cancelled, late, last)}
    assert {j: (s["state"], s["attempt_count"]) for j, s in shown.items()} == {
        first: ("RUNNING", 1),
        cancelled: ("CANCELLED", 0),
        late: ("PENDING", 0),
        last: ("RUNNING", 1),
    }
    assert shown[first]["attempts"][0]["rdzv_id"] == f"relaunch-job{first}-attempt1"
    placed = api.get(f"/api/v1/jobs/{last}/events").json()["items"][-1]
    assert (placed["kind"], placed["message"], placed["data"]) == (
        "placed",
        f"attempt 1 placed on c (rendezvous id relaunch-job{last}-attempt1)",
        {"nodes": ["c"]},
    )
    assert kinds(api, late) == ["submitted"]


def test_a_batch_the_database_refuses_is_placed_one_job_a_transaction(
    api: Cluster, reconciler: Reconciler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that fails for a reason no check foresaw (here the database refuses every
    batch of more than one) is rolled back whole and tried again a job at a time."""
    api.user_token = api.add_user("queue", max_active_jobs=100, max_nodes=100)
    for i in range(3):
        register(api, f"n{i}")
    jobs = [submit(api, "1") for _ in range(3)]
    real = reconciler_module.place_jobs
    sizes: list[int] = []

    def refusing(session: Session, actions: list[PlaceJob], *args: Any) -> dict[int, str]:
        sizes.append(len(actions))
        placed = real(session, actions, *args)  # written, then rolled back
        if len(actions) > 1:
            raise OperationalError("INSERT", {}, Exception("deadlock detected"))
        return placed

    monkeypatch.setattr(reconciler_module, "place_jobs", refusing)
    reconciler.run_once()
    assert sizes == [3, 1, 1, 1]
    assert sorted(n for j in jobs for n in placed_on(api, j)) == ["n0", "n1", "n2"]
    assert [job(api, j)["attempt_count"] for j in jobs] == [1, 1, 1]
