"""Seeded random fault campaign: one job on a cluster of real processes, faults drawn at
random while it trains, and the invariants a fault-tolerant job must keep.

Every node agent runs in a network namespace of its own (``bench.hosts``), so a node
can be cut off the network. Faults: SIGKILL of one worker; SIGKILL of every process of
a node (a replacement node is started once the survivors train again); SIGSTOP of a
whole node for longer than the node timeout, then SIGCONT; a cut of a node's link for
as long; SIGTERM of an agent and its restart under the same name; SIGKILL of the
controller and its restart; a new node.

Invariants (:meth:`CampaignResult.checks`): the job succeeds; its final MSE is within
:data:`LOSS_TOLERANCE` of an undisturbed run of the same job; ``restart_count`` equals
the worker kills (crashes are charged, membership changes not); after every fault
training resumes from a step no lower than the last snapshot committed before it; no
process of the job or the cluster is left; no server error in the controller's log.

    python -m bench.chaos --minutes 10 --seed 1 [--interval 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from bench.hosts import Hosts
from service.client import RelaunchClient
from service.local_cluster import LocalCluster, free_port
from service.settings import ControllerSettings

KINDS = (
    "worker_kill",
    "node_kill",
    "node_freeze",
    "network_cut",
    "agent_restart",
    "controller_restart",
    "node_add",
)
NODELESS = frozenset({"controller_restart", "node_add"})
ONE_NODE = frozenset({"node_kill", "node_freeze", "network_cut", "agent_restart"})
CHARGED = frozenset({"worker_kill"})  # a crash spends the budget; membership changes do not
# Undisturbed runs of this job at world sizes 1, 2 and 3 for 10 to 20 epochs end with a
# final MSE between 0.0105 and 0.0161 (noise floor 0.0100): the world size alone moves it
# by up to 54 %. A faulted run changes world size, so it is held to the reference
# within 60 %; a run that lost its weights (restarted from scratch and cut short, or
# resumed a wrong snapshot) ends orders of magnitude above (the first steps: ~25).
LOSS_TOLERANCE = 0.6
MAX_NODES = 3
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
FINAL_MSE = re.compile(r"final MSE ([0-9.eE+-]+)")
# The controller logs no access lines; an unhandled error shows as a traceback, a
# handled server error as a line at level ERROR.
SERVER_ERROR = re.compile(r"Traceback|Exception in ASGI|Internal Server Error|\bERROR\b")


def chaos_spec(name: str, epochs: int, step_delay: float, max_restarts: int) -> dict[str, Any]:
    """The campaign's job: job defaults (a snapshot after every epoch: 11 steps at world
    size 3), except a restart budget for the worker kills; ``nnodes`` 1:3, so a fourth
    node is a spare."""
    return {
        "name": name,
        "task": {
            "name": "regression",
            "params": {
                "epochs": epochs,
                "samples": 1024,
                "batch_size": 32,
                "seed": 5,
                "step_delay": step_delay,
                "log_every_steps": 2,
            },
        },
        "nnodes": f"1:{MAX_NODES}",
        "max_restarts": max_restarts,
    }


def ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def until(what: str, predicate: Callable[[], Any], timeout_s: float, poll_s: float = 0.3) -> Any:
    """Poll ``predicate`` until it returns something true; None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with suppress(Exception):  # the controller may be down for a moment
            if value := predicate():
                return value
        if time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


