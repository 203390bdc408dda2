"""The ``relaunch`` command: controller, and a client of the REST API.

The node agent's command plugs in (``contract.cli``): ``relaunch agent``.
"""

from __future__ import annotations

import contextlib
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

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

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
from service.admin_cli import admin_app
from service.client import (
    TERMINAL_STATES,
    TOKEN_ENV,
    URL_ENV,
    ApiError,
    ControllerUnreachable,
    RelaunchClient,
    SpecFileError,
    load_spec,
)
from service.demo import run_demo
from service.timeline import timeline_table

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
        envvar=URL_ENV,
        help="Controller URL; HOST:PORT alone means http://HOST:PORT",
    ),
]
DEFAULT_URL = DEFAULT_CONTROLLER_URL
JobIdArgument = Annotated[int, typer.Argument(help="The job's id (`relaunch jobs` lists them)")]
API_TIMEOUT_S = 10.0  # for each request of a command
WATCH_LAST_EVENTS = 20  # the timeline rows `status --watch` keeps on a terminal
STATE_COLOURS = {
    "PENDING": "yellow",
    "WAITING": "yellow",
    "RUNNING": "green",
    "RESTARTING": "magenta",
    "SUCCEEDED": "bold green",
    "FAILED": "bold red",
    "CANCELLED": "dim",
}


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
    try:
        with RelaunchClient(url, token, timeout_s=API_TIMEOUT_S) as client:
            yield client
    except ApiError as exc:
        raise fail(f"{refused}{exc}") from exc
    except ControllerUnreachable as exc:
        raise fail(exc.describe(f"set {URL_ENV} or --url")) from exc


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
    """Run the controller: REST API (with every job's rendezvous) and reconciler.

    Configured by RELAUNCH_* environment variables (see the README); DATABASE_URL
    selects PostgreSQL instead of the embedded SQLite file.
    """
    import uvicorn

    from service.api.app import create_app
    from service.api_processes import bind_listener
    from service.db import in_memory
    from service.secrets import SecretsKeyError, load_keyring
    from service.settings import ControllerSettings

    setup_logging(log_level)
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    settings = load_settings(ControllerSettings, "controller", **overrides)
    try:
        keyring = load_keyring(settings)  # checked against the database at start
    except SecretsKeyError as exc:
        raise fail(str(exc)) from exc
    if settings.api_processes == 1:
        uvicorn.run(
            create_app(settings, keyring=keyring),
            host=settings.host,
            port=settings.port,
            log_level=log_level.lower(),
            access_log=False,
            timeout_keep_alive=settings.keep_alive_s,
        )
        return
    # Several processes answer the API (RELAUNCH_API_PROCESSES): this socket is this one's,
    # and each helper the app's lifespan starts gets its own on the same port.
    if in_memory(settings.db_url):
        raise fail(
            "RELAUNCH_API_PROCESSES above 1 needs a database file or PostgreSQL: an "
            "in-memory database would be a different one in each process"
        )
    try:
        listener = bind_listener(settings.host, settings.port)
    except OSError as exc:
        raise fail(f"cannot listen on {settings.host!r} port {settings.port}: {exc}") from exc
    config = uvicorn.Config(
        create_app(settings, keyring=keyring, listener=listener),
        log_level=log_level.lower(),
        access_log=False,
        timeout_keep_alive=settings.keep_alive_s,
    )
    address, port = listener.getsockname()[:2]
    logger.info("answering on %s port %s with %s processes", address, port, settings.api_processes)
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run takes a Ctrl-C
        uvicorn.Server(config).run(sockets=[listener])


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

    role = role or ("agent" if os.environ.get("RELAUNCH_AGENT_CONTROLLER_URL") else "controller")
    checks = {entry.name: entry for entry in entry_points(group=HEALTH_CHECKS_GROUP)}
    if role in checks:
        checks[role].load()(max_age_s)
        return
    if role != "controller":
        raise fail(f"--role must be {' or '.join(['controller', *checks])}, got {role!r}")
    settings = load_settings(ControllerSettings, "controller")
    host = "127.0.0.1" if settings.host in ("", "0.0.0.0", "::") else settings.host
    url = f"http://{host}:{settings.port}/healthz"
    try:
        reply = httpx.get(url, timeout=5.0)
    except httpx.HTTPError as exc:
        raise fail(f"the controller does not answer: {exc}") from exc
    if reply.status_code != 200:
        raise fail(f"the controller answers {reply.status_code}: {reply.text[:200]}")
    console.print(reply.json())


