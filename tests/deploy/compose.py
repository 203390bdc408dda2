"""Read docker-compose.yml as Compose does: YAML (with merge keys), then interpolation."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, $NAME, $$
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(ValueError):
    """A ``${NAME:?error}`` whose variable is unset (Compose refuses to start)."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    def substitute(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["bare"]
        value, op, arg = env.get(name), m["op"], m["arg"] or ""
        unset_or_empty = value is None or (op is not None and op.startswith(":") and not value)
        if op in (":-", "-") and unset_or_empty:
            return arg
        if op in (":?", "?") and unset_or_empty:
            raise MissingVariable(f"{name}: {arg}")
        return value or ""

    return _VARIABLE.sub(substitute, text)


def _walk(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_walk(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    return node


def load_compose(env: Mapping[str, str], path: Path = COMPOSE_FILE) -> dict[str, Any]:
    data: dict[str, Any] = _walk(yaml.safe_load(path.read_text()), env)
    return data


def cli_commands() -> set[str]:
    """The subcommands of the ``relaunch`` command."""
    from service.cli import app

    return {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