@dataclass
class Fault:
    """One row of the fault log."""

    index: int
    kind: str
    node: str | None
    at: float  # wall clock (time.time()) of the fault
    at_s: float  # seconds since the campaign began
    world_before: int | None
    charged: bool  # what the fault log predicts
    world_after: int | None = None
    training_again_s: float | None = None  # fault → first step of the training after it
    rejoin_s: float | None = None  # agent restart: registered → member of the attempt again
    restarts_observed: int | None = None  # restart_count moved by this much meanwhile
    last_snapshot_before: int | None = None
    resumed_from: list[int] = field(default_factory=list)
    note: str = ""
    spent_s: float | None = None  # the campaign's time on it: injection, recovery, settling


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class CampaignResult:
    seed: int
    job: dict[str, Any]
    faults: list[Fault]
    reference_mse: float | None
    final_mse: float | None
    goodput: float | None  # over the whole training
    wall_s: float | None
    campaign_goodput: float | None  # over the time faults came
    campaign_s: float | None
    leftover: list[str]
    server_errors: list[str]
    node_timeout_s: float
    timeline: list[str] = field(default_factory=list)  # the job's events, from the start

    def checks(self) -> list[Check]:
        charged = sum(f.charged for f in self.faults)
        low = [
            f"#{f.index} {f.kind}: resumed from {s} < snapshot {f.last_snapshot_before}"
            for f in self.faults
            for s in f.resumed_from
            if f.last_snapshot_before is not None and s < f.last_snapshot_before
        ]
        ref, final = self.reference_mse, self.final_mse
        loss_ok = ref is not None and final is not None and final <= ref * (1 + LOSS_TOLERANCE)
        stuck = [
            f"#{f.index} {f.kind}"
            for f in self.faults
            if f.training_again_s is None and f.world_after != f.world_before
        ]
        # A node lost, stopped or cut off takes only itself out: the others re-form
        # together (a spare may fill its place).
        split = [
            f"#{f.index} {f.kind} {f.node}: world {f.world_before} -> {f.world_after}"
            for f in self.faults
            if f.kind in ONE_NODE
            and None not in (f.world_before, f.world_after)
            and (f.world_after or 0) < (f.world_before or 0) - 1
        ]
        return [
            Check("the others re-formed together", not split, "; ".join(split) or "all"),
            Check("training again after every fault", not stuck, ", ".join(stuck) or "all"),
            Check("job succeeded", self.job["state"] == "SUCCEEDED", self.job["message"]),
            Check(
                "final loss as undisturbed",
                loss_ok,
                f"final MSE {final} vs undisturbed {ref} (tolerance +{LOSS_TOLERANCE:.0%})",
            ),
            Check(
                "restart_count as predicted",
                self.job["restart_count"] == charged,
                f"restart_count {self.job['restart_count']}, predicted {charged}",
            ),
            Check("resumed at or past the last snapshot", not low, "; ".join(low) or "all"),
            Check("no process left", not self.leftover, "; ".join(self.leftover) or "none"),
            Check("no server error", not self.server_errors, " | ".join(self.server_errors[:5])),
        ]

    def targets(self) -> dict[str, Any]:
        """The README's figures: survivors of a freeze or cut training again within the
        node timeout + 5 s with no restart charged; a restarted agent back in the attempt
        within 5 s of registering."""
        held_out = [f for f in self.faults if f.kind in ("node_freeze", "network_cut")]
        return {
            "held_out_training_again_s": [f.training_again_s for f in held_out],
            "held_out_limit_s": self.node_timeout_s + 5,
            "held_out_charged": sum(f.restarts_observed or 0 for f in held_out),
            "agent_rejoin_s": [f.rejoin_s for f in self.faults if f.rejoin_s is not None],
            "agent_rejoin_limit_s": 5.0,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "job": {k: self.job.get(k) for k in ("id", "state", "restart_count", "message")}
            | {"membership_changes": self.job.get("membership_changes")},
            "node_timeout_s": self.node_timeout_s,
            "reference_mse": self.reference_mse,
            "final_mse": self.final_mse,
            "goodput": self.goodput,
            "wall_s": self.wall_s,
            "campaign_goodput": self.campaign_goodput,
            "campaign_s": self.campaign_s,
            "faults": [asdict(f) for f in self.faults],
            "checks": [asdict(c) for c in self.checks()],
            "targets": self.targets(),
            "timeline": self.timeline,
        }


