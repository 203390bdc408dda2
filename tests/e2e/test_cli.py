"""The `relaunch` CLI against a real controller process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from service.demo import LocalCluster, free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cluster = LocalCluster(
        data_dir=tmp_path_factory.mktemp("cli"), port=free_port(), store_port=free_port()
    )
    try:
        cluster.start_controller()
        yield cluster.url
    finally:
        cluster.stop_all()


def run(url: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, [*args, "--url", url], env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_submit_from_a_spec_file_with_flag_overrides(controller: str, tmp_path: Path) -> None:
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


def test_submit_from_flags(controller: str) -> None:
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
def test_bad_input_is_a_clear_error(controller: str, args: list[str], fragment: str) -> None:
    code, out = run(controller, *args)
    assert code == 2, out
    assert fragment in out