def _load_spec_file(path: Path) -> dict[str, Any]:
    try:
        return load_spec(path)
    except SpecFileError as exc:
        raise fail(str(exc)) from exc


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
    working_dir: Annotated[
        str | None,
        typer.Option(
            help="Absolute path of a directory on every node to run the workers in "
            "(default: the job's snapshot directory, shared by the nodes)"
        ),
    ] = None,
    nnodes: Annotated[str | None, typer.Option(help="Nodes: 'N' or 'MIN:MAX' (default: 1)")] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(help="Worker processes on each node, on cuda one per GPU (default: 1)"),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help="auto, cpu or cuda (default: auto: cuda if any alive node has GPUs when "
            "the job is placed)"
        ),
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
        ("device", device),
        ("max_restarts", max_restarts),
        ("working_dir", working_dir),
    ):
        if value is not None:
            spec[key] = value
    if snapshot_every_steps is not None:
        spec.setdefault("snapshot", {})["every_steps"] = snapshot_every_steps
    missing = missing_from_spec(spec)
    if missing:
        raise fail(f"{missing}; see `relaunch submit --help`")
    with _api(url, refused="the controller refused the job: ") as client:
        job = client.submit(spec, idempotency_key=idempotency_key)
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
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            "-w",
            help="Refresh until the job ends; exit 0 if it SUCCEEDED, 1 if it did not",
        ),
    ] = False,
    interval: Annotated[
        float, typer.Option(min=0.1, help="Seconds between refreshes of --watch")
    ] = 2.0,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Show one job: state, progress, attempts and timeline.

    --watch refreshes it every --interval seconds until the job ends, then exits 0 if
    the job SUCCEEDED and 1 if it FAILED or was CANCELLED (130 on Ctrl-C). On a
    terminal the view is redrawn in place; otherwise only what changed is printed: the
    status lines when they change, and each new timeline event as one line.
    """
    with _api(url) as client:
        if not watch:
            console.print(_status_view(client.job(job_id), client.events(job_id)))
            return
        try:
            job = _watch_status(client, job_id, interval)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
    raise typer.Exit(0 if job["state"] == "SUCCEEDED" else 1)


def _member_text(member: dict[str, Any]) -> str:
    """``active`` or, for a member holding GPUs, ``active, GPUs 0,1``."""
    gpus = member.get("gpus") or []
    if not gpus:
        return str(member["state"].lower())
    return (
        f"{member['state'].lower()}, GPU{'s' if len(gpus) > 1 else ''} {','.join(map(str, gpus))}"
    )


def _status_lines(job: dict[str, Any]) -> list[str]:
    """The lines above the timeline, as markup: state and progress, message, attempts."""
    lines = [
        f"job [bold]{job['id']}[/] {escape(job['name'])}: {_state_text(job['state'])}  "
        f"step {job['last_step'] or 0}/{job['total_steps'] or '?'} ({step_time_text(job)})  "
        f"world size {job['world_size'] or '-'}  restarts {job['restart_count']}"
        f"/{job['spec']['max_restarts']}  membership changes {job['membership_changes']}"
    ]
    if job["message"]:
        lines.append(f"message: {escape(job['message'])}")
    for attempt in job["attempts"]:
        nodes = ", ".join(f"{m['node_name']}({_member_text(m)})" for m in attempt["members"])
        on = " on cuda" if attempt.get("device") == "cuda" else ""
        lines.append(f"  attempt {attempt['number']} {attempt['state']}{on}: {escape(nodes)}")
    return lines


def _status_view(
    job: dict[str, Any], events: list[dict[str, Any]], last_events: int | None = None
) -> Group:
    """What `relaunch status` shows; ``last_events`` keeps only the newest of the timeline."""
    title = "timeline"
    if last_events is not None and len(events) > last_events:
        title = f"timeline (the last {last_events} of {len(events)} events)"
        events = events[-last_events:]
    return Group(
        *(Text.from_markup(line) for line in _status_lines(job)), timeline_table(events, title)
    )


def _job_updates(
    client: RelaunchClient, job_id: int, interval: float
) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """The job and its timeline events not yet yielded, now and every ``interval`` seconds,
    until the job has ended (the last pair shows it ended, with every event up to then)."""
    after = 0
    while True:
        job = client.job(job_id)  # first: the events read next include those of its state
        new: list[dict[str, Any]] = []
        while page := client.events(job_id, after_id=after):
            new += page
            after = page[-1]["id"]
        yield job, new
        if job["state"] in TERMINAL_STATES:
            return
        time.sleep(interval)


def _watch_status(client: RelaunchClient, job_id: int, interval: float) -> dict[str, Any]:
    """Show the job until it ends; returns it as it ended."""
    events: list[dict[str, Any]] = []
    updates = _job_updates(client, job_id, interval)
    if console.is_terminal:
        with Live(console=console, auto_refresh=False) as live:
            for job, new in updates:
                events += new
                live.update(_status_view(job, events, WATCH_LAST_EVENTS), refresh=True)
        return job
    shown: list[str] = []
    for job, new in updates:
        if not shown:
            console.print(_status_view(job, new))
        else:
            if _status_lines(job) != shown:
                for line in _status_lines(job):
                    console.print(line)
            for event in new:
                console.print(
                    f"{event['time'][11:23]}  {event['kind']}  {escape(event['message'])}"
                )
        shown = _status_lines(job)
        events += new
    return job


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
    with _api(url) as client:
        lines = client.follow_logs(job_id) if follow else iter(client.logs(job_id))
        for line in lines:
            typer.echo(f"[{log_line_label(line)}] {line['line']}")


@app.command()
def cancel(
    job_id: JobIdArgument,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Cancel a job (cancelling an ended job changes nothing)."""
    with _api(url) as client:
        job = client.cancel(job_id)
    console.print(f"job {job['id']}: {_state_text(job['state'])}")


