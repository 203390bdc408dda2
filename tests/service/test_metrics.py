"""/metrics through the real app: who may read it, and that its values follow the cluster."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr, ValidationError

from service.api.app import create_app
from service.models import Role
from service.reconciler import Reconciler
from service.settings import ControllerSettings
from service.thread_time import schedstat_of, waited_for_cpu
from tests.helpers import FakeClock
from tests.service.helpers import (
    Cluster,
    bearer,
    event,
    heartbeat,
    register,
    report,
    submit,
)

SCRAPE_TOKEN = "scrape-" + "s" * 32
HEARTBEAT_ROUTE = "/api/v1/nodes/{node_id}/heartbeat"


@pytest.fixture
def settings(settings: ControllerSettings) -> ControllerSettings:
    """The tests' controller, with a scrape token."""
    return settings.model_copy(update={"metrics_token": SecretStr(SCRAPE_TOKEN)})


@pytest.fixture
def reconciler(api: Cluster, settings: ControllerSettings, clock: FakeClock) -> Reconciler:
    """The reconciler as the app starts it: with the app's metrics."""
    state = api.app.state  # type: ignore[attr-defined]
    return Reconciler(state.session_factory, settings, clock, state.metrics.reconciler)


def scrape(api: Cluster) -> Samples:
    """Every sample of /metrics, read with the scrape token, by name and labels."""
    r = api.get("/metrics", headers=bearer(SCRAPE_TOKEN))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_need_the_scrape_token_or_an_admin(api: Cluster) -> None:
    node_id = register(api, "n1")
    user = api.add_user("alice", Role.USER)
    refusals = {
        "no token": ({"authorization": ""}, 401),
        "unknown token": (bearer("not-a-token-" + "x" * 30), 401),
        "a user who is not an admin": (bearer(user), 403),
        "a node's token": (bearer(api.node_tokens[node_id]), 403),
    }
    for what, (headers, code) in refusals.items():
        r = api.get("/metrics", headers=headers)
        assert r.status_code == code, f"{what}: {r.status_code} {r.text}"
        assert "relaunch_" not in r.text, what
    for what, headers in {"scrape token": bearer(SCRAPE_TOKEN), "admin": {}}.items():
        r = api.get("/metrics", headers=headers)
        assert r.status_code == 200, what
        assert "relaunch_jobs" in r.text, what


def test_without_a_scrape_token_only_admins_read_metrics(
    settings: ControllerSettings, clock: FakeClock
) -> None:
    unset = settings.model_copy(update={"metrics_token": None})
    app = create_app(unset, clock=clock, run_background=False)
    with Cluster(app) as api:
        api.user_token = api.add_user("root", Role.ADMIN)
        assert api.get("/metrics", headers=bearer(SCRAPE_TOKEN)).status_code == 401
        assert api.get("/metrics").status_code == 200


def test_a_heartbeat_moves_the_heartbeat_histogram(api: Cluster) -> None:
    node_id = register(api, "n1")
    before = scrape(api)
    heartbeat(api, node_id)
    heartbeat(api, node_id)
    after = scrape(api)
    moved = value(after, "relaunch_heartbeat_seconds_count") - value(
        before, "relaunch_heartbeat_seconds_count"
    )
    assert moved == 2
    assert value(after, "relaunch_heartbeat_seconds_sum") > 0
    # The API's histogram has the route's template, never the node's id in the path.
    labels = {"route": HEARTBEAT_ROUTE, "method": "POST", "status": "2xx"}
    assert value(after, "relaunch_http_request_seconds_count", **labels) >= 2
    routes = {dict(key[1]).get("route") for key in after if key[0].startswith("relaunch_http")}
    assert f"/api/v1/nodes/{node_id}/heartbeat" not in routes


