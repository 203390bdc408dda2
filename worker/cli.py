"""The node's commands of ``relaunch``: ``relaunch agent``, and the agent's health check.

They plug into the controller's command through entry points (pyproject.toml,
groups described in ``contract.cli``), so the controller's side never imports
the node's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from contract.cli import LogLevelOption, fail, load_settings, setup_logging
from contract.protocol import DEFAULT_CONTROLLER_URL
from worker.settings import AgentSettings


def agent(
    controller: Annotated[
        str,
        typer.Option(
            envvar="RELAUNCH_AGENT_CONTROLLER_URL",
            help="Controller URL, or the URLs of several controllers of one database "
            "separated by commas (tried in turn when one does not answer); the default is a "
            "controller on this host at its default port",
        ),
    ] = DEFAULT_CONTROLLER_URL,
    name: Annotated[
        str | None, typer.Option(help="Node name, unique and stable (default: the host name)")
    ] = None,
    address: Annotated[
        str | None,
        typer.Option(help="Address other nodes use to reach this one (default: 127.0.0.1)"),
    ] = None,
    slots: Annotated[
        int | None, typer.Option(help="Worker processes this node takes (default: 1)")
    ] = None,
    gpus: Annotated[
        str | None,
        typer.Option(
            help="GPUs to offer: 'none', or NVML indices such as 0,2,3 (default: every GPU "
            "NVML finds; without NVML, listed indices are trusted as GPUs of unknown model)"
        ),
    ] = None,
    cpus: Annotated[
        int | None,
        typer.Option(
            help="Cores this node's workers may use, which sizes their thread pools "
            "(default: the cores the agent may run on)"
        ),
    ] = None,
    work_dir: Annotated[
        Path | None,
        typer.Option(
            help="Agent state directory (default: ~/.relaunch/agent/NAME; "
            "as root /var/lib/relaunch-agent/NAME)"
        ),
    ] = None,
    enrolment_token_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the enrolment token, readable by its owner only (chmod 600); "
            "safer than RELAUNCH_AGENT_ENROLMENT_TOKEN, which /proc/PID/environ keeps showing"
        ),
    ] = None,
    log_level: LogLevelOption = "info",
) -> None:
    """Run a node agent: register with the controller and run what it assigns.

    An option left out is read from its RELAUNCH_AGENT_* variable (RELAUNCH_AGENT_NAME,
    ...); the enrolment token from --enrolment-token-file (RELAUNCH_AGENT_ENROLMENT_TOKEN_FILE)
    or from RELAUNCH_AGENT_ENROLMENT_TOKEN, never from the command line. A refused
    enrolment token ends the agent with exit status 1.

    As root (RELAUNCH_AGENT_ISOLATION=user, the default) each job runs as a user of its
    own, uid = gid = RELAUNCH_AGENT_JOB_UID_BASE + job id; not as root, the agent refuses
    to start unless RELAUNCH_AGENT_ISOLATION=none (every job as the agent's user, for
    one trusted tenant only).
    """
    from worker.agent import run_agent  # loaded when an agent runs, not for every command

    setup_logging(log_level)
    overrides: dict[str, Any] = {"controller_url": controller}
    for key, value in (
        ("name", name),
        ("address", address),
        ("slots", slots),
        ("gpus", gpus),
        ("cpus", cpus),
        ("work_dir", work_dir),
        ("enrolment_token_file", enrolment_token_file),
    ):
        if value is not None:
            overrides[key] = value
    settings = load_settings(AgentSettings, "agent", **overrides)
    raise typer.Exit(code=run_agent(settings))


def agent_health(max_age_s: float) -> None:
    """Return if this host's agent loop turned in the last ``max_age_s`` seconds, whether or
    not the controller answers; raise the command's error exit if not."""
    settings = load_settings(AgentSettings, "agent")
    try:
        age = time.time() - settings.alive_file.stat().st_mtime
    except OSError as exc:
        raise fail(f"the agent has not started its loop: {exc}") from exc
    if age > max_age_s:
        raise fail(f"the agent's loop last turned {age:.0f} s ago")
