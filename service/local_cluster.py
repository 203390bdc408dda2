"""A controller and node agents as real processes on this machine: the demo's cluster,
and the harness of the end-to-end tests and the benchmarks."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from contract.labels import ZYGOTE_PROCESS_NAME as ZYGOTE_NAME
from service.client import RelaunchClient


def job_processes(snapshot_dir: Path) -> list[psutil.Process]:
    """Every process on this machine of the job whose snapshot directory is ``snapshot_dir``.

    The directory is unique per controller and job, so processes of another
    controller's job with the same id are never matched.
    """
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("RELAUNCH_SNAPSHOT_DIR") == str(snapshot_dir):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def job_worker_processes(snapshot_dir: Path) -> list[psutil.Process]:
    """The job's training processes (not its launchers, nor their warm zygotes).

    A worker forked from a zygote (``worker.warm``) keeps the zygote's command line
    and environment block, but not its name (``relaunch-zygote``)."""
    workers = []
    for proc in job_processes(snapshot_dir):
        try:
            cmd = " ".join(proc.cmdline())
            name = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if "worker.launch" in cmd or "torch.distributed.run" in cmd or name == ZYGOTE_NAME:
            continue
        workers.append(proc)
    return workers


@dataclass
class LocalCluster:
    """A controller and node agents as real processes on this machine."""

    data_dir: Path
    port: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_dir: Path | None = None
    host: str = "127.0.0.1"  # where nodes reach the controller
    snapshot_root: Path | None = None  # default: nodes_dir/snapshots
    # The secret the agents register with; the controller is started with it.
    enrolment_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    # The first admin's token, read from the controller's output at its first start.
    admin_token: str | None = None
    # The agents' RELAUNCH_AGENT_ISOLATION: as root, each job runs as a user of its own;
    # otherwise every job runs as this user (the demo: one user's own cluster).
    isolation: str = field(default_factory=lambda: "user" if os.geteuid() == 0 else "none")
    # How many agents share this host: each is given its share of the cores
    # (RELAUNCH_AGENT_CPUS, which sizes its workers' OMP_NUM_THREADS) and no GPUs, since
    # agents on one host would each offer the same ones. ``start_agent(extra_env=)`` may
    # say otherwise.
    agents_on_host: int = 2

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self, timeout_s: float = 10.0) -> RelaunchClient:
        """A client acting as the first admin."""
        return RelaunchClient(self.url, self.admin_token, timeout_s=timeout_s)

    def learn_admin_token(self) -> None:
        """Read the first admin's token from the controller's output, once."""
        if self.admin_token is not None:
            return
        # Imported here, not at the top: the banner is the controller's, and importing
        # service.api.app loads the whole controller (FastAPI, SQLAlchemy), which the
        # CLI, importing the demo and so this module, must not pay for on every command.
        from service.api.app import FIRST_ADMIN_BANNER

        log = (self.log_dir or self.data_dir) / "controller.log"
        lines = log.read_text(errors="replace").splitlines()
        for banner, token in itertools.pairwise(lines):
            if banner.strip() == FIRST_ADMIN_BANNER:
                self.admin_token = token.strip()
                return
        raise RuntimeError(f"the controller printed no admin token; see {log}")

    @property
    def nodes_dir(self) -> Path:
        """Where the agents' work dirs and the default snapshot root lie. When jobs run as
        users of their own, beside ``data_dir`` (the controller keeps that 0700) and
        passable by them (0711); otherwise ``data_dir`` itself."""
        if self.isolation == "user":
            return self.data_dir.with_name(self.data_dir.name + "-nodes")
        return self.data_dir

    @property
    def snapshots(self) -> Path:
        return self.snapshot_root or self.nodes_dir / "snapshots"

    def agent_dir(self, name: str) -> Path:
        return self.nodes_dir / "agents" / name

    def snapshot_dir(self, job_id: int) -> Path:
        return self.snapshots / f"job-{job_id}"

    def job_processes(self, job_id: int) -> list[psutil.Process]:
        return job_processes(self.snapshot_dir(job_id))

    def job_workers(self, job_id: int) -> list[psutil.Process]:
        return job_worker_processes(self.snapshot_dir(job_id))

    def worker_env(self, proc: psutil.Process) -> dict[str, str]:
        """A worker's environment: ``/proc/PID/environ`` with its own variables (rank,
        master address, ...) from its launcher's ``workers.json``, which a worker forked
        from a warm zygote does not show in /proc."""
        env = dict(proc.environ())
        records = self.nodes_dir.glob("agents/*/attempts/*/workers.json")
        for record in sorted(records, key=_mtime):  # the newest record of a reused pid wins
            try:
                found = json.loads(record.read_text()).get(str(proc.pid))
            except (OSError, ValueError):
                continue
            if found:
                env.update({k: str(v) for k, v in found.items() if k != "forked"})
        return env

    def _open_to_jobs(self) -> None:
        """Make the snapshot root, passable (0711, not listable) by the jobs' users, as is
        the way to it and to the agents' work dirs."""
        for directory in (self.nodes_dir, self.nodes_dir / "agents", self.snapshots):
            directory.mkdir(parents=True, exist_ok=True)
            if self.isolation == "user":
                directory.chmod(0o711)

    def spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        prefix: list[str] | None = None,
        umask: int = -1,
    ) -> None:
        """Run ``relaunch ARGS`` as process ``name`` with ``env`` added; its output goes to
        ``name.log`` (0600: the controller's holds the first admin's token)."""
        log_dir = self.log_dir or self.data_dir
        fd = os.open(log_dir / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with open(fd, "ab") as log:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(
                [*(prefix or []), sys.executable, "-m", "service.cli", *args],
                env={**os.environ, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                umask=umask,
            )

    def start_controller(self, extra_env: dict[str, str] | None = None) -> None:
        env = {
            "RELAUNCH_DATA_DIR": str(self.data_dir),
            "RELAUNCH_HOST": self.host,
            "RELAUNCH_PORT": str(self.port),
            "RELAUNCH_ENROLMENT_TOKEN": self.enrolment_token,
            "RELAUNCH_SNAPSHOT_ROOT": str(self.snapshots),
            **(extra_env or {}),
        }
        self._open_to_jobs()
        # Its database and files are its own, even where jobs may pass.
        self.spawn("controller", ["server"], env, umask=0o077)
        self.wait_healthy()
        self.learn_admin_token()

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        with RelaunchClient(self.url, timeout_s=2.0) as client:
            while True:
                try:
                    client.health()
                    return
                except Exception as exc:
                    proc = self.procs.get("controller")
                    if proc is not None and proc.poll() is not None:
                        raise RuntimeError("the controller exited; see controller.log") from exc
                    if time.monotonic() > deadline:
                        raise RuntimeError("the controller did not become healthy") from exc
                    time.sleep(0.2)

    def start_agent(
        self,
        name: str,
        address: str | None = None,
        prefix: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        controller: str | None = None,
    ) -> None:
        """Start node agent ``name``; ``prefix`` wraps its command (``ip netns exec NS``);
        ``extra_env`` adds settings (``RELAUNCH_AGENT_*``); ``controller``: the agent's
        controller URL or comma-separated list of them (default: this cluster's)."""
        self._open_to_jobs()
        work = self.agent_dir(name)
        work.mkdir(parents=True, exist_ok=True)
        url = controller or self.url
        args = ["agent", "--controller", url, "--name", name, "--work-dir", str(work)]
        if address is not None:
            args += ["--address", address]
        cores = len(os.sched_getaffinity(0))
        env = {
            "RELAUNCH_AGENT_ENROLMENT_TOKEN": self.enrolment_token,
            "RELAUNCH_AGENT_ISOLATION": self.isolation,
            "RELAUNCH_AGENT_CPUS": str(max(1, cores // max(1, self.agents_on_host))),
            "RELAUNCH_AGENT_GPUS": "none",
            **(extra_env or {}),
        }
        self.spawn(name, args, env, prefix)

    def wait_nodes(self, count: int, timeout_s: float = 60.0) -> None:
        """Wait until ``count`` nodes are alive. Fail at once, with what it said, when an
        agent started here gave up (exited with an error status, not by a signal) and
        the agents still running here plus the alive nodes not started here are fewer
        than ``count``: nothing could then get there."""
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while True:
                alive = {n["name"] for n in client.nodes() if n["state"] == "ALIVE"}
                if len(alive) >= count:
                    return
                agents = {name: p for name, p in self.procs.items() if name != "controller"}
                gave_up = {name: p for name, p in agents.items() if (p.poll() or 0) > 0}
                running = sum(p.poll() is None for p in agents.values())
                if gave_up and running + len(alive - agents.keys()) < count:
                    said = "; ".join(
                        f"{name} (exit status {p.returncode}): {self.last_error(name)}"
                        for name, p in gave_up.items()
                    )
                    raise RuntimeError(f"fewer than {count} node agents are running: {said}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fewer than {count} nodes registered")
                time.sleep(0.2)

    def last_error(self, name: str) -> str:
        """The last error that process ``name`` logged, else its last line."""
        log = (self.log_dir or self.data_dir) / f"{name}.log"
        try:
            lines = [line for line in log.read_text(errors="replace").splitlines() if line]
        except OSError:
            return f"no log at {log}"
        errors = [line for line in lines if " ERROR " in line or " CRITICAL " in line]
        return (errors or lines or ["(nothing logged)"])[-1].strip()

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def node_processes(self, name: str) -> list[psutil.Process]:
        """The agent of node ``name`` and every process under it (launchers, workers)."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return []
        try:
            agent = psutil.Process(proc.pid)
            return [agent, *agent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_node(self, name: str, sig: int) -> list[psutil.Process]:
        """Send ``sig`` to every process of node ``name`` at once; return them."""
        found = self.node_processes(name)
        for proc in found:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                continue
        return found

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of node ``name``, as if the host died."""
        self.signal_node(name, signal.SIGKILL)
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.wait()

    def stop_all(self) -> None:
        for name in [n for n in self.procs if n != "controller"]:
            self.stop(name)
        self.stop("controller")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
