"""docker-compose.yml is a valid Compose file with the topology the README promises.

No Docker engine runs here, so the file is checked by the ``compose_spec``
parser (a strict implementation of the Compose specification) after the same
interpolation Compose applies, and its settings by the settings classes that
the processes in it will build.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from compose_spec import PyCompose
from cryptography.fernet import Fernet
from pydantic_settings import BaseSettings

from service.settings import ControllerSettings
from tests.deploy.compose import MissingVariable, cli_commands, load_compose
from worker.settings import AgentSettings

ENV = {
    "POSTGRES_PASSWORD": "s3cret",
    "RELAUNCH_ENROLMENT_TOKEN": "e" * 32,
    "RELAUNCH_SECRETS_KEYS": Fernet.generate_key().decode(),
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(ENV)


def test_the_compose_file_follows_the_compose_specification(compose: dict[str, Any]) -> None:
    parsed = PyCompose.from_json(json.dumps(compose))
    parsed.validate()  # every network, volume, config and secret a service names is defined
    assert set(parsed.service_names()) == {"postgres", "controller", "agent"}
    declared = set(compose["volumes"])
    for name, service in compose["services"].items():
        for mount in service.get("volumes", []):
            source = mount.split(":", 1)[0]
            assert source.startswith(("/", ".")) or source in declared, (name, mount)


def test_the_checker_catches_a_broken_file(compose: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(compose))
    broken["services"]["agent"]["healthcheck"]["interval"] = "ten seconds"
    with pytest.raises(ValueError, match="duration"):
        PyCompose.from_json(json.dumps(broken))
    broken = json.loads(json.dumps(compose))
    broken["services"]["agent"]["comand"] = ["agent"]
    with pytest.raises(ValueError, match="comand"):
        PyCompose.from_json(json.dumps(broken))


@pytest.mark.parametrize("secret", sorted(ENV))
def test_there_is_no_default_for_a_secret(secret: str) -> None:
    with pytest.raises(MissingVariable, match=secret):
        load_compose({k: v for k, v in ENV.items() if k != secret})


def test_postgres_is_checked_and_keeps_its_data(compose: dict[str, Any]) -> None:
    pg = compose["services"]["postgres"]
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert "pgdata:/var/lib/postgresql/data" in pg["volumes"]
    assert "ports" not in pg


def test_the_controller_waits_for_the_database_and_publishes_only_the_api(
    compose: dict[str, Any],
) -> None:
    ctl = compose["services"]["controller"]
    assert ctl["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert ctl["command"] == ["server"]
    assert ctl["ports"] == ["127.0.0.1:8080:8080"]  # the API, on the host's loopback only
    assert ctl["environment"]["RELAUNCH_PORT"] == "8080"
    assert ctl["healthcheck"]["test"][:3] == ["CMD", "relaunch", "healthcheck"]


def test_agents_scale_and_stay_on_the_internal_network(compose: dict[str, Any]) -> None:
    agent = compose["services"]["agent"]
    # `--scale agent=N` needs no fixed container name and no published port.
    assert "container_name" not in agent and "ports" not in agent
    assert agent["command"] == ["agent"]
    assert agent["depends_on"]["controller"]["condition"] == "service_healthy"
    assert agent["networks"] == ["cluster"]
    assert compose["services"]["postgres"]["networks"] == ["cluster"]
    assert compose["networks"]["cluster"]["internal"] is True
    assert agent["environment"]["RELAUNCH_AGENT_CONTROLLER_URL"] == "http://controller:8080"


def test_every_node_and_the_controller_share_the_snapshot_volume(compose: dict[str, Any]) -> None:
    root = compose["services"]["controller"]["environment"]["RELAUNCH_SNAPSHOT_ROOT"]
    for name in ("controller", "agent"):
        assert f"snapshots:{root}" in compose["services"][name]["volumes"], name


def test_every_setting_in_the_file_is_one_the_process_knows_and_accepts(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt variable would be ignored silently; a bad value would stop the container."""
    roles: dict[str, type[BaseSettings]] = {
        "controller": ControllerSettings,
        "agent": AgentSettings,
    }
    for name, cls in roles.items():
        env: dict[str, str] = compose["services"][name]["environment"]
        prefix = cls.model_config["env_prefix"]
        known = {f"{prefix}{field}".upper() for field in cls.model_fields} | {"DATABASE_URL"}
        unknown = {k for k in env if k.startswith("RELAUNCH_") or k == "DATABASE_URL"} - known
        assert not unknown, f"{name}: unknown settings {unknown}"
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        cls()  # validates, from the environment
        for key in env:
            monkeypatch.delenv(key)


def test_the_commands_in_the_file_are_relaunch_commands(compose: dict[str, Any]) -> None:
    commands = cli_commands()
    for service in ("controller", "agent"):
        assert compose["services"][service]["command"][0] in commands
        assert compose["services"][service]["healthcheck"]["test"][2] in commands
