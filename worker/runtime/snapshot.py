"""Training snapshots: what they hold, how they are written and how they are found.

A snapshot file is ``snapshot-{step:09d}.pt`` in the snapshot directory and holds
only plain dicts, lists, numbers, strings and tensors, so it loads with
``torch.load(weights_only=True)``. Writes are atomic: a temporary file in the
same directory is written, flushed and fsynced, renamed over the final name and
the directory fsynced; only then are older snapshots pruned. A crash therefore
leaves the previous snapshots intact plus, at worst, a temporary file that the
loader ignores and the next save removes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from worker.runtime.rng import RngState

logger = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1
_SNAPSHOT_RE = re.compile(r"^snapshot-(\d+)\.pt$")
_TMP_SUFFIX = ".tmp"
# A temporary file this old is left over by a crash even if its writer's pid is
# unknown here (another host on a shared file system).
STALE_TMP_AGE_S = 600.0


@dataclass
class Snapshot:
    """Everything needed to continue training from the end of global step ``step``.

    ``step`` counts optimizer steps done in all epochs; ``epoch`` is the epoch the
    next step belongs to; ``samples_consumed`` is how many samples of that epoch's
    permutation all ranks together have consumed (see ``sampler``), 0 at an epoch
    boundary. ``world_size`` is the world size at save time. ``model_state`` is the
    unwrapped module's ``state_dict`` (no DDP ``module.`` prefix).
    """

    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    step: int
    epoch: int
    samples_consumed: int
    world_size: int
    seed: int
    rng: RngState
    scheduler_state: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("step", "epoch", "samples_consumed"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"snapshot {name} must be an int >= 0, got {value!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"snapshot world_size must be an int >= 1, got {self.world_size!r}")

    def to_payload(self) -> dict[str, Any]:
        """A plain dict that ``torch.load(weights_only=True)`` can read back."""
        return {
            "format": SNAPSHOT_FORMAT,
            "model_state": self.model_state,
            "optimizer_state": self.optimizer_state,
            "scheduler_state": self.scheduler_state,
            "step": self.step,
            "epoch": self.epoch,
            "samples_consumed": self.samples_consumed,
            "world_size": self.world_size,
            "seed": self.seed,
            "rng": self.rng.to_payload(),
            "extra": self.extra,
        }

    @classmethod
    def from_payload(cls, payload: Any) -> Snapshot:
        """Rebuild from ``to_payload``'s dict; ``ValueError`` if it is not one."""
        if not isinstance(payload, dict):
            raise ValueError(f"snapshot payload must be a dict, got {type(payload).__name__}")
        if payload.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"unsupported snapshot format {payload.get('format')!r}")
        try:
            return cls(
                model_state=payload["model_state"],
                optimizer_state=payload["optimizer_state"],
                scheduler_state=payload.get("scheduler_state"),
                step=payload["step"],
                epoch=payload["epoch"],
                samples_consumed=payload["samples_consumed"],
                world_size=payload["world_size"],
                seed=payload["seed"],
                rng=RngState.from_payload(payload["rng"]),
                extra=payload.get("extra") or {},
            )
        except KeyError as exc:
            raise ValueError(f"snapshot payload lacks {exc.args[0]!r}") from None


def snapshot_path(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"snapshot-{step:09d}.pt"


def list_snapshots(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every snapshot file in ``directory``, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _SNAPSHOT_RE.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname()) or "host"


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(
    obj: Any, path: str | os.PathLike[str], before_commit: Callable[[], None] | None = None
) -> Path:
    """``torch.save`` ``obj`` to ``path`` so that ``path`` is either old or complete.

    Writes ``.{name}.{host}.{pid}.{token}.tmp`` beside ``path``, fsyncs it, calls
    ``before_commit`` (a fence that raises to refuse the write), renames it over
    ``path`` and fsyncs the directory. The temporary file is removed if anything
    fails before the rename.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(
        f".{target.name}.{_host_tag()}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
    )
    try:
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if before_commit is not None:
            before_commit()
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_directory(target.parent)
    return target


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_stale_tmp(entry: Path, now: float) -> bool:
    """A temporary file whose writer is gone: a dead pid on this host, or too old."""
    parts = entry.name[: -len(_TMP_SUFFIX)].split(".")
    # ["", "snapshot-000000012", "pt", host, pid, token]
    if len(parts) == 6 and parts[3] == _host_tag() and parts[4].isdigit():
        pid = int(parts[4])
        if pid != os.getpid() and not _pid_alive(pid):
            return True
    try:
        return now - entry.stat().st_mtime > STALE_TMP_AGE_S
    except FileNotFoundError:
        return False


def _remove_stale_tmp_files(directory: Path) -> None:
    now = time.time()
    for entry in directory.glob(f".snapshot-*{_TMP_SUFFIX}"):
        if _is_stale_tmp(entry, now):
            logger.info("removing temporary file left by a crash: %s", entry)
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()


def save_snapshot(
    directory: str | os.PathLike[str],
    snapshot: Snapshot,
    keep: int = 2,
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """Write ``snapshot`` atomically as ``snapshot-{step:09d}.pt`` and prune.

    After the new file is durably in place, older snapshots are removed so that
    the new one and the ``keep - 1`` newest older ones remain; a snapshot with a
    higher step than the new one (a stale writer's, or one that failed to load)
    is left alone. Temporary files of crashed writers are removed too.
    ``before_commit`` runs just before the rename (see ``atomic_torch_save``).
    Raises ``ValueError`` if ``keep < 1``.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_files(root)
    path = atomic_torch_save(
        snapshot.to_payload(), snapshot_path(root, snapshot.step), before_commit
    )
    older = [p for step, p in list_snapshots(root) if step < snapshot.step]
    for stale in older[: max(0, len(older) - (keep - 1))]:
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    return path


def load_latest_snapshot(directory: str | os.PathLike[str]) -> Snapshot | None:
    """The newest snapshot in ``directory`` that loads, or ``None`` if none does.

    Files are tried newest step first with ``weights_only=True`` onto the CPU; a
    file that is truncated, corrupt or not a snapshot is skipped with a warning.
    """
    for step, path in reversed(list_snapshots(directory)):
        try:
            payload = torch.load(path, weights_only=True, map_location="cpu")
            snapshot = Snapshot.from_payload(payload)
        except Exception as exc:  # any unreadable file: fall back to an older one
            logger.warning("skipping unreadable snapshot %s (step %d): %s", path, step, exc)
            continue
        if snapshot.step != step:
            logger.warning("snapshot %s holds step %d, not %d", path, snapshot.step, step)
        return snapshot
    return None
