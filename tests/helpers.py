"""Helpers for any test: waiting for a condition, a clock that moves only when told."""

from __future__ import annotations

import os
import stat
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from contract.protocol import DEVICE_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
# Where the tests start clusters of real processes (marked ``e2e``), from the repository.
CLUSTER_DIRS = ("tests/e2e", "tests/deploy")
_LAUNCHER_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
# The CPU and gloo, asked for as the node agent asks for them (RELAUNCH_DEVICE): a test
# about the CPU path, or one that runs several ranks on one host, says so and runs
# alike on a GPU host, where the ranks would otherwise pick CUDA (and NCCL refuses
# ranks that share a GPU).
ON_CPU = {DEVICE_ENV: "cpu"}


def work_unit(nodeid: str) -> str:
    """What one of ``pytest -n``'s workers takes at a time (``make test``): every e2e and
    deploy test at once, so that they run one after another on one worker as they would
    alone (each starts a cluster whose timeouts are set for a machine that is not also
    running another cluster); any other test with the rest of its file."""
    path = nodeid.split("::", 1)[0]
    return "clusters" if starts_clusters(path) else path


def starts_clusters(path: str) -> bool:
    """Whether the test at ``path`` (a node id, or its file, from the repository) is one
    of those that start clusters of real processes (``CLUSTER_DIRS``, marked ``e2e``)."""
    return any(path.startswith(f"{d}/") for d in CLUSTER_DIRS)


def subprocess_environ() -> dict[str, str]:
    """The current environment without launcher (torchrun's, Slurm's) or relaunch
    variables, the repository on PYTHONPATH, one OpenMP thread."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("RELAUNCH_", "TORCHELASTIC_", "SLURM_"))
        and key not in _LAUNCHER_VARIABLES
        and key not in {"MASTER_ADDR", "MASTER_PORT"}
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env["OMP_NUM_THREADS"] = "1"
    return env


def wait_for(
    what: str, predicate: Callable[[], Any], timeout_s: float = 40.0, interval_s: float = 0.1
) -> Any:
    """Poll ``predicate`` until it returns something true, and return that;
    fail the test with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def let_jobs_pass(path: Path) -> Path:
    """Add the search bit, never the read bit, for group and others to ``path`` and each
    directory above it: a job's user (another uid) may then reach what lies under it,
    without listing anything. Only as root, where the agents run jobs as their own users."""
    if os.geteuid() != 0:
        return path
    for directory in (path, *path.parents):
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            os.chmod(directory, stat.S_IMODE(mode) | 0o011)
    return path


def forget_classified_callables() -> None:
    """Empty FastAPI's caches of the callables it has classified (coroutine, generator),
    if FastAPI is loaded. Each holds up to 4,096 routes' and dependencies' callables; a
    controller's app has closures of its own among them, so the cache kept every app a
    test made, with its engine, metrics and threads' locks, until evicted: about 80 apps
    at a time, 7 million objects in the tests of ``tests/service`` run in one process,
    which every full collection of the garbage collector scanned (130 s of collections
    for those tests, 10 s for one ``gc.collect()`` late in a run)."""
    models = sys.modules.get("fastapi.dependencies.models")
    for value in vars(models).values() if models is not None else ():
        clear = getattr(value, "cache_clear", None)
        if callable(clear):
            clear()
