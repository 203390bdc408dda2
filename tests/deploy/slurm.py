"""A Slurm cluster on this host: munged, slurmctld and one slurmd per node name, each in the
foreground, with their configuration, keys, state and logs in one directory.

Debian's Slurm is built with multiple-slurmd support, so two slurmd on one host are two
nodes (``slurmd -N n1``), each on a port of its own. No cgroups: processes are tracked
through their parents (proctrack/linuxproc), as a container allows.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from service.local_cluster import free_port
from tests.helpers import wait_for

_CONF = """\
ClusterName=relaunch-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait={kill_wait_s}
MinJobAge=600
{nodes}
PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""
_NODE = (
    "NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
    "CPUs=1 RealMemory=100 State=UNKNOWN"
)


@dataclass
class LocalSlurm:
    """Slurm's daemons for ``nodes``, all on this host; ``stop`` ends what ``start`` began."""

    root: Path
    nodes: tuple[str, ...] = ("n1", "n2")
    kill_wait_s: int = 30  # SIGTERM to SIGKILL when a job or step ends
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """This process's environment, pointed at this cluster's configuration."""
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def start(self) -> None:
        for sub in ("state", "munge", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, mode=0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        socket = self.root / "munge" / "socket"
        self._spawn(
            "munged",
            ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket}"]
            + [f"--{f}-file={self.root / 'munge' / f}" for f in ("pid", "log", "seed")],
        )
        wait_for("munged's socket", socket.exists, 30)
        nodes = [_NODE.format(name=n, port=free_port()) for n in self.nodes]
        (self.root / "slurm.conf").write_text(
            _CONF.format(
                root=self.root,
                ctld_port=free_port(),
                slurmd_port=free_port(),
                munge_socket=socket,
                kill_wait_s=self.kill_wait_s,
                nodes="\n".join(nodes),
                names=",".join(self.nodes),
            )
        )
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        for name in self.nodes:
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name])
        wait_for(
            "every node idle", lambda: self.node_states() == ["idle"] * len(self.nodes), 60, 0.5
        )

    def _spawn(self, name: str, args: list[str]) -> None:
        with open(self.root / f"{name}.out", "ab") as out:
            self.procs.append(
                subprocess.Popen(
                    args, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=self.root
                )
            )

    def run(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Run a Slurm command against this cluster; its output."""
        done = subprocess.run(
            args, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def node_states(self) -> list[str]:
        return self.run("sinfo", "-h", "-N", "-o", "%t").split()

    def sbatch(self, script: Path, *options: str, env: dict[str, str]) -> int:
        return int(self.run("sbatch", "--parsable", *options, str(script), env=env).strip())

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, ...); kept MinJobAge after
        the job ends."""
        line = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def stop(self) -> None:
        try:
            for job_id in self.run("squeue", "-h", "-o", "%i").split():
                self.run("scancel", job_id)
            wait_for("no job left", lambda: not self.run("squeue", "-h", "-o", "%i").strip(), 90)
        finally:
            for proc in reversed(self.procs):  # slurmd, slurmctld, then munged
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def logs(self) -> str:
        return "\n".join(
            f"----- {path.name} -----\n"
            + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
            for path in sorted(self.root.glob("*.log"))
        )
