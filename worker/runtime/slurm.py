"""Who a task started by Slurm's ``srun`` is, read from the variables srun sets.

``srun`` starts every task of a job step itself and tells each one its place:
``SLURM_PROCID`` (global rank), ``SLURM_NTASKS`` (world size), ``SLURM_LOCALID``
(rank on its node), ``SLURM_NODEID`` (the node's index in the step) and the
tasks per node (``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE`` or
``SLURM_NTASKS_PER_NODE``, the first that is set; none: all tasks on one node).
Nothing tells the tasks where to meet, so they agree on it without talking:

- the address is ``MASTER_ADDR`` when set, else the first host of the step's
  node list (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``): srun places
  task 0 there. ``scontrol show hostnames`` expands the list where it is
  installed; elsewhere ``first_host`` reads the compact form
  (``node[01-03,07],gpu5`` -> ``node01``);
- the port is ``MASTER_PORT`` when set, else ``10000 + SLURM_JOB_ID % 20000``
  (``port_for_job``): the same on every node, and below Linux's ephemeral range
  (32768 and up), where a port the kernel handed out would clash; jobs whose ids
  differ by less than 20000 get different ports, but two steps of one job that run
  at once on the same first node need their own ``MASTER_PORT``.

A process started straight from a batch script (not through ``srun``) also sees
``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS``; with more than one task it
waits for peers that never come. Start the tasks with ``srun``. A step of one task
(``SLURM_NTASKS=1``: ``srun -n1``, a one-task batch script) is no Slurm world: it
runs alone, on a private loopback store, like a process nobody launched.

Pure functions but ``master_host``, which may run ``scontrol``; no torch.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PROCID_ENV = "SLURM_PROCID"
NTASKS_ENV = "SLURM_NTASKS"
LOCALID_ENV = "SLURM_LOCALID"
NODEID_ENV = "SLURM_NODEID"
JOB_ID_ENV = "SLURM_JOB_ID"
# Tasks per node, the first set wins: the step's own layout before the job's, both in
# the ``2(x3),1`` form; then the one number of ``--ntasks-per-node``.
TASKS_PER_NODE_ENVS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
NTASKS_PER_NODE_ENV = "SLURM_NTASKS_PER_NODE"
NODELIST_ENVS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")

PORT_BASE = 10000
PORT_SPAN = 20000

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASK_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


@dataclass(frozen=True)
class SlurmTask:
    """One task's place in its step and where the step's tasks meet."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int


def is_srun_task(environ: Mapping[str, str]) -> bool:
    """Whether srun's per-task variables are set (``SLURM_PROCID`` and ``SLURM_NTASKS``)
    for a step of more than one task. A malformed ``SLURM_NTASKS`` counts, so that
    ``slurm_task`` names it."""
    if not all((environ.get(name) or "").strip() for name in (PROCID_ENV, NTASKS_ENV)):
        return False
    try:
        return int(environ[NTASKS_ENV]) != 1
    except ValueError:
        return True


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets: ``a[1,2],b`` -> ``["a[1,2]", "b"]``."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"node list {text!r} has an unmatched ']'")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"node list {text!r} has an unmatched '['")
    parts.append(text[start:])
    return parts


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a compact Slurm node list, in order.

    ``node[01-03,07],gpu5`` -> ``node01 node02 node03 node07 gpu5``; a range keeps its
    zero padding (the width of its first number); several bracket groups in one name
    multiply (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``). Raises ``ValueError`` on an
    empty list, an unbalanced bracket or a range that is not ``N`` or ``N-M`` with N <= M.
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("the node list is empty")
    hosts: list[str] = []
    for part in _split_top_level(text):
        if not part:
            raise ValueError(f"node list {nodelist!r} has an empty name")
        hosts.extend(_expand_name(part, nodelist))
    return hosts


