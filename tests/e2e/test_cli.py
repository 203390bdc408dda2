"""The `relaunch` CLI against a real controller process."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from service.local_cluster import LocalCluster, free_port

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Controller:
    url: str
    admin_token: str


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    cluster = LocalCluster(data_dir=tmp_path_factory.mktemp("cli"), port=free_port())
    try:
        cluster.start_controller()
        assert cluster.admin_token is not None
        yield Controller(cluster.url, cluster.admin_token)
    finally:
        cluster.stop_all()


def run(controller: Controller, *args: str, token: str | None = None) -> tuple[int, str]:
    """``relaunch ARGS`` as the admin, or as the holder of ``token`` ("" for nobody)."""
    env = {"COLUMNS": "200", "RELAUNCH_TOKEN": controller.admin_token if token is None else token}
    result = CliRunner().invoke(app, [*args, "--url", controller.url], env=env)
    return result.exit_code, result.output


def _token_of(out: str) -> str:
    [token] = [line for line in out.splitlines() if line.startswith("rlu_")]
    return token


def test_submit_from_a_spec_file_with_flag_overrides(
    controller: Controller, tmp_path: Path
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: from-yaml\ntask:\n  name: regression\n  params: {epochs: 2}\nnnodes: '1:2'\n"
    )
    code, out = run(controller, "submit", str(spec), "--name", "renamed", "--max-restarts", "5")
    assert code == 0, out
    assert "submitted job" in out and "renamed" in out
    job_id = out.split("submitted job ")[1].split()[0]

    code, out = run(controller, "jobs", "--state", "PENDING")
    assert code == 0 and "renamed" in out
    code, out = run(controller, "status", job_id)
    assert code == 0 and "PENDING" in out and "submitted" in out
    code, out = run(controller, "cancel", job_id)
    assert code == 0 and "CANCELLED" in out
    code, out = run(controller, "cancel", job_id)
    assert code == 0 and "CANCELLED" in out


def test_submit_from_flags(controller: Controller) -> None:
    code, out = run(
        controller,
        "submit",
        "--name",
        "flags",
        "--task",
        "charlm",
        "--param",
        "epochs=2",
        "--param",
        "lr=0.01",
        "--nnodes",
        "1:3",
        "--snapshot-every-steps",
        "7",
    )
    assert code == 0, out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["submit", "--name", "x", "--task", "regression", "--nnodes", "3:1"],
            "must not be below MIN",
        ),
        (["submit", "--name", "x", "--task", "regression", "--param", "epochs=0"], "epochs"),
        (["submit", "--name", "x", "--task", "regression", "--param", "noequals"], "KEY=VALUE"),
        (["submit", "/nonexistent/job.yaml"], "cannot read"),
        (["status", "987654"], "does not exist"),
        (["cancel", "987654"], "does not exist"),
    ],
)
def test_bad_input_is_a_clear_error(controller: Controller, args: list[str], fragment: str) -> None:
    code, out = run(controller, *args)
    assert code == 2, out
    assert fragment in out


def test_an_admin_makes_a_user_who_sees_only_their_own_jobs(controller: Controller) -> None:
    code, out = run(controller, "users", "add", "carol", "--max-active-jobs", "2")
    assert code == 0, out
    carol = _token_of(out)
    code, out = run(controller, "whoami", token=carol)
    assert code == 0 and "carol (user)" in out, out
    code, out = run(controller, "submit", "--name", "mine", "--task", "regression", token=carol)
    assert code == 0, out
    code, out = run(controller, "jobs", token=carol)
    assert code == 0 and "mine" in out and "renamed" not in out, out
    code, out = run(controller, "users", "list", token=carol)
    assert code == 2 and "not an admin" in out, out


def test_a_revoked_token_stops_working_at_once(controller: Controller) -> None:
    code, out = run(controller, "users", "add", "dave")
    assert code == 0, out
    user_id = out.split("user ")[1].split()[0]
    code, out = run(controller, "users", "token", user_id, "--label", "laptop")
    assert code == 0, out
    second = _token_of(out)
    token_id = out.split("token ")[1].split()[0]
    assert run(controller, "whoami", token=second)[0] == 0
    code, out = run(controller, "users", "tokens", user_id)
    assert code == 0 and "laptop" in out and second not in out, out
    assert run(controller, "users", "revoke", token_id)[0] == 0
    code, out = run(controller, "whoami", token=second)
    assert code == 2 and "401" in out, out


def test_without_a_token_the_cli_says_how_to_get_one(controller: Controller) -> None:
    code, out = run(controller, "jobs", token="")
    assert code == 2 and "RELAUNCH_TOKEN" in out, out
