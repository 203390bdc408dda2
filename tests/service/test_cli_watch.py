"""`relaunch status --watch` and `relaunch logs --follow` against the real app: what they
print while a job runs, and how they end."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from typer.testing import CliRunner, Result

from service import cli
from service.client import RelaunchClient
from service.reconciler import Reconciler
from tests.service.helpers import Cluster, event, job, register, report

SPEC = {"name": "fit", "task": {"name": "regression"}, "nnodes": "1"}


@pytest.fixture
def invoke(api: Cluster, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    """Run a command against the app, as its admin, with ``steps`` run one per pause of the
    command (a pause with no step left fails the test: the command should have ended)."""

    def run(*args: str, steps: list[Callable[[], object]]) -> Result:
        def pause(seconds: float) -> None:
            assert steps, "the command went on after the job had ended"
            steps.pop(0)()

        monkeypatch.setattr(
            cli,
            "RelaunchClient",
            lambda _url, token, **_k: RelaunchClient(token=token, http_client=api),
        )
        monkeypatch.setattr(cli.time, "sleep", pause)
        monkeypatch.setattr(cli.console, "width", 300)
        return CliRunner().invoke(cli.app, list(args), env={"RELAUNCH_TOKEN": api.user_token})

    return run


def lines_with(result: Result, *texts: str) -> list[str]:
    return [line for line in result.output.splitlines() if all(t in line for t in texts)]


def test_watch_prints_what_changed_and_exits_0_when_the_job_succeeds(
    api: Cluster, reconciler: Reconciler, invoke: Callable[..., Result]
) -> None:
    node_id = register(api, "a")
    job_id = api.post("/api/v1/jobs", json=SPEC).json()["id"]
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]

    def progress() -> None:
        started = event("started", world_size=1, restart_count=0, total_steps=40)
        step = event("progress", step=10, epoch=0, loss=0.5, samples_per_s=1.0, world_size=1)
        report(api, node_id, attempt_id, events=[started, step])

    def finish() -> None:
        exit_ = {"outcome": "succeeded", "exit_code": 0}
        report(api, node_id, attempt_id, events=[event("finished", step=40, loss=0.1)], exit=exit_)

    result = invoke(
        "status",
        str(job_id),
        "--watch",
        "--interval",
        "0.1",
        steps=[lambda: None, progress, finish],
    )
    assert result.exit_code == 0, result.output
    # The unchanged view after the first pause printed nothing again.
    assert len(lines_with(result, "RUNNING", "step 0/?")) == 1
    assert len(lines_with(result, "RUNNING", "step 10/40")) == 1
    assert len(lines_with(result, "SUCCEEDED", "step 40/40")) == 1
    # Each event once: in the first view's table, or as a line when it came.
    events = api.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
    for e in events:
        assert len(lines_with(result, e["message"])) == 1, (e, result.output)
    assert lines_with(result, events[-1]["kind"], events[-1]["message"])


def test_watch_exits_1_when_the_job_does_not_succeed(
    api: Cluster, invoke: Callable[..., Result]
) -> None:
    job_id = api.post("/api/v1/jobs", json=SPEC).json()["id"]
    cancel = lambda: api.post(f"/api/v1/jobs/{job_id}/cancel")  # noqa: E731
    result = invoke("status", str(job_id), "--watch", steps=[cancel])
    assert result.exit_code == 1, result.output
    assert len(lines_with(result, "PENDING")) == 1
    assert len(lines_with(result, "CANCELLED")) == 1


def test_status_without_watch_shows_the_job_once(
    api: Cluster, invoke: Callable[..., Result]
) -> None:
    job_id = api.post("/api/v1/jobs", json=SPEC).json()["id"]
    result = invoke("status", str(job_id), steps=[])
    assert result.exit_code == 0, result.output
    assert lines_with(result, f"job {job_id} fit: PENDING")


def test_logs_follow_prints_lines_until_the_job_ends(
    api: Cluster, reconciler: Reconciler, invoke: Callable[..., Result]
) -> None:
    node_id = register(api, "a")
    job_id = api.post("/api/v1/jobs", json=SPEC).json()["id"]
    reconciler.run_once()
    attempt_id = job(api, job_id)["attempts"][0]["id"]

    def log(text: str) -> dict[str, object]:
        return {
            "time": datetime.now(UTC).isoformat(),
            "local_rank": 0,
            "global_rank": 0,
            "line": text,
        }

    report(api, node_id, attempt_id, logs=[log("first")])

    def finish() -> None:
        exit_ = {"outcome": "succeeded", "exit_code": 0}
        report(api, node_id, attempt_id, logs=[log("last")], exit=exit_)

    result = invoke("logs", str(job_id), "--follow", steps=[finish])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "[attempt 1 node a rank 0] first",
        "[attempt 1 node a rank 0] last",
    ]
