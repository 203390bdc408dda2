"""Every option and argument of every command says what it is for in --help."""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest
import typer
from typer.testing import CliRunner

from contract.protocol import DEFAULT_CONTROLLER_URL
from contract.tasks import TASKS
from service.cli import app
from worker.settings import AgentSettings


def commands(
    group: click.Command, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, click.Command]]:
    yield " ".join(path) or "relaunch", group
    if isinstance(group, click.Group):
        for name, command in group.commands.items():
            yield from commands(command, (*path, name))


def help_text(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_every_parameter_of_every_command_has_help() -> None:
    undocumented = [
        f"{path} {param.name}"
        for path, command in commands(typer.main.get_command(app))
        for param in command.params
        if not (getattr(param, "help", None) or "").strip()
    ]
    assert not undocumented, f"parameters without help text: {undocumented}"


def test_submit_help_explains_its_options_and_lists_the_tasks() -> None:
    text = help_text("submit")
    for option, words in [
        ("--name", "Job name"),
        ("--nproc-per-node", "Worker processes on each node"),
        ("--max-restarts", "Worker failures the job may restart from"),
        ("--snapshot-every-steps", "Save a snapshot every N training steps"),
        ("--working-dir", "Absolute path of a directory on every node"),
    ]:
        assert f"{option} <" in text and words in text.split(option, 1)[1][:200], option
    assert f"A built-in task: {', '.join(TASKS)}" in text
    assert len(TASKS) >= 3


def test_the_agents_default_controller_is_the_same_in_help_and_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RELAUNCH_AGENT_CONTROLLER_URL", raising=False)
    settings = AgentSettings(enrolment_token="t")
    assert settings.controller_url == DEFAULT_CONTROLLER_URL == "http://127.0.0.1:8080"
    assert f"[default: {DEFAULT_CONTROLLER_URL}]" in help_text("agent")


def test_demo_help_says_what_keep_running_does() -> None:
    text = help_text("demo")
    assert "--keep-running" in text and "until Ctrl-C" in text
    assert "stop when the demo ends" in text
