"""``relaunch demo``: a controller, two node agents, a job, a killed worker, a recovery."""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from service.client import ApiError, RelaunchClient

DEMO_SPEC: dict[str, Any] = {
    "name": "demo-charlm",
    "task": {"name": "charlm", "params": {"epochs": 4, "seed": 7, "log_every_steps": 1}},
    "nnodes": "2:2",
    "nproc_per_node": 1,
    "max_restarts": 3,
    "snapshot": {"every_steps": 5},
}
KILL_AT_FRACTION = 0.4


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
    """The job's training processes (not its launchers)."""
    workers = []
    for proc in job_processes(snapshot_dir):
        try:
            cmd = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if "worker.launch" not in cmd and "torch.distributed.run" not in cmd:
            workers.append(proc)
    return workers


@dataclass
class LocalCluster:
    """A controller and node agents as real processes on this machine."""

    data_dir: Path
    port: int
    store_port: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_dir: Path | None = None
    host: str = "127.0.0.1"  # where nodes reach the controller and its store
    snapshot_root: Path | None = None  # default: data_dir/snapshots
    # The secret the agents register with; the controller is started with it.
    enrolment_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    # The first admin's token, read from the controller's output at its first start.
    admin_token: str | None = None

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
        from service.api.app import FIRST_ADMIN_BANNER

        log = (self.log_dir or self.data_dir) / "controller.log"
        lines = log.read_text(errors="replace").splitlines()
        for banner, token in itertools.pairwise(lines):
            if banner.strip() == FIRST_ADMIN_BANNER:
                self.admin_token = token.strip()
                return
        raise RuntimeError(f"the controller printed no admin token; see {log}")

    def snapshot_dir(self, job_id: int) -> Path:
        return (self.snapshot_root or self.data_dir / "snapshots") / f"job-{job_id}"

    def job_processes(self, job_id: int) -> list[psutil.Process]:
        return job_processes(self.snapshot_dir(job_id))

    def job_workers(self, job_id: int) -> list[psutil.Process]:
        return job_worker_processes(self.snapshot_dir(job_id))

    def spawn(
        self, name: str, args: list[str], env: dict[str, str], prefix: list[str] | None = None
    ) -> None:
        """Run ``relaunch ARGS`` as process ``name`` with ``env`` added; its output goes to
        ``name.log``."""
        log_dir = self.log_dir or self.data_dir
        log = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        self.procs[name] = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "service.cli", *args],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def start_controller(self, extra_env: dict[str, str] | None = None) -> None:
        env = {
            "RELAUNCH_DATA_DIR": str(self.data_dir),
            "RELAUNCH_HOST": self.host,
            "RELAUNCH_PORT": str(self.port),
            "RELAUNCH_STORE_HOST": self.host,
            "RELAUNCH_STORE_PORT": str(self.store_port),
            "RELAUNCH_ENROLMENT_TOKEN": self.enrolment_token,
            **({"RELAUNCH_SNAPSHOT_ROOT": str(self.snapshot_root)} if self.snapshot_root else {}),
            **(extra_env or {}),
        }
        self.spawn("controller", ["server"], env)
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
        self, name: str, address: str | None = None, prefix: list[str] | None = None
    ) -> None:
        """Start node agent ``name``; ``prefix`` wraps its command (``ip netns exec NS``)."""
        work = self.data_dir / "agents" / name
        work.mkdir(parents=True, exist_ok=True)
        args = ["agent", "--controller", self.url, "--name", name, "--work-dir", str(work)]
        if address is not None:
            args += ["--address", address]
        self.spawn(name, args, {"RELAUNCH_AGENT_ENROLMENT_TOKEN": self.enrolment_token}, prefix)

    def wait_nodes(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while sum(n["state"] == "ALIVE" for n in client.nodes()) < count:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fewer than {count} nodes registered")
                time.sleep(0.2)

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


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def run_demo(console: Console, port: int = 8080, keep_running: bool | None = None) -> int:
    if keep_running is None:
        keep_running = sys.stdout.isatty()
    data_dir = Path(tempfile.mkdtemp(prefix="relaunch-demo-"))
    cluster = LocalCluster(data_dir=data_dir, port=port, store_port=free_port())
    console.print(f"[bold]relaunch demo[/]  (state and logs in {data_dir})")
    try:
        with console.status("starting the controller (SQLite, migrations, rendezvous store)"):
            cluster.start_controller()
        with console.status("starting two node agents"):
            cluster.start_agent("node-a")
            cluster.start_agent("node-b")
            cluster.wait_nodes(2)
        return _drive(console, cluster, keep_running)
    except (RuntimeError, ApiError) as exc:
        console.print(f"[bold red]demo failed:[/] {escape(str(exc))}")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        with console.status("stopping agents and controller"):
            cluster.stop_all()


def _drive(console: Console, cluster: LocalCluster, keep_running: bool) -> int:
    with cluster.client() as client:
        submitted_at = time.time()
        submitted = client.submit(DEMO_SPEC)
        job_id = submitted["id"]
        console.print(escape(job_summary(submitted)))
        killed_at: float | None = None
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[steps]}"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
        )
        with progress:
            bar = progress.add_task("waiting for placement", total=None, info="", steps="")
            while True:
                job = client.job(job_id)
                step, total = job["last_step"] or 0, job["total_steps"]
                loss = f"loss {job['last_loss']:.3f}" if job["last_loss"] is not None else ""
                progress.update(
                    bar,
                    description=f"job {job_id} {job['state']:<10}",
                    completed=step,
                    total=total,
                    steps=f"step {step}/{total or '?'}",
                    info=f"{loss} world {job['world_size'] or '-'} restarts {job['restart_count']}",
                )
                if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    break
                if killed_at is None and total and step >= KILL_AT_FRACTION * total:
                    victims = cluster.job_workers(job_id)
                    if victims:
                        victim = victims[-1]
                        victim.send_signal(signal.SIGKILL)
                        killed_at = time.time()
                        progress.console.print(
                            f"[bold red]SIGKILL[/] worker pid {victim.pid} at step {step}"
                        )
                time.sleep(0.3)
        events = client.events(job_id)
        metrics = client.metrics(job_id)
    from service.cli import print_timeline

    print_timeline(events)
    _print_figures(console, job, submitted_at, killed_at, metrics)
    if keep_running:
        _serve_until_interrupted(console, cluster, job_id)
    else:
        console.print(ended_text(cluster.data_dir))
    return 0 if job["state"] == "SUCCEEDED" else 1


