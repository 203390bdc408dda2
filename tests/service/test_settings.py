"""Every process reads its settings from the environment and refuses a bad value clearly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from service.settings import ControllerSettings
from worker.settings import AgentSettings

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize(
    ("command", "env", "expected"),
    [
        (["server"], {"RELAUNCH_PORT": "eighty"}, "RELAUNCH_PORT='eighty': Input should be"),
        (
            ["server"],
            {"RELAUNCH_NODE_TIMEOUT_S": "-1"},
            "RELAUNCH_NODE_TIMEOUT_S='-1': Input should be greater than 0",
        ),
        (
            ["server"],
            {"RELAUNCH_LEADER_LEASE_S": "1", "RELAUNCH_RECONCILE_INTERVAL_S": "0.5"},
            "leader_lease_s (1) must be at least three reconcile intervals (1.5)",
        ),
        (
            ["server"],
            {"RELAUNCH_NODE_TIMEOUT_S": "3", "RELAUNCH_HEARTBEAT_INTERVAL_S": "2"},
            "node_timeout_s (3) must be at least twice heartbeat_interval_s (4)",
        ),
        (
            ["agent", "--controller", "http://127.0.0.1:1"],
            {"RELAUNCH_AGENT_SLOTS": "0"},
            "RELAUNCH_AGENT_SLOTS='0': Input should be greater than or equal to 1",
        ),
        (
            ["server"],
            {"RELAUNCH_ENROLMENT_TOKEN": "too-short-secret"},
            "RELAUNCH_ENROLMENT_TOKEN=<hidden>: must be at least 24 characters",
        ),
        (
            ["agent", "--controller", "http://127.0.0.1:1"],
            {},
            "RELAUNCH_AGENT_ENROLMENT_TOKEN",
        ),
        (
            ["agent"],
            {"RELAUNCH_AGENT_CONTROLLER_URL": "controller:8080"},
            "RELAUNCH_AGENT_CONTROLLER_URL='controller:8080': controller_url must be an http",
        ),
    ],
)
def test_a_bad_setting_names_its_variable_and_what_it_must_be(
    command: list[str], env: dict[str, str], expected: str, tmp_path: Path
) -> None:
    env = {"RELAUNCH_DATA_DIR": str(tmp_path), **env}
    result = CliRunner().invoke(app, command, env=env)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output
    assert "too-short-secret" not in result.output  # a secret is never echoed


def test_everything_listens_on_loopback_unless_told_otherwise(tmp_path: Path) -> None:
    settings = ControllerSettings(data_dir=tmp_path)
    assert settings.host == "127.0.0.1"
    assert settings.enrolment_token is None  # and no node can register until one is set


def _env_names(cls: type[ControllerSettings] | type[AgentSettings]) -> set[str]:
    prefix = cls.model_config["env_prefix"]
    return {f"{prefix}{name}".upper() for name in cls.model_fields}


def test_the_readme_documents_every_setting() -> None:
    documented = set(re.findall(r"`(RELAUNCH_[A-Z0-9_]+)`", README.read_text()))
    missing = (_env_names(ControllerSettings) | _env_names(AgentSettings)) - documented
    assert not missing, f"settings missing from the README: {sorted(missing)}"
