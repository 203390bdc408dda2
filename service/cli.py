"""The ``relaunch`` command: controller, and a client of the REST API.

The node agent's command plugs in (``contract.cli``): ``relaunch agent``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from contract.cli import (
    COMMANDS_GROUP,
    HEALTH_CHECKS_GROUP,
    LogLevelOption,
    fail,
    load_settings,
    setup_logging,
)
from contract.labels import log_label
from contract.protocol import DEFAULT_CONTROLLER_URL
from contract.tasks import TASKS
from service.client import ApiError, RelaunchClient
from service.demo import run_demo
from service.timeline import print_timeline

logger = logging.getLogger(__name__)

app = typer.Typer(
    help="relaunch: fault-tolerant, elastic training service for PyTorch",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()

UrlOption = Annotated[
    str,
    typer.Option(
        "--url",
        envvar="RELAUNCH_URL",
        help="Controller URL; HOST:PORT alone means http://HOST:PORT",
    ),
]
DEFAULT_URL = DEFAULT_CONTROLLER_URL
JobIdArgument = Annotated[int, typer.Argument(help="The job's id (`relaunch jobs` lists them)")]
TOKEN_ENV = "RELAUNCH_TOKEN"
API_TIMEOUT_S = 10.0  # for each request of a command
STATE_COLOURS = {
    "PENDING": "yellow",
    "WAITING": "yellow",
    "RUNNING": "green",
    "RESTARTING": "magenta",
    "SUCCEEDED": "bold green",
    "FAILED": "bold red",
    "CANCELLED": "dim",
}


def with_scheme(url: str) -> str:
    """``url``, with ``http://`` in front when it names no scheme (``HOST:PORT``)."""
    url = url.strip()
    return url if "://" in url else f"http://{url}"


def _unreachable(url: str, exc: Exception, timeout_s: float) -> str:
    """One line on why the controller at ``url`` gave no answer, and what to check."""
    where = "set RELAUNCH_URL or --url"
    if isinstance(exc, httpx.TimeoutException):
        return (
            f"the controller at {url} did not answer within {timeout_s:g} s; is it up, and "
            f"is the port open from here? {where}"
        )
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return f"{url!r} is not a usable controller URL ({exc}); {where} to http://HOST:PORT"
    reason = re.sub(r"^\[Errno -?\d+\] ", "", str(exc)) or type(exc).__name__
    return (
        f"cannot reach the controller at {url}: {reason[:1].lower()}{reason[1:]}; "
        f"is `relaunch server` running there? {where}"
    )


@contextmanager
def _api(url: str, refused: str = "") -> Iterator[RelaunchClient]:
    """A client acting as the user whose token is in RELAUNCH_TOKEN.

    The token is read from the environment only: a command-line option would
    show it in `ps`. An error answer ends the command with its message (after
    ``refused``); no answer (refused, timed out, a bad URL) with one line that
    names the URL and what to check.
    """
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise fail(
            f"set {TOKEN_ENV} to your API token (an admin makes one with "
            "`relaunch users add` or `relaunch users token`)"
        )
    url = with_scheme(url)
    try:
        with RelaunchClient(url, token, timeout_s=API_TIMEOUT_S) as client:
            yield client
    except ApiError as exc:
        raise fail(f"{refused}{exc}") from exc
    except (httpx.TransportError, httpx.InvalidURL) as exc:
        raise fail(_unreachable(url, exc, API_TIMEOUT_S)) from exc


@app.command()
def server(
    host: Annotated[
        str | None, typer.Option(help="Listen address (default: RELAUNCH_HOST, or 127.0.0.1)")
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="Listen port (default: RELAUNCH_PORT, or 8080)")
    ] = None,
    log_level: LogLevelOption = "info",
) -> None:
    """Run the controller: REST API, reconciler and rendezvous store.

    Configured by RELAUNCH_* environment variables (see the README); DATABASE_URL
    selects PostgreSQL instead of the embedded SQLite file.
    """
    import uvicorn

    from service.api.app import create_app
    from service.settings import ControllerSettings

    setup_logging(log_level)
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    settings = load_settings(ControllerSettings, "controller", **overrides)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level.lower(),
        access_log=False,
    )


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

    role = role or ("agent" if os.environ.get("RELAUNCH_AGENT_CONTROLLER_URL") else "controller")
    checks = {entry.name: entry for entry in entry_points(group=HEALTH_CHECKS_GROUP)}
    if role in checks:
        checks[role].load()(max_age_s)
        return
    if role != "controller":
        raise fail(f"--role must be {' or '.join(['controller', *checks])}, got {role!r}")
    settings = load_settings(ControllerSettings, "controller")
    url = f"http://{connect_host(settings.host)}:{settings.port}/healthz"
    try:
        reply = httpx.get(url, timeout=5.0)
    except httpx.HTTPError as exc:
        raise fail(f"the controller does not answer: {exc}") from exc
    if reply.status_code != 200:
        raise fail(f"the controller answers {reply.status_code}: {reply.text[:200]}")
    console.print(reply.json())