class Campaign:
    """A cluster in namespaces, one job, and faults drawn by a seeded ``random.Random``.

    Kinds are dealt from a shuffled deck of all :data:`KINDS` (refilled when empty), so
    each kind comes up about equally often; a kind whose precondition does not hold
    (say, a node freeze with a single member) is put back and the next card drawn.
    """

    def __init__(
        self,
        work: Path,
        seed: int,
        node_timeout_s: float | None = None,
        nodes: int = 3,
        max_live_nodes: int = 4,
        log: Callable[[str], None] = print,
    ) -> None:
        self.work = work
        self.seed = seed
        self.rng = random.Random(seed)
        self.log = log
        self.node_timeout_s = node_timeout_s
        self.initial_nodes = nodes
        self.max_live_nodes = max_live_nodes
        self.hosts = Hosts()
        self.cluster: LocalCluster | None = None
        self.client: RelaunchClient | None = None
        self.live: list[str] = []  # agents started and not killed
        self.names = 0
        self.deck: list[str] = []
        self.faults: list[Fault] = []
        self.began = 0.0

    # ----- the cluster -----------------------------------------------------------

    @contextmanager
    def running(self) -> Iterator[Campaign]:
        """Bridge, controller and the first nodes; everything torn down on the way out."""
        self.hosts.open()
        try:
            data = self.work / "controller"
            data.mkdir(parents=True, exist_ok=True)
            self.cluster = LocalCluster(data_dir=data, port=free_port(), host=self.hosts.controller)
            self.cluster.start_controller(self._controller_env())
            self.client = self.cluster.client(timeout_s=5.0)
            for _ in range(self.initial_nodes):
                self.add_node()
            self.cluster.wait_nodes(self.initial_nodes, timeout_s=120)
            yield self
        finally:
            if self.client is not None:
                self.client.close()
            if self.cluster is not None:
                self.cluster.stop_all()
            self.hosts.close()

    def _controller_env(self) -> dict[str, str]:
        if self.node_timeout_s is None:
            return {}
        return {"RELAUNCH_NODE_TIMEOUT_S": str(self.node_timeout_s)}

    @property
    def c(self) -> LocalCluster:
        assert self.cluster is not None
        return self.cluster

    @property
    def api(self) -> RelaunchClient:
        assert self.client is not None
        return self.client

    def add_node(self) -> str:
        self.names += 1
        name = f"node-{self.names}"
        address = self.hosts.add(name)
        self.c.start_agent(name, address=address, prefix=self.hosts.exec_prefix(name))
        self.live.append(name)
        return name

    def restart_agent(self, name: str) -> None:
        self.c.start_agent(
            name, address=self.hosts.address(name), prefix=self.hosts.exec_prefix(name)
        )

    def node_timeout(self) -> float:
        return self.node_timeout_s or ControllerSettings().node_timeout_s

    # ----- reading the job -------------------------------------------------------

    def events(self, job_id: int) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        while page := self.api.events(job_id, after_id=found[-1]["id"] if found else 0):
            found += page
        return found

    def metrics(self, job_id: int) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        while page := self.api.metrics(job_id, after_id=found[-1]["id"] if found else 0):
            found += page
        return found

    def final_mse(self, job_id: int) -> float | None:
        after = 0
        value = None
        while page := self.api.logs(job_id, after_id=after):
            after = page[-1]["id"]
            for line in page:
                if match := FINAL_MSE.search(line["line"]):
                    value = float(match.group(1))
        return value

    def members(self, job_id: int) -> list[str]:
        """Nodes with a worker of the job now (by their processes, not the controller's view)."""
        names = set()
        for proc in self.c.job_workers(job_id):
            with suppress(psutil.Error):
                names.add(proc.environ().get("RELAUNCH_NODE_NAME", ""))
        return sorted(n for n in names if n in self.live)

    def training_after(self, job_id: int, since: float) -> tuple[float, int, int] | None:
        """The first step of a training (re)start later than ``since``: (time, world, resumed
        from); None if training has not started again since."""
        starts = [
            e
            for e in self.events(job_id)
            if e["kind"] in ("resumed", "training_started") and ts(e["time"]) > since
        ]
        if not starts:
            return None
        begun = ts(starts[0]["time"])
        for m in self.metrics(job_id):
            if ts(m["time"]) > begun:
                return (
                    ts(m["time"]),
                    m["world_size"],
                    starts[0]["data"].get("resumed_from_step") or 0,
                )
        return None

    def settled(self, job_id: int) -> bool:
        """Training, at the world size the live nodes allow, after its last (re)start."""
        job = self.api.job(job_id)
        if job["state"] != "RUNNING":
            return False
        alive = sum(n["state"] == "ALIVE" for n in self.api.nodes())
        if job["world_size"] != min(alive, MAX_NODES):
            return False
        starts = [e for e in self.events(job_id) if e["kind"] in ("resumed", "training_started")]
        if not starts:
            return False
        last = ts(starts[-1]["time"])
        return any(ts(m["time"]) > last for m in self.metrics(job_id)[-5:])

    def settled_or_ended(self, job_id: int) -> bool:
        """Nothing more to wait for: settled, or the job is over (a campaign that waits on
        an ended job only loses time)."""
        return self.api.job(job_id)["state"] in TERMINAL or self.settled(job_id)

    def last_snapshot_before(self, job_id: int, at: float) -> int | None:
        steps = [s["step"] for s in self.api.snapshots(job_id) if ts(s["created_at"]) <= at]
        return max(steps) if steps else None

    # ----- the run ---------------------------------------------------------------

    def reference(self, epochs: int) -> float | None:
        """Final MSE of the same job undisturbed (no step delay: the delay changes no number)."""
        job_id = self.api.submit(chaos_spec("chaos-reference", epochs, 0.0, 3))["id"]
        until("the undisturbed run", lambda: self.api.job(job_id)["state"] in TERMINAL, 600)
        job = self.api.job(job_id)
        self.log(f"undisturbed run: {job['state']}, world {job['world_size']}")
        return self.final_mse(job_id)

    def run(
        self,
        minutes: float,
        interval_s: float,
        epochs: int,
        step_delay: float,
        max_faults: int | None = None,
        recovery_timeout_s: float = 180,
    ) -> CampaignResult:
        reference = self.reference(epochs)
        self.log(f"undisturbed final MSE {reference}")
        job_id = self.api.submit(chaos_spec("chaos", epochs, step_delay, 1000))["id"]
        if not until("training", lambda: self.settled(job_id), 300):
            raise RuntimeError(f"job {job_id} never trained on the cluster")
        self.began = time.time()
        end = self.began + minutes * 60
        next_at = self.began + interval_s
        drawn = 0
        while time.time() < end and (max_faults is None or drawn < max_faults):
            time.sleep(max(0.0, next_at - time.time()))
            if self.api.job(job_id)["state"] in TERMINAL:
                self.log("the job ended before the campaign did")
                break
            kind = self.draw(job_id)
            drawn += 1
            before = len(self.faults)
            self.inject(job_id, kind, recovery_timeout_s)
            if not until("settled", lambda: self.settled_or_ended(job_id), 60):
                self.faults[-1].note += "not settled 60 s after; "
            for fault in self.faults[before:]:  # a node kill brings its replacement
                fault.spent_s = round(time.time() - fault.at, 1)
            next_at = max(next_at + interval_s, time.time() + 1)
        window = (self.began, time.time())
        job = until(
            "the job to end",
            lambda: (j := self.api.job(job_id))["state"] in TERMINAL and j,
            max(900.0, minutes * 90),
        )
        job = job or self.api.job(job_id)
        self.attribute_resumes(job_id)
        goodput, wall = self.goodput(job_id)
        campaign_goodput, campaign_s = self.goodput(job_id, window)
        until("no process of the job", lambda: not self.c.job_processes(job_id), 30)
        leftover = [f"pid {p.pid} {p.name()}" for p in self.c.job_processes(job_id)]
        timeline = [
            f"{ts(e['time']) - self.began:8.1f} {e['kind']}: {e['message']}"
            for e in self.events(job_id)
        ]
        return CampaignResult(
            self.seed,
            job,
            self.faults,
            reference,
            self.final_mse(job_id),
            goodput,
            wall,
            campaign_goodput,
            campaign_s,
            leftover,
            [],
            self.node_timeout(),
            timeline,
        )

    def finish(self, result: CampaignResult) -> CampaignResult:
        """After the cluster is gone: what is left of its processes, what its log holds."""
        marker = str(self.work)
        for proc in psutil.process_iter(["cmdline"]):
            with suppress(psutil.Error):
                cmd = " ".join(proc.info["cmdline"] or [])
                if marker in cmd or proc.environ().get("RELAUNCH_SNAPSHOT_DIR", "").startswith(
                    marker
                ):
                    result.leftover.append(f"pid {proc.pid} {cmd[:120]}")
        log = self.work / "controller" / "controller.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        result.server_errors = [line for line in lines if SERVER_ERROR.search(line)]
        return result

    def draw(self, job_id: int) -> str:
        members = self.members(job_id)
        eligible = {
            "worker_kill": bool(members),
            "node_kill": len(members) >= 2,
            "node_freeze": len(members) >= 2,
            "network_cut": len(members) >= 2,
            "agent_restart": len(members) >= 2,
            "controller_restart": True,
            "node_add": len(self.live) < self.max_live_nodes,
        }
        for _ in range(2 * len(KINDS)):
            if not self.deck:
                self.deck = list(KINDS)
                self.rng.shuffle(self.deck)
            kind = self.deck.pop()
            if eligible[kind]:
                return kind
            self.deck.insert(0, kind)
        return "controller_restart"

    def inject(self, job_id: int, kind: str, timeout_s: float) -> None:
        job = self.api.job(job_id)
        members = self.members(job_id)
        node = self.rng.choice(members) if members and kind not in NODELESS else None
        at = time.time()
        fault = Fault(
            index=len(self.faults) + 1,
            kind=kind,
            node=node,
            at=at,
            at_s=round(at - self.began, 1),
            world_before=job["world_size"],
            charged=kind in CHARGED,
            last_snapshot_before=self.last_snapshot_before(job_id, at),
        )
        restarts = job["restart_count"]
        self.faults.append(fault)
        self.log(f"#{fault.index} {kind} {node or ''} at {fault.at_s} s")
        getattr(self, f"_{kind}")(job_id, fault, timeout_s)
        with suppress(Exception):
            fault.restarts_observed = self.api.job(job_id)["restart_count"] - restarts
        self.log(
            f"   world {fault.world_before} -> {fault.world_after}, training again after "
            f"{fault.training_again_s} s {fault.note}"
        )
        if kind == "node_kill":
            self.inject(job_id, "node_add", timeout_s)
            self.faults[-1].note = f"replaces {node}"

    def _wait_training(self, job_id: int, fault: Fault, timeout_s: float) -> None:
        found = until("training again", lambda: self.training_after(job_id, fault.at), timeout_s)
        if found:
            when, fault.world_after, _ = found
            fault.training_again_s = round(when - fault.at, 1)
        else:
            fault.note += "no training again in time; "

    # ----- the faults ------------------------------------------------------------

    def _worker_kill(self, job_id: int, fault: Fault, timeout_s: float) -> None:
        workers = [p for p in self.c.job_workers(job_id) if self._node_of(p) == fault.node]
        if not workers:
            fault.note += "no worker found; "
            return
        workers[0].kill()
        self._wait_training(job_id, fault, timeout_s)

    def _node_kill(self, job_id: int, fault: Fault, timeout_s: float) -> None:
        assert fault.node is not None
        self.c.kill_node(fault.node)
        self.live.remove(fault.node)
        self._wait_training(job_id, fault, timeout_s)

    def _node_freeze(self, job_id: int, fault: Fault, timeout_s: float) -> None:
        assert fault.node is not None
        frozen = self.c.signal_node(fault.node, signal.SIGSTOP)
        try:
            self._hold_out(job_id, fault, timeout_s)
        finally:
            for proc in frozen:
                with suppress(psutil.NoSuchProcess):
                    proc.send_signal(signal.SIGCONT)

    def _network_cut(self, job_id: int, fault: Fault, timeout_s: float) -> None:
        assert fault.node is not None
        self.hosts.cut(fault.node)
        try:
            self._hold_out(job_id, fault, timeout_s)
        finally:
            self.hosts.mend(fault.node)

    def _hold_out(self, job_id: int, fault: Fault, timeout_s: float) -> None:
        """Until the others train again, and for longer than the node timeout."""
        self._wait_training(job_id, fault, timeout_s)
        time.sleep(max(0.0, fault.at + self.node_timeout() + 2 - time.time()))

    def _agent_restart(self, job_id: int, fault: Fault, timeout_s: float) -> None:
        assert fault.node is not None
        self.c.stop(fault.node)  # SIGTERM: the agent stops its part and leaves
        self._wait_training(job_id, fault, timeout_s)
        below_max = (self.api.job(job_id)["world_size"] or 0) < MAX_NODES
        self.restart_agent(fault.node)
        if not below_max:
            fault.note += "job at MAX when it came back; "
            return
        registered = until("registered again", lambda: self._registered(fault.node, fault.at), 60)
        if registered is None:
            fault.note += "never registered again; "
            return
        joined = until(
            "back in the attempt", lambda: self._joined(job_id, fault.node, registered), 60
        )
        if joined is not None:
            fault.rejoin_s = round(joined - registered, 1)

    def _controller_restart(self, job_id: int, fault: Fault, timeout_s: float) -> None:
        step = self.api.job(job_id)["last_step"] or 0
        self.c.stop("controller", signal.SIGKILL)
        time.sleep(1.0)
        self.c.start_controller(self._controller_env())

        def progress() -> bool:
            return (self.api.job(job_id)["last_step"] or 0) > step

        if until("progress reported again", progress, timeout_s):
            fault.training_again_s = round(time.time() - fault.at, 1)
        fault.note += "the workers train on; seconds until the controller shows progress; "
        fault.world_after = self.api.job(job_id)["world_size"]

    def _node_add(self, job_id: int, fault: Fault, timeout_s: float) -> None:
        fault.node = self.add_node()
        if (fault.world_before or 0) >= MAX_NODES:
            fault.world_after = fault.world_before
            fault.note += "a spare: the job is at MAX; "
            return
        self._wait_training(job_id, fault, timeout_s)

    def _node_of(self, proc: psutil.Process) -> str | None:
        with suppress(psutil.Error):
            return proc.environ().get("RELAUNCH_NODE_NAME")
        return None

    def _registered(self, name: str | None, since: float) -> float | None:
        for node in self.api.nodes():
            if node["name"] == name and node["state"] == "ALIVE":
                at = ts(node["registered_at"])
                return at if at > since else None
        return None

    def _joined(self, job_id: int, name: str | None, since: float) -> float | None:
        for attempt in self.api.job(job_id)["attempts"]:
            for member in attempt["members"]:
                if member["node_name"] == name and ts(member["joined_at"]) >= since:
                    return ts(member["joined_at"])
        return None

    # ----- afterwards ------------------------------------------------------------

    def attribute_resumes(self, job_id: int) -> None:
        """Each training restart goes to the last fault before it."""
        for event in self.events(job_id):
            if event["kind"] != "resumed":
                continue
            when = ts(event["time"])
            earlier = [f for f in self.faults if f.at < when]
            if earlier:
                earlier[-1].resumed_from.append(event["data"]["resumed_from_step"])

    def goodput(
        self, job_id: int, window: tuple[float, float] | None = None
    ) -> tuple[float | None, float | None]:
        """(share, seconds): the share of the wall time, from the first training start to
        the last step (or of ``window``), spent on steps that were kept: a step is lost
        when a later restart resumed from a snapshot before it. Each run of training,
        from its start through its progress reports, is cut at the steps of the later
        resumes."""
        starts = [
            (ts(e["time"]), e["data"].get("resumed_from_step") or 0)
            for e in self.events(job_id)
            if e["kind"] in ("resumed", "training_started")
        ]
        metrics = [(ts(m["time"]), m["step"]) for m in self.metrics(job_id)]
        if not starts or not metrics:
            return None, None
        starts.sort()
        runs: list[list[tuple[float, int]]] = [[s] for s in starts]
        for when, step in sorted(metrics):
            index = (
                max(i for i, s in enumerate(starts) if s[0] <= when) if when >= starts[0][0] else 0
            )
            runs[index].append((when, step))
        lo, hi = window or (starts[0][0], max(m[0] for m in metrics))
        kept = 0.0
        for i, points in enumerate(runs):
            keep_to = min((s[1] for s in starts[i + 1 :]), default=math.inf)
            for (t0, s0), (t1, s1) in itertools.pairwise(points):
                if s1 <= s0:
                    continue
                share = min(max((min(s1, keep_to) - s0) / (s1 - s0), 0.0), 1.0)
                kept += share * overlap(t0, t1, lo, hi)
        wall = hi - lo
        return (round(kept / wall, 4) if wall > 0 else None), round(wall, 1)


