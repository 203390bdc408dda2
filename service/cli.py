"""The ``relaunch`` command: controller, node agent, and a client of the REST API."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
import yaml
from pydantic import AliasChoices, ValidationError
from pydantic_settings import BaseSettings
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from service.client import ApiError, RelaunchClient

app = typer.Typer(
    help="relaunch: fault-tolerant, elastic training service for PyTorch",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)

UrlOption = Annotated[
    str,
    typer.Option("--url", envvar="RELAUNCH_URL", help="Controller URL"),
]
DEFAULT_URL = "http://127.0.0.1:8080"
TOKEN_ENV = "RELAUNCH_TOKEN"
STATE_COLOURS = {
    "PENDING": "yellow",
    "WAITING": "yellow",
    "RUNNING": "green",
    "RESTARTING": "magenta",
    "SUCCEEDED": "bold green",
    "FAILED": "bold red",
    "CANCELLED": "dim",
}


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise


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


def _load_settings(cls: type[S], what: str, **overrides: Any) -> S:
    """The settings from the environment (and ``overrides``), or exit 2 saying what is wrong."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        raise _fail(f"bad {what} settings:\n{_explain_settings(cls, exc)}") from exc


def _fail(message: str) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {escape(message)}")
    return typer.Exit(code=2)


def _client(url: str) -> RelaunchClient:
    """A client acting as the user whose token is in RELAUNCH_TOKEN. The token is read
    from the environment only: a command-line option would show it in `ps`."""
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise _fail(
            f"set {TOKEN_ENV} to your API token (an admin makes one with "
            "`relaunch users add` or `relaunch users token`)"
        )
    return RelaunchClient(url, token)


@contextmanager
def _api(url: str) -> Iterator[RelaunchClient]:
    """A client as in ``_client``; an error answer ends the command with its message."""
    with _client(url) as client:
        try:
            yield client
        except ApiError as exc:
            raise _fail(str(exc)) from exc


@app.command()
def server(
    host: Annotated[str | None, typer.Option(help="Listen address")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port")] = None,
    log_level: Annotated[str, typer.Option()] = "info",
) -> None:
    """Run the controller: REST API, reconciler and rendezvous store.

    Configured by RELAUNCH_* environment variables (see the README); DATABASE_URL
    selects PostgreSQL instead of the embedded SQLite file.
    """
    import uvicorn

    from service.api.app import create_app
    from service.settings import ControllerSettings

    _setup_logging(log_level)
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    settings = _load_settings(ControllerSettings, "controller", **overrides)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level.lower(),
        access_log=False,
    )


@app.command()
def agent(
    controller: Annotated[
        str, typer.Option(envvar="RELAUNCH_AGENT_CONTROLLER_URL", help="Controller URL")
    ] = DEFAULT_URL,
    name: Annotated[str | None, typer.Option(help="Node name (unique)")] = None,
    address: Annotated[
        str | None, typer.Option(help="Address other nodes use to reach this one")
    ] = None,
    slots: Annotated[int | None, typer.Option(help="Worker processes this node takes")] = None,
    work_dir: Annotated[Path | None, typer.Option(help="Agent state directory")] = None,
    log_level: Annotated[str, typer.Option()] = "info",
) -> None:
    """Run a node agent: register with the controller and run what it assigns."""
    from worker.agent import run_agent
    from worker.settings import AgentSettings

    _setup_logging(log_level)
    overrides: dict[str, Any] = {"controller_url": controller}
    for key, value in (
        ("name", name),
        ("address", address),
        ("slots", slots),
        ("work_dir", work_dir),
    ):
        if value is not None:
            overrides[key] = value
    settings = _load_settings(AgentSettings, "agent", **overrides)
    run_agent(settings)


@app.command()
def healthcheck(
    role: Annotated[
        str | None,
        typer.Option(
            help="controller or agent; default: agent when RELAUNCH_AGENT_CONTROLLER_URL is set"
        ),
    ] = None,
    max_age_s: Annotated[float, typer.Option(help="How stale an agent's loop may be")] = 30.0,
) -> None:
    """Exit 0 if this host's controller or agent is healthy (the image's HEALTHCHECK).

    A controller is healthy when its /healthz answers (leader or standby); an
    agent when its loop has turned in the last ``max_age_s`` seconds, whether
    or not the controller answers.
    """
    import httpx

    from service.settings import ControllerSettings
    from service.store import connect_host
    from worker.settings import AgentSettings

    role = role or ("agent" if os.environ.get("RELAUNCH_AGENT_CONTROLLER_URL") else "controller")
    if role == "agent":
        agent_settings = _load_settings(AgentSettings, "agent")
        try:
            age = time.time() - agent_settings.alive_file.stat().st_mtime
        except OSError as exc:
            raise _fail(f"the agent has not started its loop: {exc}") from exc
        if age > max_age_s:
            raise _fail(f"the agent's loop last turned {age:.0f} s ago")
        return
    if role != "controller":
        raise _fail(f"--role must be controller or agent, got {role!r}")
    settings = _load_settings(ControllerSettings, "controller")
    url = f"http://{connect_host(settings.host)}:{settings.port}/healthz"
    try:
        reply = httpx.get(url, timeout=5.0)
    except httpx.HTTPError as exc:
        raise _fail(f"the controller does not answer: {exc}") from exc
    if reply.status_code != 200:
        raise _fail(f"the controller answers {reply.status_code}: {reply.text[:200]}")
    console.print(reply.json())


