"""What every part of the ``relaunch`` command shares, and how a part plugs in.

The command is the controller's (``service.cli``). The node's commands plug
into it through entry points, so that the controller's side never imports the
node's:

- group ``relaunch.cli``: each entry is a function that becomes the command of
  the entry's name (``relaunch agent``);
- group ``relaunch.healthcheck``: each entry is the health check of the role of
  its name (``relaunch healthcheck --role agent``), called with ``max_age_s``;
  it returns when healthy and raises the exit of ``fail`` when not.

Every part reports an error the same way: one line on stderr and exit status 2,
with the environment variable named when a setting is bad.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, TypeVar

import typer
from pydantic import AliasChoices, ValidationError
from pydantic_settings import BaseSettings
from rich.console import Console
from rich.markup import escape

from contract.logs import LOG_FORMAT

COMMANDS_GROUP = "relaunch.cli"
HEALTH_CHECKS_GROUP = "relaunch.healthcheck"

err_console = Console(stderr=True)

LogLevelOption = Annotated[str, typer.Option(help="Logging level: debug, info, warning or error")]


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=LOG_FORMAT,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise


def fail(message: str) -> typer.Exit:
    """Print ``message`` as the command's error (never wrapped) and return the exit to raise."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code=2)


def _explain_settings(cls: type[BaseSettings], exc: ValidationError) -> str:
    """Name the environment variable behind each bad value, and say what it must be."""
    prefix = cls.model_config.get("env_prefix", "")
    lines = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        if not error["loc"]:
            lines.append(f"  {message}")
            continue
        name = str(error["loc"][0])
        field = cls.model_fields.get(name)
        alias = field.validation_alias if field else None
        env = alias.choices[0] if isinstance(alias, AliasChoices) else f"{prefix}{name}".upper()
        secret = field is not None and "SecretStr" in str(field.annotation)
        shown = "<hidden>" if secret else repr(error.get("input"))
        lines.append(f"  {env}={shown}: {message}")
    return "\n".join(lines)


S = TypeVar("S", bound=BaseSettings)


def load_settings(cls: type[S], what: str, **overrides: Any) -> S:
    """The settings from the environment (and ``overrides``), or exit 2 saying what is wrong."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        raise fail(f"bad {what} settings:\n{_explain_settings(cls, exc)}") from exc