def overlap(t0: float, t1: float, lo: float, hi: float) -> float:
    return max(0.0, min(t1, hi) - max(t0, lo))


# ----- the command -------------------------------------------------------------------


def print_report(result: CampaignResult, console: Console) -> None:
    table = Table(title=f"fault campaign, seed {result.seed}")
    columns = ("#", "at s", "fault", "node", "world", "training again", "charged", "spent")
    for col in (*columns, "note"):
        table.add_column(col)
    for f in result.faults:
        charged = "yes" if f.charged else "no"
        if f.restarts_observed is not None and f.restarts_observed != int(f.charged):
            charged += f" (observed {f.restarts_observed})"
        again = "-" if f.training_again_s is None else f"{f.training_again_s:.1f} s"
        if f.rejoin_s is not None:
            again += f" (rejoined {f.rejoin_s:.1f} s after registering)"
        table.add_row(
            str(f.index),
            f"{f.at_s:.0f}",
            f.kind,
            f.node or "",
            f"{f.world_before} → {f.world_after if f.world_after is not None else '?'}",
            again,
            charged,
            "-" if f.spent_s is None else f"{f.spent_s:.1f} s",
            f.note.strip("; "),
        )
    console.print(table)
    console.print(
        f"goodput {percent(result.campaign_goodput)} of the {result.campaign_s or 0:.0f} s "
        f"faults came; {percent(result.goodput)} of the job's {result.wall_s or 0:.0f} s "
        "of training"
    )
    targets = result.targets()
    console.print(
        f"frozen or cut off: the others trained again after "
        f"{seconds(targets['held_out_training_again_s'])} (target ≤ "
        f"{targets['held_out_limit_s']:.0f} s), restarts charged {targets['held_out_charged']}"
        f"; a restarted agent was back in the attempt {seconds(targets['agent_rejoin_s'])} "
        "after it registered (target ≤ 5 s)"
    )
    for check in result.checks():
        mark = "[green]ok[/]" if check.ok else "[red]FAILED[/]"
        console.print(f"{mark} {check.name}: {check.detail}")