def _expand_name(name: str, nodelist: str) -> list[str]:
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.find("]", open_at)
    prefix, body, rest = name[:open_at], name[open_at + 1 : close_at], name[close_at + 1 :]
    tails = _expand_name(rest, nodelist) if rest else [""]
    return [
        f"{prefix}{number}{tail}" for number in _expand_ranges(body, nodelist) for tail in tails
    ]


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    numbers: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise ValueError(f"node list {nodelist!r}: {item!r} is not a number or range")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"node list {nodelist!r}: range {item!r} runs backwards")
        width = len(first)
        numbers.extend(str(n).zfill(width) for n in range(int(first), int(last) + 1))
    return numbers


def first_host(nodelist: str) -> str:
    """The first host of a compact node list (``node[01-03,07],gpu5`` -> ``node01``)."""
    return expand_nodelist(nodelist)[0]


def master_host(nodelist: str) -> str:
    """The first host of ``nodelist``: ``scontrol show hostnames`` where scontrol is on
    the PATH and answers, else ``first_host``."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            result = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("scontrol could not expand %r (%s); reading it here", nodelist, exc)
        else:
            hosts = result.stdout.split()
            if hosts:
                return hosts[0]
    return first_host(nodelist)


def tasks_on_node(tasks_per_node: str, node_rank: int) -> int:
    """The tasks on node ``node_rank`` from Slurm's ``2(x3),1`` form (three nodes with 2,
    then one with 1). Raises ``ValueError`` on another form or a node past the list."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = _TASK_COUNT.match(item.strip())
        if match is None:
            raise ValueError(f"tasks per node {tasks_per_node!r}: {item!r} is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if not 0 <= node_rank < len(counts):
        raise ValueError(f"tasks per node {tasks_per_node!r} lists no node {node_rank}")
    return counts[node_rank]


def port_for_job(job_id: int) -> int:
    """``10000 + job_id % 20000``: the port every task of the job derives alike."""
    return PORT_BASE + job_id % PORT_SPAN


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = (environ.get(name) or "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def slurm_task(
    environ: Mapping[str, str], resolve_host: Callable[[str], str] = master_host
) -> SlurmTask:
    """This task's ``SlurmTask`` from srun's variables (``is_srun_task`` must hold);
    ``resolve_host`` turns the node list into the master's host.

    Defaults: ``SLURM_LOCALID`` and ``SLURM_NODEID`` 0; tasks per node the world
    size. Raises ``ValueError`` naming the variable that is malformed, or saying what
    is missing to find the address or port.
    """
    rank = _int(environ, PROCID_ENV)
    world_size = _int(environ, NTASKS_ENV)
    if rank is None or world_size is None:
        raise ValueError(f"{PROCID_ENV} and {NTASKS_ENV} must both be set")
    node_rank = _int(environ, NODEID_ENV) or 0
    layout = next((environ[n] for n in TASKS_PER_NODE_ENVS if (environ.get(n) or "").strip()), "")
    if layout:
        local_world_size = tasks_on_node(layout, node_rank)
    else:
        local_world_size = _int(environ, NTASKS_PER_NODE_ENV) or world_size
    master_addr = (environ.get("MASTER_ADDR") or "").strip()
    if not master_addr:
        nodelist = next((environ[n] for n in NODELIST_ENVS if (environ.get(n) or "").strip()), "")
        if not nodelist:
            raise ValueError(f"set MASTER_ADDR or one of {', '.join(NODELIST_ENVS)}")
        master_addr = resolve_host(nodelist)
    master_port = _int(environ, "MASTER_PORT")
    if master_port is None:
        job_id = _int(environ, JOB_ID_ENV)
        if job_id is None:
            raise ValueError(f"set MASTER_PORT or {JOB_ID_ENV}")
        master_port = port_for_job(job_id)
    local_rank = _int(environ, LOCALID_ENV) or 0
    if not 0 <= rank < world_size:
        raise ValueError(f"{PROCID_ENV}={rank} is outside [0, {NTASKS_ENV}={world_size})")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"{LOCALID_ENV}={local_rank} is outside [0, {local_world_size})")
    return SlurmTask(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
    )
