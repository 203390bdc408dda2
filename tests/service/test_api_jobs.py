"""The jobs API against a real database: validation, lookups, listing, cancel."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from cryptography.fernet import Fernet
from fastapi.testclient import TestClient

from service.api.jobs import job_public
from service.models import Job
from service.reconciler import Reconciler
from service.schemas import REDACTED
from service.secrets import Keyring, open_env
from service.settings import ControllerSettings
from service.states import JobState

VALID: dict[str, Any] = {
    "name": "reg",
    "task": {"name": "regression", "params": {"epochs": 2}},
    "nnodes": "1:2",
    "nproc_per_node": 1,
}


def submit(api: TestClient, **changes: Any) -> Any:
    return api.post("/api/v1/jobs", json={**VALID, **changes})


def test_submit_returns_a_pending_job(api: TestClient) -> None:
    r = submit(api)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["state"] == "PENDING"
    assert (body["min_nodes"], body["max_nodes"]) == (1, 2)
    assert api.get(f"/api/v1/jobs/{body['id']}").json()["spec"]["task"]["name"] == "regression"
    kinds = [e["kind"] for e in api.get(f"/api/v1/jobs/{body['id']}/events").json()["items"]]
    assert kinds == ["submitted"]


def test_script_jobs_and_single_number_nnodes_are_accepted(api: TestClient) -> None:
    r = api.post(
        "/api/v1/jobs",
        json={
            "name": "mine",
            "script": {"path": "/opt/train.py", "args": ["--lr", "0.1"]},
            "nnodes": 2,
            "env": {"MY_FLAG": "1"},
        },
    )
    assert r.status_code == 201, r.text
    assert (r.json()["min_nodes"], r.json()["max_nodes"]) == (2, 2)


def test_an_absolute_working_dir_is_accepted_and_shown_in_the_spec(api: TestClient) -> None:
    r = submit(api, working_dir="/data/runs/exp1")
    assert r.status_code == 201, r.text
    assert api.get(f"/api/v1/jobs/{r.json()['id']}").json()["spec"]["working_dir"] == (
        "/data/runs/exp1"
    )


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"task": None}, "exactly one of 'task'"),
        ({"script": {"path": "/x.py"}}, "exactly one of 'task'"),
        ({"nnodes": "3:1"}, "must not be below MIN"),
        ({"nnodes": "two"}, "'N' or 'MIN:MAX'"),
        ({"nnodes": "0:2"}, "at least 1"),
        ({"nproc_per_node": 0}, "greater than or equal to 1"),
        ({"task": {"name": "nope"}}, "nope"),
        ({"task": {"name": "regression", "params": {"epochs": -1}}}, "epochs"),
        ({"task": {"name": "regression", "params": {"bogus": 1}}}, "bogus"),
        ({"task": None, "script": {"path": "train.py"}}, "must be absolute"),
        ({"working_dir": "runs/exp1"}, "'working_dir' must be absolute"),
        ({"working_dir": "/data/../etc"}, "'working_dir' must not contain '..'"),
        ({"working_dir": "/data/\x00x"}, "'working_dir' must not contain NUL"),
        ({"working_dir": "/" + "d" * 4096}, "at most 4096 characters"),
        ({"task": None, "script": {"module": "not a module"}}, "not a dotted"),
        ({"env": {"RANK": "3"}}, "set by relaunch"),
        ({"env": {"1BAD": "x"}}, "not a valid variable name"),
        ({"name": ""}, "at least 1 character"),
        ({"surprise": 1}, "Extra inputs are not permitted"),
        ({"max_restarts": -1}, "greater than or equal to 0"),
        ({"hang_timeout_s": 0}, "greater than 0"),
        ({"hang_timeout_s": "soon"}, "'auto'"),
        ({"hang_timeout_s": 8 * 24 * 3600}, "less than or equal to 604800"),
        ({"collective_timeout_s": 5}, "greater than or equal to 10"),
        ({"collective_timeout_s": 10**6}, "less than or equal to 86400"),
        ({"collective_timeout_s": None}, "valid number"),
    ],
)
def test_invalid_specs_get_a_422_that_says_what_is_wrong(
    api: TestClient, changes: dict[str, Any], fragment: str
) -> None:
    r = submit(api, **changes)
    assert r.status_code == 422, r.text
    assert fragment in r.text
    assert api.get("/api/v1/jobs").json()["total"] == 0  # nothing half-written


def test_malformed_json_is_a_422(api: TestClient) -> None:
    r = api.post("/api/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422


@pytest.mark.parametrize("suffix", ["", "/events", "/metrics", "/logs", "/snapshots"])
def test_unknown_job_is_a_404(api: TestClient, suffix: str) -> None:
    r = api.get(f"/api/v1/jobs/4242{suffix}")
    assert r.status_code == 404
    assert "job 4242 does not exist" in r.json()["detail"]


def test_cancel_unknown_job_is_a_404(api: TestClient) -> None:
    assert api.post("/api/v1/jobs/999/cancel").status_code == 404


def test_list_filters_by_state_and_pages_newest_first(api: TestClient) -> None:
    ids = [submit(api, name=f"j{i}").json()["id"] for i in range(5)]
    api.post(f"/api/v1/jobs/{ids[1]}/cancel")
    page = api.get("/api/v1/jobs", params={"limit": 2, "offset": 1}).json()
    assert page["total"] == 5
    assert [j["id"] for j in page["items"]] == [ids[3], ids[2]]
    pending = api.get("/api/v1/jobs", params={"state": "PENDING"}).json()
    assert pending["total"] == 4
    assert ids[1] not in [j["id"] for j in pending["items"]]
    assert api.get("/api/v1/jobs", params={"state": "NOPE"}).status_code == 422
    assert api.get("/api/v1/jobs", params={"limit": 0}).status_code == 422


def test_cancel_is_idempotent(api: TestClient) -> None:
    job_id = submit(api).json()["id"]
    first = api.post(f"/api/v1/jobs/{job_id}/cancel")
    second = api.post(f"/api/v1/jobs/{job_id}/cancel")
    assert first.status_code == second.status_code == 200
    assert first.json()["state"] == second.json()["state"] == "CANCELLED"
    kinds = [e["kind"] for e in api.get(f"/api/v1/jobs/{job_id}/events").json()["items"]]
    assert kinds.count("cancelled") == 1


def test_healthz_says_which_controller_leads(
    api: TestClient, reconciler: Reconciler, settings: ControllerSettings
) -> None:
    me = settings.controller_id
    before = api.get("/healthz").json()
    assert before == {
        "status": "ok",
        "database": "ok",
        "controller": me,
        "role": "standby",
        "leader": None,
    }
    reconciler.run_once()
    after = api.get("/healthz").json()
    assert (after["role"], after["leader"]) == ("leader", me)


def test_openapi_lists_the_routes(api: TestClient) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    for path in ("/api/v1/jobs", "/api/v1/jobs/{job_id}/cancel", "/api/v1/nodes/register"):
        assert path in paths


def test_the_spec_is_parsed_once_and_redacted_only_in_the_response() -> None:
    when = datetime(2026, 1, 1, tzinfo=UTC)
    row = Job(
        id=1,
        name="reg",
        spec={**VALID, "env": {"TOKEN": "s3cret"}},
        state=JobState.PENDING,
        created_at=when,
        updated_at=when,
        attempt_count=0,
        restart_count=0,
        membership_changes=0,
        message="",
    )
    assert row.job_spec is row.job_spec
    assert job_public(row).spec.env == {"TOKEN": REDACTED}
    assert row.job_spec.env == {"TOKEN": ""}  # names only: values are read with open_env
    # A row stored before values were encrypted: still what the nodes are sent.
    assert open_env(Keyring((Fernet.generate_key(),), "test"), row.spec) == {"TOKEN": "s3cret"}