def test_garbage_collections_are_timed_while_the_app_runs(
    settings: ControllerSettings, clock: FakeClock
) -> None:
    """Each collection of the API's process is timed by generation, and the timer is
    gone from ``gc.callbacks`` once the app has stopped."""
    app = create_app(settings, clock=clock, run_background=False)
    pauses = app.state.metrics.gc_pauses  # type: ignore[attr-defined]
    with Cluster(app) as api:
        before = value(scrape(api), "relaunch_gc_pause_seconds_count", generation="2")
        gc.collect()
        gc.collect()
        after = value(scrape(api), "relaunch_gc_pause_seconds_count", generation="2")
        assert after >= before + 2
        assert pauses in gc.callbacks
    assert pauses not in gc.callbacks


def test_unmatched_paths_share_one_label(api: Cluster) -> None:
    for path in ("/no/such/page", "/another/one"):
        assert api.get(path).status_code == 404
    routes = {dict(key[1]).get("route") for key in scrape(api) if key[0].startswith("relaunch_h")}
    assert "<unmatched>" in routes
    assert "/no/such/page" not in routes


def test_jobs_and_nodes_by_state_follow_the_database(api: Cluster, reconciler: Reconciler) -> None:
    before = scrape(api)
    assert value(before, "relaunch_jobs", state="PENDING") == 0
    assert value(before, "relaunch_database_up") == 1
    submit(api, "1:1", name="tenant-secret-project")
    after = scrape(api)
    assert value(after, "relaunch_jobs", state="PENDING") == 1
    node_id = register(api, "n1")
    reconciler.run_once()
    placed = scrape(api)
    assert value(placed, "relaunch_jobs", state="PENDING") == 0
    assert value(placed, "relaunch_jobs", state="RUNNING") == 1
    assert value(placed, "relaunch_nodes", state="ALIVE") == 1
    assert value(placed, "relaunch_reconcile_pass_seconds_count") == 1
    for phase in ("lease", "fleet", "queue", "plan", "apply"):
        assert value(placed, "relaunch_reconcile_phase_seconds_count", phase=phase) == 1, phase
    # Where the pass's time went, as Linux's scheduler counts it for the pass's thread (no
    # sample where the kernel does not say).
    split = "relaunch_reconcile_pass_split_seconds"
    kernel_says = waited_for_cpu(schedstat_of(threading.get_native_id())) is not None
    for state in ("running", "runnable", "blocked"):
        assert value(placed, f"{split}_count", state=state) == int(kernel_says), state
    assert (value(placed, f"{split}_sum", state="running") > 0) is kernel_says
    assert value(placed, "relaunch_reconcile_actions_total", action="PlaceJob") == 1
    assert value(placed, "relaunch_controller_leader") == 1
    text = api.get("/metrics").text
    assert "tenant-secret-project" not in text
    assert heartbeat(api, node_id)


def test_reports_move_snapshots_and_restarts(api: Cluster, reconciler: Reconciler) -> None:
    job_id = submit(api, "1:1")
    node_id = register(api, "n1")
    reconciler.run_once()
    attempt_id = heartbeat(api, node_id)[0]["attempt_id"]
    saved = event("snapshot", step=5, bytes=3 * 2**20, seconds=0.4, path="/s/5")
    assert report(api, node_id, attempt_id, events=[saved]).status_code == 200
    failed = event("worker_failed", local_rank=0, global_rank=0, exitcode=1, cause="crash")
    assert report(api, node_id, attempt_id, events=[failed]).status_code == 200
    samples = scrape(api)
    assert value(samples, "relaunch_snapshot_bytes_count") == 1
    assert value(samples, "relaunch_snapshot_bytes_sum") == 3 * 2**20
    assert value(samples, "relaunch_snapshot_seconds_sum") == pytest.approx(0.4)
    assert value(samples, "relaunch_job_restarts_total") == 1
    assert value(samples, "relaunch_job_membership_changes_total") == 0
    assert api.get(f"/api/v1/jobs/{job_id}").json()["restart_count"] == 1


def test_a_short_scrape_token_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="at least 24 characters"):
        ControllerSettings(data_dir=tmp_path, metrics_token=SecretStr("short"))
