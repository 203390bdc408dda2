"""A controller that does not answer is one line of error from every CLI command, never a
traceback: it names the URL and what to check, and the command exits non-zero."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from service import cli
from service.cli import app
from service.local_cluster import free_port

REPO = Path(__file__).resolve().parents[2]
COMMANDS = [
    ["whoami"],
    ["jobs"],
    ["status", "1"],
    ["logs", "1"],
    ["cancel", "1"],
    ["users", "list"],
    ["users", "add", "alice"],
    ["users", "token", "1"],
    ["users", "tokens", "1"],
    ["users", "revoke", "1"],
    ["submit", "--name", "j", "--task", "regression"],
]


def invoke(*args: str) -> Result:
    env = {"RELAUNCH_TOKEN": "rlu_anything", "COLUMNS": "80"}
    return CliRunner().invoke(app, list(args), env=env)


def assert_one_line_error(result: Result, *expected: str) -> str:
    """The command ended on purpose (no exception of its own) with one line of error."""
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_no_controller_at_the_url_is_one_line_that_names_it(command: list[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    line = assert_one_line_error(invoke(*command, "--url", url), url, "connection refused")
    assert "relaunch server" in line and "RELAUNCH_URL" in line and "--url" in line


def test_a_url_without_a_scheme_is_taken_as_http() -> None:
    port = free_port()
    result = invoke("jobs", "--url", f"127.0.0.1:{port}")
    assert_one_line_error(result, f"http://127.0.0.1:{port}", "connection refused")


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:21", "http://127.0.0.1:port"])
def test_an_unusable_url_is_one_line_that_says_how_to_write_it(url: str) -> None:
    assert_one_line_error(invoke("whoami", "--url", url), url, "http://HOST:PORT", "--url")


def test_a_controller_that_does_not_answer_in_time_is_one_line(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "API_TIMEOUT_S", 0.5)
    url = f"http://127.0.0.1:{silent_port}"
    assert_one_line_error(invoke("jobs", "--url", url), url, "did not answer within 0.5 s")


def test_the_installed_command_prints_no_traceback() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "whoami", "--url", url],
        cwd=REPO,
        env={**os.environ, "RELAUNCH_TOKEN": "rlu_anything", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert url in line and "connection refused" in line


def test_a_bare_submit_says_what_is_missing_before_calling_the_controller() -> None:
    # Nothing listens at the URL: a call would end in "cannot reach the controller".
    url = f"http://127.0.0.1:{free_port()}"
    line = assert_one_line_error(invoke("submit", "--url", url), "--name NAME", "--task TASK")
    assert "--script PATH" in line and "cannot reach" not in line and "422" not in line


def test_a_submit_without_what_to_run_names_only_that(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: from-file\nnnodes: '1'\n")
    url = f"http://127.0.0.1:{free_port()}"
    line = assert_one_line_error(invoke("submit", str(spec), "--url", url), "--task TASK")
    assert "--name" not in line