def ended_text(data_dir: Path) -> str:
    """What a demo that does not keep running says as it stops."""
    return (
        f"the demo is over: its controller and node agents stop now, so its API no longer "
        f"answers (their state and logs stay in {data_dir}); run `relaunch demo "
        f"--keep-running` to keep them up, with the API and the dashboard, until Ctrl-C"
    )


def _serve_until_interrupted(console: Console, cluster: LocalCluster, job_id: int) -> None:
    console.print(f"API: {cluster.url}/api/v1/jobs/{job_id}   docs: {cluster.url}/docs")
    console.print(f"dashboard: {cluster.url}/dashboard/")
    console.print(
        f"the demo's admin token (send it as 'Authorization: Bearer …'): {cluster.admin_token}"
    )
    console.print("the controller and node agents keep running; press Ctrl-C to stop them")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass


def job_summary(job: dict[str, Any]) -> str:
    """One line on a job the API returned: id, name, what it runs, where and how it recovers.

    e.g. ``submitted job 1 demo-charlm: task charlm (epochs=4, seed=7) on 2 nodes,
    1 process each, up to 3 restarts, a snapshot every 5 steps``.
    """
    spec = job["spec"]
    if spec.get("task"):
        params = ", ".join(f"{k}={v}" for k, v in spec["task"].get("params", {}).items())
        what = f"task {spec['task']['name']}" + (f" ({params})" if params else "")
    else:
        script = spec.get("script") or {}
        what = f"script {script['path']}" if script.get("path") else f"module {script['module']}"
    low, high = job["min_nodes"], job["max_nodes"]
    nodes = f"{low} node{'s' * (high != 1)}" if low == high else f"{low} to {high} nodes"
    procs, budget = spec["nproc_per_node"], spec["max_restarts"]
    restarts = f"up to {budget} restart{'s' * (budget != 1)}" if budget else "no restarts"
    snapshot = spec.get("snapshot") or {}
    if snapshot.get("every_steps"):
        saves = f"a snapshot every {snapshot['every_steps']} steps"
    elif snapshot.get("every_epochs"):
        saves = f"a snapshot every {snapshot['every_epochs']} epochs"
    else:
        saves = "a snapshot after each epoch"
    return (
        f"submitted job {job['id']} {job['name']}: {what} on {nodes}, {procs} "
        f"process{'es' * (procs != 1)} each, {restarts}, {saves}"
    )


def _print_figures(
    console: Console,
    job: dict[str, Any],
    submitted_at: float,
    killed_at: float | None,
    metrics: list[dict[str, Any]],
) -> None:
    console.print(f"job {job['id']} {job['state']} after {job['restart_count']} restart(s)")
    if metrics:
        console.print(f"submit → first step: {_ts(metrics[0]['time']) - submitted_at:.1f} s")
    if killed_at is not None:
        after = [m for m in metrics if _ts(m["time"]) > killed_at]
        if after:
            console.print(
                f"worker kill → resumed training: {_ts(after[0]['time']) - killed_at:.1f} s"
            )
    if job["finished_at"]:
        console.print(f"total run time: {_ts(job['finished_at']) - submitted_at:.1f} s")