app.add_typer(admin_app, name="admin")
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


nodes_app = typer.Typer(help="Nodes and what admits them", no_args_is_help=True)
app.add_typer(nodes_app, name="nodes")
node_tokens_app = typer.Typer(
    help="Per-node enrolment tokens (admin only): the production way to admit nodes",
    no_args_is_help=True,
)
nodes_app.add_typer(node_tokens_app, name="token")

_DURATION = re.compile(r"^(\d+)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """Seconds in ``30m``, ``1h``, ``7d`` (one number, one unit: s, m, h or d)."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise fail(f"--expires-in: {text!r} is not a duration like 30m, 1h or 7d")
    return int(match.group(1)) * _SECONDS[match.group(2)]


@node_tokens_app.command("create")
def node_token_create(
    name: Annotated[
        str | None, typer.Option(help="Admit only the node of this name (default: any name)")
    ] = None,
    expires_in: Annotated[
        str, typer.Option(help="Lifetime, e.g. 30m, 1h or 7d (at most 366d)")
    ] = "24h",
    reusable: Annotated[
        bool,
        typer.Option(
            "--reusable", help="Admit any number of registrations until it expires (default: one)"
        ),
    ] = False,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Make an enrolment token for a node's agent (RELAUNCH_AGENT_ENROLMENT_TOKEN) and print it."""
    seconds = parse_duration(expires_in)
    with _api(url) as client:
        made = client.create_enrolment_token(name, seconds, single_use=not reusable)
    row = made["token"]
    console.print(
        f"enrolment token [bold]{row['id']}[/] for {escape(name or 'any node name')}, "
        f"{'reusable' if reusable else 'single-use'}, expires {row['expires_at'][:19]} UTC"
    )
    console.print("enrolment token (shown this once; only its hash is kept):")
    typer.echo(made["secret"])


@node_tokens_app.command("list")
def node_token_list(url: UrlOption = DEFAULT_URL) -> None:
    """List enrolment tokens (never their text)."""
    with _api(url) as client:
        rows = client.enrolment_tokens()
    table = Table("id", "node", "use", "expires", "used", "revoked", "created")
    for row in rows:
        table.add_row(
            str(row["id"]),
            escape(row["node_name"] or "any"),
            "single" if row["single_use"] else "reusable",
            row["expires_at"][:19],
            (row["used_at"] or "")[:19],
            (row["revoked_at"] or "")[:19],
            row["created_at"][:19],
        )
    console.print(table)


@node_tokens_app.command("revoke")
def node_token_revoke(
    token_id: Annotated[
        int, typer.Argument(help="The enrolment token's id (`relaunch nodes token list`)")
    ],
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Revoke an enrolment token: it admits no registration from now on (nodes it
    admitted keep running)."""
    with _api(url) as client:
        client.revoke_enrolment_token(token_id)
    console.print(f"enrolment token {token_id} revoked")


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