def _load_spec_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise fail(f"cannot read {path}: {exc}") from exc
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise fail(f"{path} is not valid {kind}: {exc}") from exc
    if not isinstance(data, dict):
        raise fail(f"{path} must hold a mapping (the job spec)")
    return data


def _parse_params(pairs: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise fail(f"--param takes KEY=VALUE, got {pair!r}")
        try:
            params[key] = json.loads(raw)
        except ValueError:
            params[key] = raw
    return params


def missing_from_spec(spec: dict[str, Any]) -> str:
    """What a job spec lacks that only its author can give, in the CLI's terms ('' if
    nothing); the controller checks the rest."""
    missing = []
    if not spec.get("name"):
        missing.append("--name NAME")
    if not spec.get("task") and not spec.get("script"):
        missing.append("either --task TASK or --script PATH (or --module MODULE)")
    if not missing:
        return ""
    return f"give {' and '.join(missing)}, as flags or in a spec file"


@app.command()
def submit(
    spec_file: Annotated[
        Path | None, typer.Argument(help="A job spec as YAML or JSON (flags override it)")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Job name: letters, digits, '.', '_', '-' (required)")
    ] = None,
    task: Annotated[str | None, typer.Option(help=f"A built-in task: {', '.join(TASKS)}")] = None,
    param: Annotated[list[str] | None, typer.Option(help="Task parameter KEY=VALUE")] = None,
    script: Annotated[str | None, typer.Option(help="Absolute path of a torchrun script")] = None,
    module: Annotated[str | None, typer.Option(help="A module to run as python -m")] = None,
    arg: Annotated[list[str] | None, typer.Option(help="Argument of the script/module")] = None,
    nnodes: Annotated[str | None, typer.Option(help="Nodes: 'N' or 'MIN:MAX' (default: 1)")] = None,
    nproc_per_node: Annotated[
        int | None, typer.Option(help="Worker processes on each node (default: 1)")
    ] = None,
    max_restarts: Annotated[
        int | None,
        typer.Option(
            help="Worker failures the job may restart from (default: 3); "
            "nodes leaving or joining do not count"
        ),
    ] = None,
    snapshot_every_steps: Annotated[
        int | None,
        typer.Option(help="Save a snapshot every N training steps (default: after each epoch)"),
    ] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option(help="Send the same key again to get the same job, not a second one"),
    ] = None,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Submit a job; prints its id.

    A job needs a name and what to run: a built-in --task, or your own --script or
    --module. Give them as flags, or in a spec file whose values flags override.
    """
    spec: dict[str, Any] = _load_spec_file(spec_file) if spec_file else {}
    if name:
        spec["name"] = name
    if task:
        spec["task"] = {"name": task, "params": _parse_params(param or [])}
    elif param:
        if not isinstance(spec.get("task"), dict):
            raise fail("--param sets a task's parameter: give --task TASK too")
        spec["task"].setdefault("params", {}).update(_parse_params(param))
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
    missing = missing_from_spec(spec)
    if missing:
        raise fail(f"{missing}; see `relaunch submit --help`")
    with _api(url, refused="the controller refused the job: ") as client:
        job = client.submit(spec, idempotency_key)
    console.print(f"submitted job [bold]{job['id']}[/] ({job['name']}), state {job['state']}")


def _state_text(state: str) -> str:
    return f"[{STATE_COLOURS.get(state, 'white')}]{state}[/]"


def step_time_text(job: dict[str, Any]) -> str:
    """``0.125 s/step``, or ``-`` while the job has no step time (or the controller is older)."""
    step_time = job.get("step_time_s")
    return f"{step_time:.3g} s/step" if step_time is not None else "-"


@app.command()
def jobs(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state")] = None,
    limit: Annotated[int, typer.Option(help="Show at most this many jobs")] = 50,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """List jobs, newest first."""
    with _api(url) as client:
        page = client.jobs(state=state, limit=limit)
    table = Table("id", "name", "state", "nodes", "world", "step", "loss", "step time", "restarts")
    for job in page["items"]:
        table.add_row(
            str(job["id"]),
            job["name"],
            _state_text(job["state"]),
            f"{job['min_nodes']}:{job['max_nodes']}",
            str(job["world_size"] or "-"),
            f"{job['last_step'] or 0}/{job['total_steps'] or '?'}",
            f"{job['last_loss']:.4f}" if job["last_loss"] is not None else "-",
            step_time_text(job),
            str(job["restart_count"]),
        )
    console.print(table)
    console.print(f"{len(page['items'])} of {page['total']} job(s)")


@app.command()
def status(
    job_id: JobIdArgument,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Show one job: state, progress, attempts and timeline."""
    with _api(url) as client:
        job = client.job(job_id)
        events = client.events(job_id)
    console.print(
        f"job [bold]{job['id']}[/] {job['name']}: {_state_text(job['state'])}  "
        f"step {job['last_step'] or 0}/{job['total_steps'] or '?'} ({step_time_text(job)})  "
        f"world size {job['world_size'] or '-'}  restarts {job['restart_count']}"
        f"/{job['spec']['max_restarts']}  membership changes {job['membership_changes']}"
    )
    if job["message"]:
        console.print(f"message: {escape(job['message'])}")
    for attempt in job["attempts"]:
        nodes = ", ".join(f"{m['node_name']}({m['state'].lower()})" for m in attempt["members"])
        console.print(f"  attempt {attempt['number']} {attempt['state']}: {nodes}")
    print_timeline(console, events)


def log_line_label(line: dict[str, Any]) -> str:
    """``attempt 1 node node-a rank 3``, as the workers label their own lines; a line
    with no global rank (stored before ranks were recorded) names its local rank, and
    one with neither is the launcher's."""
    label = log_label(
        attempt=line.get("attempt_number"),
        node=line.get("node_name") or f"#{line['node_id']}",
        rank=line.get("global_rank"),
        local_rank=line["local_rank"] if line.get("global_rank") is None else None,
    )
    if line.get("global_rank") is None and line["local_rank"] is None:
        label += " launcher"
    return label


@app.command()
def logs(
    job_id: JobIdArgument,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines until the job ends")
    ] = False,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Print a job's log lines, each labelled with its attempt, node and global rank;
    --follow keeps polling."""
    after = 0
    with _api(url) as client:
        while True:
            lines = client.logs(job_id, after_id=after)
            for line in lines:
                typer.echo(f"[{log_line_label(line)}] {line['line']}")
                after = line["id"]
            if not follow:
                return
            if not lines:
                if client.job(job_id)["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    return
                time.sleep(1.0)


@app.command()
def cancel(
    job_id: JobIdArgument,
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
    name: Annotated[str, typer.Argument(help="The new user's name")],
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
    user_id: Annotated[int, typer.Argument(help="The user's id (`relaunch users list`)")],
    label: Annotated[str, typer.Option(help="What the token is for")] = "",
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Make another API token for a user and print it."""
    with _api(url) as client:
        made = client.create_token(user_id, label)
    console.print(f"token [bold]{made['token']['id']}[/] for user {user_id}")
    _print_secret(made["secret"])


@users_app.command("tokens")
def users_tokens(
    user_id: Annotated[int, typer.Argument(help="The user's id (`relaunch users list`)")],
    url: UrlOption = DEFAULT_URL,
) -> None:
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
def users_revoke(
    token_id: Annotated[
        int, typer.Argument(help="The token's id (`relaunch users tokens USER_ID`)")
    ],
    url: UrlOption = DEFAULT_URL,
) -> None:
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
        typer.Option(
            help="Keep the controller and node agents up at the end, with the API and the "
            "dashboard, until Ctrl-C (default: when the output is a terminal)",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Start a controller and two node agents, train a job, kill a worker, watch it recover.

    Without --keep-running, the controller and agents stop when the demo ends.
    """
    raise typer.Exit(code=run_demo(console, port=port, keep_running=keep_running))


def _add_plugged_in_commands() -> None:
    """Add the commands that other packages plug in (see ``contract.cli``); one that does
    not load is left out with a warning, and the others still work."""
    for entry in entry_points(group=COMMANDS_GROUP):
        try:
            command = entry.load()
        except Exception as exc:
            logger.warning(
                "relaunch %s is left out: %s does not load: %s", entry.name, entry.value, exc
            )
            continue
        app.command(entry.name)(command)


_add_plugged_in_commands()

if __name__ == "__main__":
    app()
