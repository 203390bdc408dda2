"""The Python API (``RelaunchClient``) against the real app: submit, wait, follow logs,
read metrics, cancel, and the errors it names."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from service.client import (
    ApiError,
    ControllerUnreachable,
    JobEnded,
    RelaunchClient,
    RelaunchError,
    SpecFileError,
    WaitTimeout,
)
from service.local_cluster import free_port
from service.reconciler import Reconciler
from tests.service.helpers import Cluster, event, job, register, report

SPEC = {"name": "fit", "task": {"name": "regression", "params": {"epochs": 2}}, "nnodes": "1"}
POLL_S = 0.01


@pytest.fixture
def client(api: Cluster) -> RelaunchClient:
    return RelaunchClient(token=api.user_token, http_client=api)


def log(line: str) -> dict[str, object]:
    return {"time": datetime.now(UTC).isoformat(), "local_rank": 0, "global_rank": 0, "line": line}


def placed(api: Cluster, reconciler: Reconciler, client: RelaunchClient) -> tuple[int, int, int]:
    """A job placed on one node: its id, the node's id and the attempt's id."""
    node_id = register(api, "a")
    job_id = client.submit(SPEC)["id"]
    reconciler.run_once()
    return job_id, node_id, job(api, job_id)["attempts"][0]["id"]


def succeed(api: Cluster, node_id: int, attempt_id: int, **body: object) -> None:
    exit_ = {"outcome": "succeeded", "exit_code": 0}
    assert report(api, node_id, attempt_id, exit=exit_, **body).status_code == 200


def test_a_job_is_submitted_from_a_dict_once_per_idempotency_key(client: RelaunchClient) -> None:
    first = client.submit(SPEC, idempotency_key="k1")
    assert (first["name"], first["state"]) == ("fit", "PENDING")
    assert client.submit(SPEC, idempotency_key="k1")["id"] == first["id"]
    assert client.submit(SPEC)["id"] != first["id"]
    assert [j["id"] for j in client.jobs()["items"]] == [first["id"] + 1, first["id"]]


@pytest.mark.parametrize("name", ["job.yaml", "job.json"])
def test_a_job_is_submitted_from_a_spec_file(
    client: RelaunchClient, tmp_path: Path, name: str
) -> None:
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text('{"name": "from-file", "task": {"name": "regression"}}')
    else:
        path.write_text("name: from-file\ntask:\n  name: regression\nnnodes: '1:2'\n")
    submitted = client.submit(path)
    assert submitted["name"] == "from-file"
    assert client.submit(str(path))["name"] == "from-file"


def test_a_spec_file_that_holds_no_spec_is_a_named_error(
    client: RelaunchClient, tmp_path: Path
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("- a list\n")
    with pytest.raises(SpecFileError, match="must hold a mapping"):
        client.submit(path)
    with pytest.raises(SpecFileError, match="cannot read"):
        client.submit(tmp_path / "missing.yaml")


def test_wait_returns_the_job_once_it_has_ended(
    api: Cluster, reconciler: Reconciler, client: RelaunchClient
) -> None:
    job_id, node_id, attempt_id = placed(api, reconciler, client)
    assert client.wait(job_id, {"RUNNING"}, timeout_s=5, poll_s=POLL_S)["state"] == "RUNNING"
    succeed(api, node_id, attempt_id)
    assert client.wait(job_id, timeout_s=5, poll_s=POLL_S)["state"] == "SUCCEEDED"


def test_wait_times_out_with_the_job_as_last_seen(client: RelaunchClient) -> None:
    job_id = client.submit(SPEC)["id"]  # no node: it stays PENDING
    with pytest.raises(WaitTimeout) as raised:
        client.wait(job_id, timeout_s=0.05, poll_s=POLL_S)
    assert isinstance(raised.value, RelaunchError)
    assert raised.value.job["state"] == "PENDING"
    assert f"job {job_id} is PENDING" in str(raised.value)


def test_wait_for_a_state_the_ended_job_cannot_reach_says_so(client: RelaunchClient) -> None:
    job_id = client.submit(SPEC)["id"]
    assert client.cancel(job_id)["state"] == "CANCELLED"
    assert client.cancel(job_id)["state"] == "CANCELLED"  # cancelling again changes nothing
    assert client.wait(job_id, timeout_s=5, poll_s=POLL_S)["state"] == "CANCELLED"
    with pytest.raises(JobEnded, match="ended CANCELLED"):
        client.wait(job_id, {"RUNNING"}, timeout_s=5, poll_s=POLL_S)
    with pytest.raises(ValueError, match="not job states: DONE"):
        client.wait(job_id, {"DONE"})


def test_follow_logs_yields_lines_as_they_come_until_the_job_ends(
    api: Cluster, reconciler: Reconciler, client: RelaunchClient
) -> None:
    job_id, node_id, attempt_id = placed(api, reconciler, client)
    report(api, node_id, attempt_id, logs=[log("one")])
    lines = client.follow_logs(job_id, poll_s=POLL_S)
    assert next(lines)["line"] == "one"
    report(api, node_id, attempt_id, logs=[log("two")])
    succeed(api, node_id, attempt_id, logs=[log("three")])
    assert [line["line"] for line in lines] == ["two", "three"]


def test_metrics_are_read_after_an_id(
    api: Cluster, reconciler: Reconciler, client: RelaunchClient
) -> None:
    job_id, node_id, attempt_id = placed(api, reconciler, client)
    progress = [
        event("progress", step=step, epoch=0, loss=1.0 / step, samples_per_s=10.0, world_size=1)
        for step in (5, 10)
    ]
    report(api, node_id, attempt_id, events=progress)
    metrics = client.metrics(job_id)
    assert [(m["step"], m["loss"]) for m in metrics] == [(5, 0.2), (10, 0.1)]
    assert [m["step"] for m in client.metrics(job_id, after_id=metrics[0]["id"])] == [10]
    assert client.metrics(job_id, limit=1) == metrics[:1]
    assert "placed" in [e["kind"] for e in client.events(job_id)]


def test_an_error_answer_carries_the_status_and_the_controllers_message(
    client: RelaunchClient,
) -> None:
    with pytest.raises(ApiError) as raised:
        client.job(999)
    assert raised.value.status_code == 404
    assert "999" in raised.value.message and isinstance(raised.value, RelaunchError)
    with pytest.raises(ApiError) as refused:
        client.submit({"name": "bad name!", "task": {"name": "regression"}})
    assert refused.value.status_code == 422 and "name" in refused.value.message


def test_the_token_comes_from_relaunch_token(api: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAUNCH_TOKEN", api.user_token)
    assert RelaunchClient(http_client=api).me()["name"] == "root"
    monkeypatch.setenv("RELAUNCH_TOKEN", "rlu_not-a-token")
    with pytest.raises(ApiError) as raised:
        RelaunchClient(http_client=api).me()
    assert raised.value.status_code == 401


def test_a_url_without_a_scheme_from_relaunch_url_is_taken_as_http(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    monkeypatch.setenv("RELAUNCH_URL", f"127.0.0.1:{port}")
    with (
        RelaunchClient(token="rlu_anything") as client,
        pytest.raises(ControllerUnreachable) as raised,
    ):
        client.jobs()
    assert raised.value.url == f"http://127.0.0.1:{port}"
    assert "connection refused" in str(raised.value) and "RELAUNCH_URL" in str(raised.value)
    assert isinstance(raised.value, RelaunchError)


def test_an_unusable_url_is_a_controller_unreachable() -> None:
    with pytest.raises(ControllerUnreachable, match="http://HOST:PORT"):
        RelaunchClient("http://127.0.0.1:port", token="rlu_anything").health()


def test_importing_the_client_loads_no_controller_or_torch() -> None:
    code = (
        "import sys, service.client; "
        "print(sorted(m for m in ('fastapi', 'sqlalchemy', 'torch') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
