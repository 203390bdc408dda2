"""A submit or a registration starts the reconciler's next pass at once, instead of
leaving it for the interval; a registration answers once that pass has ended."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service.reconciler import Reconciler
from service.settings import ControllerSettings
from tests.helpers import FakeClock, wait_for
from tests.service.helpers import Cluster

# Far longer than any wait below: only a woken pass can place a job in time.
SLOW_INTERVAL_S = 60.0


@pytest.fixture
def woken(api: Cluster, settings: ControllerSettings, clock: FakeClock) -> Iterator[Reconciler]:
    """A reconciler whose loop runs once a minute, that the app's routes wake."""
    slow = settings.model_copy(
        update={"reconcile_interval_s": SLOW_INTERVAL_S, "leader_lease_s": 4 * SLOW_INTERVAL_S}
    )
    factory: sessionmaker[Session] = api.app.state.session_factory  # type: ignore[attr-defined]
    reconciler = Reconciler(factory, slow, clock)
    reconciler.start()
    api.app.state.wake_reconciler = reconciler.wake  # type: ignore[attr-defined]
    try:
        assert reconciler.wake(wait_s=30)  # the loop's first pass took the lease
        yield reconciler
    finally:
        reconciler.stop()


def _register(api: Cluster, name: str) -> None:
    body = {"name": name, "address": "127.0.0.1", "slots": 1, "pid": 1}
    assert api.post("/api/v1/nodes/register", json=body).status_code == 200


def _submit(api: Cluster) -> int:
    spec = {"name": "j", "task": {"name": "regression"}, "nnodes": "1"}
    job_id: int = api.post("/api/v1/jobs", json=spec).json()["id"]
    return job_id


def _attempts(api: Cluster, job_id: int) -> list[dict[str, object]]:
    items: list[dict[str, object]] = api.get(f"/api/v1/jobs/{job_id}").json()["attempts"]
    return items


def test_a_submitted_job_is_placed_by_the_pass_its_submit_wakes(
    api: Cluster, woken: Reconciler
) -> None:
    _register(api, "n1")
    job_id = _submit(api)
    wait_for("the job placed", lambda: _attempts(api, job_id), timeout_s=SLOW_INTERVAL_S / 2)


def test_a_registration_answers_after_the_pass_that_gives_the_node_its_job(
    api: Cluster, woken: Reconciler
) -> None:
    job_id = _submit(api)  # no node yet: it waits
    assert woken.wake(wait_s=30)
    assert _attempts(api, job_id) == []
    _register(api, "n1")
    assert _attempts(api, job_id)  # placed before the registration's answer came


def test_a_wake_that_waits_returns_once_a_pass_begun_after_it_has_ended(
    woken: Reconciler,
) -> None:
    for _ in range(3):
        assert woken.wake(wait_s=30)


def test_a_wake_that_waits_ends_the_rest_after_a_pass(
    api: Cluster, settings: ControllerSettings, clock: FakeClock
) -> None:
    """The loop rests after each pass so that passes take at most their share of the time
    (here 20 s, a third of the lease); a registration's wake, which holds an API thread
    until its pass has ended, does not wait for that rest to end."""
    resting = settings.model_copy(
        update={
            "reconcile_interval_s": 0.5,
            "reconcile_max_share": 0.0001,
            "leader_lease_s": 60.0,
            "node_timeout_s": 60.0,
        }
    )
    factory: sessionmaker[Session] = api.app.state.session_factory  # type: ignore[attr-defined]
    reconciler = Reconciler(factory, resting, clock)
    reconciler.start()
    try:
        for _ in range(3):
            assert reconciler.wake(wait_s=10)
    finally:
        reconciler.stop()