def _load_spec_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise _fail(f"cannot read {path}: {exc}") from exc
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise _fail(f"{path} is not valid {kind}: {exc}") from exc
    if not isinstance(data, dict):
        raise _fail(f"{path} must hold a mapping (the job spec)")
    return data


def _parse_params(pairs: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise _fail(f"--param takes KEY=VALUE, got {pair!r}")
        try:
            params[key] = json.loads(raw)
        except ValueError:
            params[key] = raw
    return params


@app.command()
def submit(
    spec_file: Annotated[
        Path | None, typer.Argument(help="A job spec as YAML or JSON (flags override it)")
    ] = None,
    name: Annotated[str | None, typer.Option()] = None,
    task: Annotated[str | None, typer.Option(help="A built-in task by name")] = None,
    param: Annotated[list[str] | None, typer.Option(help="Task parameter KEY=VALUE")] = None,
    script: Annotated[str | None, typer.Option(help="Absolute path of a torchrun script")] = None,
    module: Annotated[str | None, typer.Option(help="A module to run as python -m")] = None,
    arg: Annotated[list[str] | None, typer.Option(help="Argument of the script/module")] = None,
    nnodes: Annotated[str | None, typer.Option(help="'N' or 'MIN:MAX'")] = None,
    nproc_per_node: Annotated[int | None, typer.Option()] = None,
    max_restarts: Annotated[int | None, typer.Option()] = None,
    snapshot_every_steps: Annotated[int | None, typer.Option()] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option(help="Send the same key again to get the same job, not a second one"),
    ] = None,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Submit a job; prints its id."""
    spec: dict[str, Any] = _load_spec_file(spec_file) if spec_file else {}
    if name:
        spec["name"] = name
    if task:
        spec["task"] = {"name": task, "params": _parse_params(param or [])}
    if script or module:
        spec["script"] = {"path": script, "module": module, "args": arg or []}
    for key, value in (
        ("nnodes", nnodes),
        ("nproc_per_node", nproc_per_node),
        ("max_restarts", max_restarts),
    ):
        if value is not None:
            spec[key] = value
    if snapshot_every_steps is not None:
        spec.setdefault("snapshot", {})["every_steps"] = snapshot_every_steps
    with _client(url) as client:
        try:
            job = client.submit(spec, idempotency_key)
        except ApiError as exc:
            raise _fail(f"the controller refused the job: {exc}") from exc
    console.print(f"submitted job [bold]{job['id']}[/] ({job['name']}), state {job['state']}")


def _state_text(state: str) -> str:
    return f"[{STATE_COLOURS.get(state, 'white')}]{state}[/]"


@app.command()
def jobs(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state")] = None,
    limit: Annotated[int, typer.Option()] = 50,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """List jobs, newest first."""
    with _api(url) as client:
        page = client.jobs(state=state, limit=limit)
    table = Table("id", "name", "state", "nodes", "world", "step", "loss", "restarts")
    for job in page["items"]:
        table.add_row(
            str(job["id"]),
            job["name"],
            _state_text(job["state"]),
            f"{job['min_nodes']}:{job['max_nodes']}",
            str(job["world_size"] or "-"),
            f"{job['last_step'] or 0}/{job['total_steps'] or '?'}",
            f"{job['last_loss']:.4f}" if job["last_loss"] is not None else "-",
            str(job["restart_count"]),
        )
    console.print(table)
    console.print(f"{len(page['items'])} of {page['total']} job(s)")


def print_timeline(events: list[dict[str, Any]]) -> None:
    table = Table("time", "event", "what happened", title="timeline")
    for event in events:
        # Messages quote workers' errors, which may hold "[...]"; print them as text.
        table.add_row(event["time"][11:23], event["kind"], escape(event["message"]))
    console.print(table)


@app.command()
def status(
    job_id: Annotated[int, typer.Argument()],
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Show one job: state, progress, attempts and timeline."""
    with _api(url) as client:
        job = client.job(job_id)
        events = client.events(job_id)
    console.print(
        f"job [bold]{job['id']}[/] {job['name']}: {_state_text(job['state'])}  "
        f"step {job['last_step'] or 0}/{job['total_steps'] or '?'}  "
        f"world size {job['world_size'] or '-'}  restarts {job['restart_count']}"
        f"/{job['spec']['max_restarts']}  membership changes {job['membership_changes']}"
    )
    if job["message"]:
        console.print(f"message: {escape(job['message'])}")
    for attempt in job["attempts"]:
        nodes = ", ".join(f"{m['node_name']}({m['state'].lower()})" for m in attempt["members"])
        console.print(f"  attempt {attempt['number']} {attempt['state']}: {nodes}")
    print_timeline(events)


@app.command()
def logs(
    job_id: Annotated[int, typer.Argument()],
    follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Print a job's log lines (node, local rank, line); --follow keeps polling."""
    after = 0
    with _api(url) as client:
        while True:
            lines = client.logs(job_id, after_id=after)
            for line in lines:
                rank = "-" if line["local_rank"] is None else line["local_rank"]
                typer.echo(f"[node {line['node_id']} rank {rank}] {line['line']}")
                after = line["id"]
            if not follow:
                return
            if not lines:
                if client.job(job_id)["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    return
                time.sleep(1.0)


@app.command()
def cancel(
    job_id: Annotated[int, typer.Argument()],
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Cancel a job (cancelling an ended job changes nothing)."""
    with _api(url) as client:
        job = client.cancel(job_id)
    console.print(f"job {job['id']}: {_state_text(job['state'])}")


users_app = typer.Typer(help="Users and their API tokens (admin only)", no_args_is_help=True)
app.add_typer(users_app, name="users")


def _print_secret(secret: str) -> None:
    console.print("API token (shown this once; only its hash is kept):")
    typer.echo(secret)


@users_app.command("add")
def users_add(
    name: Annotated[str, typer.Argument()],
    admin: Annotated[bool, typer.Option("--admin", help="Make an admin")] = False,
    max_active_jobs: Annotated[int | None, typer.Option(help="Unfinished jobs at once")] = None,
    max_nodes: Annotated[int | None, typer.Option(help="Nodes their jobs may hold")] = None,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Add a user and print their first API token."""
    role = "admin" if admin else "user"
    with _api(url) as client:
        made = client.create_user(name, role, max_active_jobs=max_active_jobs, max_nodes=max_nodes)
    console.print(f"user [bold]{made['user']['id']}[/] {name} ({role})")
    _print_secret(made["token"]["secret"])


@users_app.command("list")
def users_list(url: UrlOption = DEFAULT_URL) -> None:
    """List users."""
    with _api(url) as client:
        page = client.users()
    table = Table("id", "name", "role", "max jobs", "max nodes", "created")
    for user in page["items"]:
        table.add_row(
            str(user["id"]),
            user["name"],
            user["role"],
            str(user["max_active_jobs"] or "default"),
            str(user["max_nodes"] or "default"),
            user["created_at"][:19],
        )
    console.print(table)


@users_app.command("token")
def users_token(
    user_id: Annotated[int, typer.Argument()],
    label: Annotated[str, typer.Option(help="What the token is for")] = "",
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Make another API token for a user and print it."""
    with _api(url) as client:
        made = client.create_token(user_id, label)
    console.print(f"token [bold]{made['token']['id']}[/] for user {user_id}")
    _print_secret(made["secret"])


@users_app.command("tokens")
def users_tokens(user_id: Annotated[int, typer.Argument()], url: UrlOption = DEFAULT_URL) -> None:
    """List a user's tokens (never their text)."""
    with _api(url) as client:
        rows = client.tokens(user_id)
    table = Table("id", "label", "created", "revoked")
    for row in rows:
        table.add_row(
            str(row["id"]), row["label"], row["created_at"][:19], (row["revoked_at"] or "")[:19]
        )
    console.print(table)


@users_app.command("revoke")
def users_revoke(token_id: Annotated[int, typer.Argument()], url: UrlOption = DEFAULT_URL) -> None:
    """Revoke an API token: it stops working at once."""
    with _api(url) as client:
        client.revoke_token(token_id)
    console.print(f"token {token_id} revoked")


@app.command()
def whoami(url: UrlOption = DEFAULT_URL) -> None:
    """Show the user RELAUNCH_TOKEN belongs to."""
    with _api(url) as client:
        user = client.me()
    console.print(f"{user['name']} ({user['role']}), user {user['id']}")


@app.command()
def demo(
    port: Annotated[int, typer.Option(help="Controller port")] = 8080,
    keep_running: Annotated[
        bool | None,
        typer.Option(help="Keep the controller up at the end (default: when on a terminal)"),
    ] = None,
) -> None:
    """Start a controller and two node agents, train a job, kill a worker, watch it recover."""
    from service.demo import run_demo

    raise typer.Exit(code=run_demo(console, port=port, keep_running=keep_running))


if __name__ == "__main__":
    app()
