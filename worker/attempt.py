"""One attempt running on this node: the launcher's process tree, output and events.

An ``Attempt`` is built from an ``Assignment`` (the spec), starts
``python -m worker.launch ... -- <torchrun args>`` and ends with an
``AttemptExit`` (the result): succeeded / failed when the launcher exits by
itself, stopped when the agent ends it. Output and events wait in buffers until
a report carrying them is accepted, so a briefly unreachable controller loses
nothing (log lines are capped in memory; events stay in their file). The launcher
and its workers run in the job's working directory (``working_dir_for``); a job's
``working_dir`` missing on this node fails the attempt as fatal before any start.

Worker output reaches us through torchrun's ``--tee 3``: torch redirects each
worker's stdout/stderr into files under ``--log-dir`` and tails them onto the
launcher's own stdout/stderr with a prefix per worker
(``torch/distributed/elastic/multiprocessing/tail_log.py``, ``TailLog.start``).
The agent sets that prefix to ``[<role><local_rank> rank<global_rank>]:``
(``LOG_LINE_PREFIX_TEMPLATE``): torch fills it in at every start of the workers,
after the rendezvous that gave them their global ranks. Lines without a prefix
come from the launcher itself (local_rank None).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Literal, NamedTuple

import psutil

from contract.events import LauncherExited, RendezvousComplete
from contract.labels import log_label
from contract.paths import inside, is_url
from contract.protocol import (
    ATTEMPT_ID_ENV,
    ATTEMPT_NUMBER_ENV,
    COLLECTIVE_TIMEOUT_ENV,
    CONTROLLER_URL_ENV,
    EVENTS_FILE_ENV,
    JOB_ID_ENV,
    NODE_NAME_ENV,
    PROGRESS_DIR_ENV,
    RENDEZVOUS_CLOSED_EXIT,
    SNAPSHOT_ASYNC_ENV,
    SNAPSHOT_DIR_ENV,
    SNAPSHOT_EVERY_EPOCHS_ENV,
    SNAPSHOT_EVERY_STEPS_ENV,
    SNAPSHOT_KEEP_ENV,
    WORKER_TOKEN_ENV,
    Assignment,
    AttemptExit,
    AttemptReport,
    LogLine,
    RunningAttempt,
)
from worker import procs, sandbox
from worker.gpus import (
    AGENT_DEVICE_VARIABLES,
    OMP_NUM_THREADS_ENV,
    device_refusal,
    device_variables,
    threads_per_worker,
)
from worker.outbox import EventBatch, EventsTail, LogBatch, LogOutbox
from worker.settings import AgentSettings
from worker.spare import HANDOFF_FILE, SPARE_ENV, Handoff, SpareLauncher

logger = logging.getLogger(__name__)

TORCHRUN_ROLE = "default"  # torchrun's --role default; it names the tee prefix
MONITOR_INTERVAL_S = 0.2
# How long the workers of an attempt that lost a member get to end on SIGTERM before
# SIGKILL: a worker inside a gloo or NCCL call that waits on the lost peer never returns.
RE_FORM_GRACE_S = 1.0
# In the attempt's directory (root's, so no worker can write it): the agent ended the
# workers because the attempt lost a member; the launcher reads it (``--membership-file``).
MEMBERSHIP_FILE = "membership-changed"
MAX_LINE_CHARS = 8192  # protocol.LogLine.line
# torch substitutes ${role_name}, ${local_rank} and ${rank} (the global rank) per worker.
LOG_LINE_PREFIX_TEMPLATE = "[${role_name}${local_rank} rank${rank}]:"
# torch's default prefix, ``[default0]:``, carries the local rank only.
_PREFIX = re.compile(rf"^\[{TORCHRUN_ROLE}(\d+)(?: rank(\d+))?\]:")
# Variables torchrun would read as defaults for its own options, or to change the prefix.
_TORCHRUN_ENV_PREFIX = "PET_"
_PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
# The agent's and the controller's own settings, credentials among them: a job's
# code runs as the job's user and must not read the node's enrolment token.
_NOT_FOR_WORKERS = re.compile(
    r"^(RELAUNCH_AGENT_.*|RELAUNCH_ENROLMENT_TOKEN|RELAUNCH_TOKEN|DATABASE_URL|"
    r"RELAUNCH_DATABASE_URL|RELAUNCH_SECRETS_KEYS|RELAUNCH_SECRETS_KEY_FILE)$"
)
# -I: no PYTHON* variables, no working directory on sys.path.
LAUNCHER_PREFIX = (sys.executable, "-I", "-u", "-m", "worker.launch")
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
NCCL_ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NODE_WORKING_DIR = "work"  # in the attempt's directory, when the job has no shared one
# Agent-internal (not part of the protocol): which agent started a process.
AGENT_DIR_ENV = "RELAUNCH_NODE_AGENT_DIR"


def attempt_marker(settings: AgentSettings, attempt_id: int) -> dict[str, str]:
    """The environment that singles out one attempt's processes of this agent on this machine.

    Attempt id and node name alone are not enough: agents of two clusters
    (two controllers, e.g. test runs) can share a node name on one machine,
    and their attempt ids start at 1 alike. The work dir is one agent's own.
    """
    return {
        ATTEMPT_ID_ENV: str(attempt_id),
        NODE_NAME_ENV: settings.name,
        AGENT_DIR_ENV: str(settings.work_dir.resolve()),
    }


class ConsoleLine(NamedTuple):
    """A line of the launcher's console: ranks None for the launcher's own lines."""

    local_rank: int | None
    global_rank: int | None
    text: str


def parse_console_line(text: str) -> ConsoleLine:
    """Split a launcher console line into its worker's ranks and the worker's text."""
    match = _PREFIX.match(text)
    if match is None:
        return ConsoleLine(None, None, text)
    global_rank = None if match.group(2) is None else int(match.group(2))
    return ConsoleLine(int(match.group(1)), global_rank, text[match.end() :])


def build_torchrun_args(
    assignment: Assignment, *, local_addr: str, log_dir: Path, controller_url: str
) -> list[str]:
    """The torchrun command line (without the program name) for one attempt on this node.

    The rendezvous is the controller's (``worker.rendezvous``, registered by the
    launcher as the backend ``relaunch``)."""
    entry = assignment.entrypoint
    if (entry.module is None) == (entry.script is None):
        raise ValueError("entrypoint needs exactly one of module and script")
    rdzv = assignment.rendezvous
    rdzv_conf = ",".join(
        [
            f"last_call_timeout={rdzv.last_call_timeout_s}",
            f"join_timeout={rdzv.join_timeout_s}",
            f"keep_alive_interval={rdzv.keep_alive_interval_s}",
            f"keep_alive_max_attempt={rdzv.keep_alive_max_attempt}",
        ]
    )
    args = [
        "--nnodes", f"{assignment.min_nodes}:{assignment.max_nodes}",
        "--nproc-per-node", str(assignment.nproc_per_node),
        "--rdzv-backend", "relaunch",
        "--rdzv-endpoint", controller_url,
        "--rdzv-id", rdzv.rdzv_id,
        "--rdzv-conf", rdzv_conf,
        "--max-restarts", str(assignment.restart.max_restarts),
        "--monitor-interval", str(MONITOR_INTERVAL_S),
        "--local-addr", local_addr,
        "--tee", "3",
        "--log-dir", str(log_dir),
    ]  # fmt: skip
    # Every worker starts in worker.bootstrap, which runs the program unchanged.
    args += ["-m", "worker.bootstrap"]
    if entry.module is not None:
        args += ["-m", entry.module]
    else:
        args.append(str(entry.script))
    return args + list(entry.args)


def working_dir_for(assignment: Assignment, attempt_dir: Path) -> Path:
    """Where the launcher and its workers run, so where a script's relative paths lead.

    The job's own ``working_dir`` if it names one. Otherwise the job's snapshot
    directory when that is a path: every node mounts the snapshot root at the
    same place, so a relative path names one file for the whole job, and a
    restart on other nodes finds it. A snapshot URL (``s3://...``) offers no
    shared directory; the workers then run in a directory of this attempt on this node.
    """
    if assignment.working_dir is not None:
        return Path(assignment.working_dir)
    if not is_url(assignment.snapshot_dir):
        return Path(assignment.snapshot_dir).absolute()
    return attempt_dir.absolute() / NODE_WORKING_DIR


def missing_working_dir(assignment: Assignment, node: str) -> str | None:
    """Why the job's ``working_dir`` cannot be used on ``node``; None if it can or if the
    job names none (the default directories are made by the agent)."""
    if assignment.working_dir is None:
        return None
    path = assignment.working_dir
    if os.path.isdir(path):  # os.path says False, not raises, where the agent may not look
        return None
    if os.path.exists(path):
        return f"working_dir {path} is not a directory on node {node}"
    return f"working_dir {path} does not exist on node {node}"


def spare_marker(settings: AgentSettings) -> dict[str, str]:
    """The environment that singles out this agent's spare launchers (``worker.spare``)."""
    return {SPARE_ENV: "1", AGENT_DIR_ENV: str(settings.work_dir.resolve())}


def _for_launchers(base_env: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment less what no launcher gets: its settings and credentials,
    and torchrun's defaults."""
    return {
        k: v
        for k, v in base_env.items()
        if not k.startswith(_TORCHRUN_ENV_PREFIX)
        and k != _PREFIX_TEMPLATE_ENV
        and not _NOT_FOR_WORKERS.match(k)
    }


def node_launcher_env(settings: AgentSettings) -> dict[str, str]:
    """What the agent sets alike in every launcher's environment on this node, whatever
    the attempt; it wins over the job's own."""
    return {
        _PREFIX_TEMPLATE_ENV: LOG_LINE_PREFIX_TEMPLATE,
        CONTROLLER_URL_ENV: settings.controller_url,
        # Workers get their own MASTER_ADDR store instead of the rendezvous
        # store of the rank-0 agent: avoids restart storms (ELASTIC-FACTS.md).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # Read by torch.distributed.launcher.api.LaunchConfig when no
        # --shutdown-timeout is given: SIGTERM -> SIGKILL wait for workers.
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(settings.worker_shutdown_timeout_s),
        "PYTHONUNBUFFERED": "1",
    }


def spare_env(settings: AgentSettings, base_env: Mapping[str, str]) -> dict[str, str]:
    """A spare launcher's environment, which its spare zygote loads with: the agent's,
    less what no launcher gets (its settings and credentials, torchrun's defaults), with
    what every launcher here gets (``node_launcher_env``), the thread count of a CPU
    attempt of one process per node (a job's zygote whose differs cannot be this spare:
    ``worker.warm.spare_refusal``) and ``spare_marker``. Nothing of any job's: a spare is
    started before any assignment."""
    env = _for_launchers(base_env)
    env.update(node_launcher_env(settings))
    threads = threads_per_worker(
        cpus=settings.cpus, nproc_per_node=1, device="cpu", attempt_gpus=0, node_gpus=0
    )
    env.setdefault(OMP_NUM_THREADS_ENV, str(threads))  # unless the agent's environment sets it
    env.update(spare_marker(settings))
    return env


def build_launcher_env(
    assignment: Assignment,
    *,
    settings: AgentSettings,
    events_file: Path,
    base_env: Mapping[str, str],
    progress_dir: Path | None = None,
    node_gpus: int = 0,
) -> dict[str, str]:
    """The launcher's environment; its workers inherit it. Ours wins over ``assignment.env``.

    The agent's own settings and credentials are left out: the workers get the
    controller's URL and the attempt's worker token (good for their job's snapshot
    fence only), never the node's token. The device variables are the agent's
    (``gpus.device_variables``, for a node of ``node_gpus`` GPUs), except OMP_NUM_THREADS
    where the job's env sets it, or else the agent's own environment (its operator's
    choice for every job)."""
    env = _for_launchers(base_env)
    env.update(assignment.env)
    env.update(attempt_marker(settings, assignment.attempt_id))
    env.update(node_launcher_env(settings))
    env.update(
        {
            JOB_ID_ENV: str(assignment.job_id),
            # Absolute: the workers' current directory is not the agent's.
            SNAPSHOT_DIR_ENV: assignment.snapshot_dir
            if is_url(assignment.snapshot_dir)
            else os.path.abspath(assignment.snapshot_dir),
            EVENTS_FILE_ENV: str(events_file),
        }
    )
    env.pop(WORKER_TOKEN_ENV, None)
    if assignment.worker_token is not None:
        env[WORKER_TOKEN_ENV] = assignment.worker_token
    if assignment.attempt_number is not None:
        env[ATTEMPT_NUMBER_ENV] = str(assignment.attempt_number)
    if progress_dir is not None:
        env[PROGRESS_DIR_ENV] = str(progress_dir)
    if assignment.snapshot_every_steps is not None:
        env[SNAPSHOT_EVERY_STEPS_ENV] = str(assignment.snapshot_every_steps)
    if assignment.snapshot_every_epochs is not None:
        env[SNAPSHOT_EVERY_EPOCHS_ENV] = str(assignment.snapshot_every_epochs)
    env[SNAPSHOT_KEEP_ENV] = str(assignment.snapshot_keep)
    if assignment.collective_timeout_s is not None:
        env[COLLECTIVE_TIMEOUT_ENV] = f"{assignment.collective_timeout_s:g}"
    # NCCL ends a collective that outlives the process group's timeout by tearing the
    # process down (1; torch's C++ default is 3, the same without cleaning up), so a
    # dead peer costs a restart, not a wait forever. The job's env may choose otherwise.
    env.setdefault(NCCL_ASYNC_ERROR_HANDLING_ENV, "1")
    env[SNAPSHOT_ASYNC_ENV] = "1" if assignment.snapshot_async else "0"
    devices = device_variables(assignment, cpus=settings.cpus, node_gpus=node_gpus)
    if OMP_NUM_THREADS_ENV in env:  # the job's own choice, or the agent's environment's
        devices.pop(OMP_NUM_THREADS_ENV)
    env.update(devices)
    if GLOO_IFNAME_ENV not in env:
        # Without it gloo binds to what the hostname resolves to, often 127.0.x.1, and
        # tells its peers on other hosts to connect there. The job's env may override it.
        interface = interface_of(settings.address)
        if interface is not None:
            env[GLOO_IFNAME_ENV] = interface
    return env


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only this user may read (0600 from its creation)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def attempt_label(assignment: Assignment) -> str:
    """``job 3 attempt 2``, by the job's own attempt number; by the controller's id
    (``attempt id 7``) only if the controller did not send the number."""
    if assignment.attempt_number is not None:
        return log_label(job=assignment.job_id, attempt=assignment.attempt_number)
    return f"{log_label(job=assignment.job_id)} attempt id {assignment.attempt_id}"


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address``, if any."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


@dataclass(frozen=True)
class PendingReport:
    report: AttemptReport
    logs: LogBatch
    events: EventBatch


class Attempt:
    """One assignment on this node, from start to its delivered exit report.

    The agent's loop thread calls every method. Inside, two reader threads
    feed the log outbox, and ``stop`` hands the process tree to a stop thread
    (from then on only that thread signals or reaps the launcher). ``start``
    must run on a thread that outlives the attempt: the launcher's
    PR_SET_PDEATHSIG fires when the *thread* that forked it exits.
    """

    def __init__(
        self,
        assignment: Assignment,
        settings: AgentSettings,
        node_token: str | None = None,
        node_gpus: Sequence[int] = (),
    ) -> None:
        self.assignment = assignment
        self.attempt_id = assignment.attempt_id
        self._settings = settings
        self._node_token = node_token
        self._node_gpus = tuple(node_gpus)  # the indices of the GPUs the agent offers
        # Absolute: the launcher runs in the job's working directory, not the agent's.
        self.dir = inside(settings.work_dir, "attempts", str(assignment.attempt_id)).absolute()
        self.events_path = self.dir / "events.jsonl"
        self.progress_dir = self.dir / "progress"
        # The launcher's rendezvous credential: readable by the agent's user only.
        self.node_token_path = self.dir / "node-token"
        self._logs = LogOutbox()
        self._events = EventsTail(self.events_path)
        self._popen: subprocess.Popen[bytes] | None = None
        self._readers: list[threading.Thread] = []
        self._tracked: dict[procs.ProcessId, psutil.Process] = {}
        self._ctx = "[" + attempt_label(assignment) + "]"
        self._stopper: threading.Thread | None = None
        self._fenced = False
        # The attempt's membership generation this node last acted on.
        self._generation = assignment.membership_generation
        # (when first seen, Assignment.memberships) at each change: how many had joined
        # by the time the workers last formed.
        self._memberships_seen: list[tuple[datetime, int]] = []
        self._note_memberships(assignment)
        self.membership_path = self.dir / MEMBERSHIP_FILE
        self.exit: AttemptExit | None = None
        self.exit_delivered = False
        # A spare's marker once one became the launcher: its zygote, and the workers
        # forked from that, keep the spare's environment, without the attempt's marker.
        self._spare_marker: dict[str, str] | None = None

    @property
    def marker(self) -> dict[str, str]:
        """Environment every process of this attempt on this node carries."""
        return attempt_marker(self._settings, self.attempt_id)

    def start(self, spare: SpareLauncher | None = None) -> None:
        """Start the launcher; a start that fails becomes a failed exit, a fatal one
        (the job fails at once, no restart) if the job's working_dir is missing here.
        GPUs this node does not offer fail the start too, not fatally: the controller
        places the next attempt by the node's inventory.

        With ``spare`` (``worker.spare``: a launcher interpreter that has loaded, or is
        loading, what a launcher loads) the launcher is that spare, handed the same
        arguments, environment and working directory a new one would get; a spare that
        is gone is left alone and a new launcher started, as without one. Either way
        ``spare`` is this attempt's from then on: the caller starts another."""
        try:
            self._start(spare)
        finally:
            if spare is not None and self._popen is not spare.proc:
                spare.stop()  # not handed off: it must not wait on for another attempt

    def _start(self, spare: SpareLauncher | None) -> None:
        unusable = missing_working_dir(self.assignment, self._settings.name)
        if unusable is not None:
            logger.error("%s cannot start: %s", self._ctx, unusable)
            self.exit = AttemptExit(outcome="failed", message=unusable, fatal=True)
            return
        refusal = device_refusal(self.assignment, self._node_gpus)
        if refusal is not None:
            logger.error("%s cannot start: %s", self._ctx, refusal)
            self.exit = AttemptExit(outcome="failed", message=f"cannot start: {refusal}")
            return
        overridden = sorted(AGENT_DEVICE_VARIABLES & set(self.assignment.env))
        if overridden:
            logger.warning(
                "%s the job's env sets %s; the agent's values replace them",
                self._ctx,
                ", ".join(overridden),
            )
        try:
            user = sandbox.job_user(
                self._settings.isolation, self._settings.job_uid_base, self.assignment.job_id
            )
        except ValueError as exc:
            logger.error("%s cannot start: %s", self._ctx, exc)
            self.exit = AttemptExit(outcome="failed", message=str(exc), fatal=True)
            return
        try:
            box = self._prepare_dirs(user)
            torchrun_args = build_torchrun_args(
                self.assignment,
                local_addr=self._settings.address,
                log_dir=box.log_dir,
                controller_url=self._settings.controller_url,
            )
            if self._node_token is not None:
                write_private(self.node_token_path, self._node_token)
            worker_env = build_launcher_env(
                self.assignment,
                settings=self._settings,
                events_file=self.events_path,
                base_env=os.environ,
                progress_dir=self.progress_dir,
                node_gpus=len(self._node_gpus),
            )
            # The launcher runs as root: it never sees the job's variables in its own
            # environment; they reach only the workers, through a file of root's.
            env = build_launcher_env(
                self.assignment.model_copy(update={"env": {}}),
                settings=self._settings,
                events_file=self.events_path,
                base_env=os.environ,
                progress_dir=self.progress_dir,
                node_gpus=len(self._node_gpus),
            )
            sandbox.write_job_env(box.job_env_file, sandbox.job_env_overlay(worker_env, env))
            command = [
                *LAUNCHER_PREFIX,
                "--events-file", str(self.events_path),
                "--parent-pid", str(os.getpid()),
                "--restart-policy", self.assignment.restart.model_dump_json(),
                "--progress-dir", str(self.progress_dir),
                "--sandbox", box.model_dump_json(),
            ]  # fmt: skip
            if self._settings.warm_workers:
                command.append("--warm-workers")
            if self.assignment.hang_timeout_s is not None:
                command += ["--hang-timeout-s", str(self.assignment.hang_timeout_s)]
                if self.assignment.hang_timeout_adaptive:
                    command.append("--hang-timeout-adaptive")
            if self._node_token is not None:
                command += ["--node-token-file", str(self.node_token_path)]
                if self.assignment.member_id is not None:
                    command += ["--member-id", str(self.assignment.member_id)]
            self.membership_path.unlink(missing_ok=True)  # a previous life's
            command += ["--membership-file", str(self.membership_path)]
            command += ["--", *torchrun_args]
            self._popen = self._handed_off(spare, command, env, box.working_dir)
            how = " (a spare, handed the attempt)" if self._popen is not None else ""
            if self._popen is None:
                self._popen = subprocess.Popen(
                    command,
                    env=env,
                    cwd=box.working_dir,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # a terminal's Ctrl-C reaches the agent only
                )
        except (OSError, ValueError) as exc:
            logger.error("%s cannot start: %s", self._ctx, exc)
            self.exit = AttemptExit(outcome="failed", message=f"cannot start: {exc}")
            return
        logger.info("%s started launcher pid %d%s: %s", self._ctx, self._popen.pid, how, command)
        self._track([psutil.Process(self._popen.pid)])
        pipes: list[tuple[IO[bytes] | None, Literal["stdout", "stderr"]]] = [
            (self._popen.stdout, "stdout"),
            (self._popen.stderr, "stderr"),
        ]
        for pipe, stream in pipes:
            reader = threading.Thread(
                target=self._read_stream,
                args=(pipe, stream),
                name=f"attempt-{self.attempt_id}-{stream}",
                daemon=True,
            )
            reader.start()
            self._readers.append(reader)

    def _handed_off(
        self,
        spare: SpareLauncher | None,
        command: Sequence[str],
        env: Mapping[str, str],
        working_dir: Path,
    ) -> subprocess.Popen[bytes] | None:
        """The spare made this attempt's launcher (``command`` without its interpreter
        part, ``env``, ``working_dir``); None where there is no live spare to hand to."""
        if spare is None:
            return None
        if not spare.alive():
            logger.warning(
                "%s the spare launcher pid %d is gone (exit %s); starting a new launcher",
                self._ctx, spare.pid, spare.proc.returncode,
            )  # fmt: skip
            spare.stop()
            return None
        ready = spare.ready()
        handoff = Handoff(argv=list(command[len(LAUNCHER_PREFIX) :]), env=dict(env),
                          cwd=str(working_dir))  # fmt: skip
        try:
            popen = spare.hand_off(handoff, self.dir / HANDOFF_FILE)
        except OSError as exc:
            logger.warning("%s cannot hand off to the spare launcher: %s", self._ctx, exc)
            spare.stop()
            return None
        self._spare_marker = dict(spare.marker)
        logger.info(
            "%s the spare launcher pid %d takes the attempt (%s)",
            self._ctx,
            popen.pid,
            f"loaded in {spare.ready_after_s:.1f} s" if ready else "still loading",
        )
        return popen

    def _prepare_dirs(self, user: sandbox.JobUser | None) -> sandbox.WorkerSandbox:
        """The attempt's directories: root's and passable where the launcher writes,
        the job's own (0700) where the workers write; the job's snapshot directory too."""
        sandbox.root_dir(self.dir.parent)
        sandbox.root_dir(self.dir)
        if not is_url(self.assignment.snapshot_dir):
            sandbox.private_dir(Path(self.assignment.snapshot_dir), user)
        self.events_path.write_bytes(b"")  # a previous life may have left one
        sandbox.own(self.events_path, user, 0o600)  # the runtime appends, so does the launcher
        sandbox.private_dir(self.progress_dir, user)
        working_dir = working_dir_for(self.assignment, self.dir)
        if working_dir == self.dir / NODE_WORKING_DIR:
            sandbox.private_dir(working_dir, user)
        return sandbox.WorkerSandbox(
            user=user,
            job_env_file=self.dir / "job-env.json",
            tmp_dir=sandbox.private_dir(self.dir / "tmp", user),
            log_dir=sandbox.root_dir(self.dir / "torchelastic"),
            working_dir=working_dir,
            script=self.assignment.entrypoint.script,
        )

    def _read_stream(self, pipe: IO[bytes] | None, stream: Literal["stdout", "stderr"]) -> None:
        if pipe is None:
            return
        local_rank: int | None = None
        global_rank: int | None = None
        continues = False  # the previous chunk ended mid-line (a line over MAX_LINE_CHARS)
        with pipe:
            for chunk in iter(lambda: pipe.readline(MAX_LINE_CHARS), b""):
                text = chunk.decode("utf-8", errors="replace")
                complete = text.endswith("\n")
                text = text.rstrip("\r\n")
                if not continues:
                    local_rank, global_rank, text = parse_console_line(text)
                line = LogLine(
                    time=datetime.now(UTC),
                    local_rank=local_rank,
                    global_rank=global_rank,
                    stream=stream,
                    line=text[:MAX_LINE_CHARS],
                )
                self._logs.put(line)
                continues = not complete

    def _track(self, found: list[psutil.Process]) -> None:
        for proc in found:
            try:
                self._tracked.setdefault(procs.ProcessId.of(proc), proc)
            except psutil.Error:
                continue

    def _alive(self) -> list[psutil.Process]:
        return [p for p in self._tracked.values() if procs.is_alive(p)]

    def _spares(self) -> list[psutil.Process]:
        """Live processes with the spare's marker (when a spare became the launcher):
        untracked ones too, since found by a scan of ``/proc``."""
        if self._spare_marker is None:
            return []
        return procs.find_by_env(self._spare_marker)

    @property
    def launcher_pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    def refresh(self) -> None:
        """Track the launcher's descendants (the agent reaps adopted orphans); drop the dead."""
        if self._stopper is not None:
            return
        if self._popen is not None and self._popen.poll() is None:
            self._track(procs.descendants(self._popen.pid))
        for key, proc in list(self._tracked.items()):
            if proc.pid != self.launcher_pid and not procs.is_alive(proc):
                del self._tracked[key]

    def ledger_entries(self) -> list[procs.ProcessId]:
        return [key for key, proc in self._tracked.items() if procs.is_alive(proc)]

    def running_info(self) -> RunningAttempt:
        if self._stopper is not None:
            alive = self.exit is None
        else:
            alive = self._popen is not None and self._popen.poll() is None
        return RunningAttempt(
            attempt_id=self.attempt_id,
            launcher_pid=self.launcher_pid if alive else None,
            processes=len(self._alive()),
        )

    def poll(self) -> bool:
        """Settle the exit if the launcher has ended by itself; True once the exit is known."""
        if self.exit is not None or self._stopper is not None:
            return self.exit is not None
        if self._popen is None:
            return False
        code = self._popen.poll()
        if code is None:
            return False
        self._join_readers()
        leftovers = self._alive() + procs.find_by_env(self.marker) + self._spares()
        clean = True
        if leftovers:
            logger.warning("%s launcher exited leaving %s; killing them", self._ctx, leftovers)
            grace = min(1.0, self._settings.stop_grace_s)
            outcome = procs.kill_all(leftovers, grace, marker=self.marker)
            clean = outcome.clean
        last = self._events.last_of(LauncherExited)
        if last is not None:
            message = last.message
        else:
            message = f"launcher exited with code {code} without a launcher_exit event"
        self.node_token_path.unlink(missing_ok=True)
        closed = last is not None and last.outcome == "closed" and code == RENDEZVOUS_CLOSED_EXIT
        self.exit = AttemptExit(
            outcome="closed" if closed else "succeeded" if code == 0 else "failed",
            exit_code=code,
            message=message,
            clean=clean,
            fatal=code != 0 and last is not None and last.fatal,
        )
        logger.info("%s launcher exited: %s", self._ctx, self.exit)
        return True

    @property
    def stopping(self) -> bool:
        return self._stopper is not None and self._stopper.is_alive()

    @property
    def may_hold_devices(self) -> bool:
        """Whether the attempt's workers may still run here: started and not yet seen to
        end, or being stopped."""
        return self.exit is None or self.stopping

    @property
    def done(self) -> bool:
        """Nothing left to do or say: exit delivered (or refused), no stop under way."""
        return self.exit_delivered and not self.stopping

    def stop(self, reason: str) -> None:
        """Begin ending the whole tree (SIGTERM, grace, SIGKILL) on a thread of its own.

        A no-op if the launcher already ended or a stop is under way; ``exit``
        is set once the stop is complete. The stop thread alone touches the
        launcher from then on (``poll``/``refresh`` leave it alone).
        """
        if self._stopper is not None or self.poll():
            return
        if self._popen is None:
            self.exit = AttemptExit(outcome="stopped", message=reason)
            return
        logger.info("%s stopping: %s", self._ctx, reason)
        self._stopper = threading.Thread(
            target=self._stop,
            args=(self._popen, self._alive(), reason),
            name=f"attempt-{self.attempt_id}-stop",
            daemon=True,
        )
        self._stopper.start()

    def _note_memberships(self, assignment: Assignment) -> None:
        count = assignment.memberships
        if count is not None and (
            not self._memberships_seen or self._memberships_seen[-1][1] != count
        ):
            self._memberships_seen.append((datetime.now(UTC), count))

    def _joined_since(self, formed_at: datetime) -> bool:
        """Whether a node joined the attempt after ``formed_at`` (as far as this node's
        heartbeats saw: a join less than a heartbeat before it may be missed)."""
        if not self._memberships_seen:
            return True  # an older controller: no way to tell, assume one did
        then = self._memberships_seen[0][1]
        for seen_at, count in self._memberships_seen:
            if seen_at <= formed_at:
                then = count
        return self._memberships_seen[-1][1] > then

    def follow_membership(self, assignment: Assignment) -> threading.Thread | None:
        """End the workers (not the launcher) when the attempt lost a member since this
        node last looked, so that torch's elastic agent re-forms them at once, without it.

        Nothing signals a worker whose collective waits on a frozen or cut-off peer, so
        the controller's word (``Assignment.membership_generation``) is what ends that
        wait, for gloo and NCCL alike. Not if the workers' last rendezvous had no more
        nodes than the attempt has members now and no node joined since: they already
        formed without the lost one. (A node that joined may stand in for the lost one in
        the count while the workers still wait on the lost one.)
        The launcher, told by ``membership_path``, reports the ends as a membership
        change, which costs no restart. The kill (SIGTERM, ``RE_FORM_GRACE_S``, SIGKILL)
        runs on a thread of its own, which is returned; None if nothing is ended.
        """
        self._note_memberships(assignment)
        generation = assignment.membership_generation
        if generation <= self._generation:
            return None
        self._generation = generation
        launcher = self.launcher_pid
        if self._stopper is not None or self.exit is not None or launcher is None:
            return None
        formed = self._events.last_timed(RendezvousComplete, tail_bytes=1 << 20)
        members = assignment.active_members
        if formed is not None and members is not None:
            formed_at, round_ = formed
            nodes = round_.group_world_size
            if nodes is not None and nodes <= members and not self._joined_since(formed_at):
                logger.info(
                    "%s a member left; the workers already formed with %d node(s), %d remain",
                    self._ctx, nodes, members,
                )  # fmt: skip
                return None
        workers = procs.descendants(launcher)
        if not workers:
            return None
        logger.warning(
            "%s a member of the attempt is gone (membership generation %d): ending %d worker "
            "process(es) so that they re-form without it",
            self._ctx, generation, len(workers),
        )  # fmt: skip
        try:
            self.membership_path.write_text(f"{generation}\n")
        except OSError as exc:
            logger.error("%s cannot write %s: %s", self._ctx, self.membership_path, exc)
        killer = threading.Thread(
            target=procs.kill_all,
            args=(workers, min(RE_FORM_GRACE_S, self._settings.stop_grace_s)),
            name=f"attempt-{self.attempt_id}-re-form",
            daemon=True,
        )
        killer.start()
        return killer

    def wait_stopped(self, timeout_s: float | None = None) -> None:
        if self._stopper is not None:
            self._stopper.join(timeout_s)

    def fence(
        self, reason: str = "fenced: the controller no longer assigns it to this node"
    ) -> None:
        """The controller refused a report (409): stop; only the exit is still worth sending."""
        self._fenced = True
        self.stop(reason)

    def give_up_reporting(self) -> None:
        """The controller refused the exit report too: nothing more to say."""
        self.exit_delivered = True

    def _stop(
        self, popen: subprocess.Popen[bytes], known: list[psutil.Process], reason: str
    ) -> None:
        # poll() saw the launcher unreaped before this thread began, and nothing
        # else reaps it now, so its pid is still ours to signal.
        known = known + self._spares()  # a scan of /proc: here, off the agent's loop
        outcome = procs.kill_tree(
            popen.pid, self._settings.stop_grace_s, marker=self.marker, known=known
        )
        code = outcome.exit_codes.get(popen.pid)
        if popen.returncode is None:
            # kill_tree reaped the launcher; tell Popen so it does not wait for it again.
            popen.returncode = code if code is not None else -signal.SIGKILL
        self._join_readers()
        self.node_token_path.unlink(missing_ok=True)
        if outcome.clean:
            logger.info("%s stopped, nothing left", self._ctx)
        else:
            logger.error("%s processes survive SIGKILL: %s", self._ctx, outcome.left)
        self.exit = AttemptExit(
            outcome="stopped",
            exit_code=popen.returncode,
            message=f"stopped by the node agent: {reason}",
            clean=outcome.clean,
        )

    def _join_readers(self, timeout_s: float = 2.0) -> None:
        for reader in self._readers:
            reader.join(timeout_s)
            if reader.is_alive():
                logger.warning("%s %s still open after the launcher ended", self._ctx, reader.name)

    def next_report(
        self, *, max_logs: int, max_events: int, max_log_chars: int | None = None
    ) -> PendingReport | None:
        """The next batch to send, or None when there is nothing new.

        The exit rides on the batch that empties both buffers, after the
        launcher's pipes and the events file have been drained.
        """
        if self.exit_delivered:
            return None
        if self._fenced:  # the controller takes no more output, but records how it ended
            if self.exit is None:
                return None
            report = AttemptReport(
                attempt_id=self.attempt_id, member_id=self.assignment.member_id, exit=self.exit
            )
            return PendingReport(report, LogBatch([], -1, 0, True), EventBatch([], 0, True))
        logs = self._logs.peek(max_logs, max_log_chars)
        events = self._events.peek(max_events)
        last = self.exit is not None and logs.complete and events.complete
        if not logs.lines and not events.events and not last:
            return None
        report = AttemptReport(
            attempt_id=self.attempt_id,
            member_id=self.assignment.member_id,
            logs=logs.lines,
            events=events.events,
            exit=self.exit if last else None,
        )
        return PendingReport(report=report, logs=logs, events=events)

    def delivered(self, pending: PendingReport) -> None:
        if not self._fenced:
            self._logs.commit(pending.logs)
            self._events.commit(pending.events)
        if pending.report.exit is not None:
            self.exit_delivered = True