def seconds(values: list[float | None]) -> str:
    shown = ", ".join("never" if v is None else f"{v:.1f}" for v in values)
    return f"{shown} s" if values else "- (none)"


def percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long faults come")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between faults")
    parser.add_argument("--json", type=Path, help="write the fault log and checks here")
    parser.add_argument(
        "--epochs", type=int, default=0, help="job length (default: outlasts the campaign)"
    )
    parser.add_argument("--step-delay", type=float, default=0.1)
    parser.add_argument("--nodes", type=int, default=3, help="nodes at the start")
    args = parser.parse_args(argv)
    # At world size 3 an epoch is 11 steps of a little over step_delay: undisturbed, the
    # job would last about the campaign; faults make it outlast the campaign.
    epochs = args.epochs or max(10, math.ceil(args.minutes * 60 / (11 * args.step_delay)))
    console = Console(width=None if sys.stdout.isatty() else 160)
    work = Path(tempfile.mkdtemp(prefix="relaunch-chaos-"))
    work.chmod(0o711)  # jobs run as users of their own and must pass through it
    campaign = Campaign(work, args.seed, nodes=args.nodes, log=console.print)
    with campaign.running():
        result = campaign.run(args.minutes, args.interval, epochs, args.step_delay)
    campaign.finish(result)
    print_report(result, console)
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=2))
    console.print(f"logs in {work}")
    return 0 if all(c.ok for c in result.checks()) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # tear down on SIGTERM too
    sys.exit(main())
