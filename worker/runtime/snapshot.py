"""Training snapshots: what they hold, how they are written, verified and found.

A snapshot is two files in the snapshot location (see ``storage``):

- ``snapshot-{step:09d}-{token}.pt``, the data: only plain dicts, lists, numbers,
  strings and tensors, so it loads with ``torch.load(weights_only=True)``. The
  random token keeps a stale writer from ever replacing a committed file.
- ``snapshot-{step:09d}.json``, the manifest, written last: step, epoch, world
  size, the data file's name, its size in bytes and sha256, the time, the job and attempt.

A snapshot without a manifest does not exist, and one whose data does not match
its manifest is skipped with the reason, in favour of the one before it. Both
files are written atomically (temporary name, fsync, rename, directory fsync),
so a crash at any point leaves the previous snapshots intact plus, at worst,
files the loader ignores and a later save removes. Older snapshots are pruned
only after a newer one is committed and its data file checked in place.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

import torch

from worker.runtime.rng import RngState
from worker.runtime.storage import Storage, open_storage

logger = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1
MANIFEST_FORMAT = 1
_MANIFEST_RE = re.compile(r"^snapshot-(\d{9})\.json$")
_DATA_RE = re.compile(r"^snapshot-(\d{9})-[0-9a-f]{8}\.pt$")
# Named points of a save, for fault drills (``fault`` hooks): inside the data
# write, after the data is durable but before its rename, and between the data
# file's rename and the manifest's.
FAULT_POINTS = ("during_write", "before_rename", "before_manifest")
Fault = Callable[[str, int], None]  # (point, step of the snapshot being saved)

Location = str | os.PathLike[str] | Storage


@dataclass
class TrainingState:
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
    scaler_state: dict[str, Any] | None = None
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
            "scaler_state": self.scaler_state,
            "step": self.step,
            "epoch": self.epoch,
            "samples_consumed": self.samples_consumed,
            "world_size": self.world_size,
            "seed": self.seed,
            "rng": self.rng.to_payload(),
            "extra": self.extra,
        }

    @classmethod
    def from_payload(cls, payload: Any) -> TrainingState:
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
                scaler_state=payload.get("scaler_state"),
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


@dataclass(frozen=True)
class Manifest:
    """What was committed: the data file's name, size and checksum, and where training was.

    ``time`` is the commit time (ISO 8601, UTC). ``job_id`` and ``attempt_id``
    name the writer when the node agent set them. ``size_bytes`` is stored under
    the key ``size`` in the file, as every manifest so far was written.
    """

    step: int
    epoch: int
    samples_consumed: int
    world_size: int
    file: str
    size_bytes: int
    sha256: str
    time: str
    job_id: str | None = None
    attempt_id: str | None = None
    format: int = MANIFEST_FORMAT

    def to_json(self) -> bytes:
        fields = asdict(self)
        fields["size"] = fields.pop("size_bytes")
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a manifest; ``ValueError`` saying what is wrong if it is not one."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"manifest is not JSON: {exc}") from None
        if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
            raise ValueError("not a snapshot manifest of a known format")
        if "size" in raw:
            raw["size_bytes"] = raw.pop("size")
        try:
            manifest = cls(**raw)
        except TypeError as exc:
            raise ValueError(f"manifest fields do not fit: {exc}") from None
        if not _DATA_RE.match(manifest.file) or not re.fullmatch(r"[0-9a-f]{64}", manifest.sha256):
            raise ValueError("manifest names no valid data file or checksum")
        return manifest


def manifest_name(step: int) -> str:
    return f"snapshot-{step:09d}.json"


class _HashingWriter:
    """A write-only file that counts and hashes what passes through to ``handle``."""

    def __init__(self, handle: IO[bytes], fault: Callable[[str], None] | None) -> None:
        self._handle = handle
        self._fault = fault
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._fault is not None and self.bytes > 0:
            self._fault("during_write")
            self._fault = None
        self.sha256.update(data)
        self.bytes += len(data)
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()


def save_snapshot(
    location: Location,
    snapshot: TrainingState,
    keep: int = 2,
    before_commit: Callable[[], None] | None = None,
    fault: Fault | None = None,
) -> Manifest:
    """Write ``snapshot`` (data, then manifest) and prune; return its manifest.

    ``before_commit`` runs before each of the two files becomes visible (a
    fence that raises to refuse the write, see ``fence``); ``fault(point, step)``
    is called at each of ``FAULT_POINTS``, for drills. Once the manifest is
    committed and the data file's size checked, older snapshots are removed so
    that this one and the ``keep - 1`` newest older ones remain; snapshots with
    a higher step than this one (a stale writer's, or ones that failed to load)
    are left alone. Raises ``ValueError`` if ``keep < 1``, and what the storage
    raises (``OSError`` on a full disk) with nothing committed.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    storage = open_storage(location)

    def hook(point: str) -> None:
        if fault is not None:
            fault(point, snapshot.step)

    storage.remove_stale_temporaries()
    data_name = f"snapshot-{snapshot.step:09d}-{secrets.token_hex(4)}.pt"
    hashed: list[_HashingWriter] = []

    def write_data(handle: IO[bytes]) -> None:
        writer = _HashingWriter(handle, hook)
        hashed.append(writer)
        torch.save(snapshot.to_payload(), writer)  # type: ignore[arg-type]

    storage.write(data_name, write_data, before_commit, lambda: hook("before_rename"))
    hook("before_manifest")
    manifest = Manifest(
        step=snapshot.step,
        epoch=snapshot.epoch,
        samples_consumed=snapshot.samples_consumed,
        world_size=snapshot.world_size,
        file=data_name,
        size_bytes=hashed[0].bytes,
        sha256=hashed[0].sha256.hexdigest(),
        time=datetime.now(UTC).isoformat(),
        job_id=snapshot.extra.get("job_id"),
        attempt_id=snapshot.extra.get("attempt_id"),
    )

    def write_manifest(handle: IO[bytes]) -> None:
        handle.write(manifest.to_json())

    storage.write(manifest_name(snapshot.step), write_manifest, before_commit)
    if storage.size(data_name) != manifest.size_bytes:
        raise OSError(
            f"{storage.path_of(data_name)} does not hold the {manifest.size_bytes} bytes written"
        )
    prune(storage, keep, snapshot.step)
    return manifest


def _manifest_names(names: Iterable[str]) -> list[tuple[int, str]]:
    """``(step, name)`` of every manifest file among ``names``, oldest first."""
    return sorted((int(m.group(1)), name) for name in names if (m := _MANIFEST_RE.match(name)))


def prune(location: Location, keep: int, committed_step: int) -> None:
    """Keep the ``keep`` newest snapshots up to ``committed_step``; drop older ones and
    data files that no manifest names below that step (crash leftovers)."""
    storage = open_storage(location)
    names = storage.names()
    manifests = _manifest_names(names)
    up_to = [(step, name) for step, name in manifests if step <= committed_step]
    doomed = up_to[: max(0, len(up_to) - keep)]
    kept_files: set[str] = set()
    for step, name in manifests:
        if (step, name) in doomed:
            continue
        try:
            kept_files.add(Manifest.from_json(storage.read(name)).file)
        except (OSError, ValueError):
            continue
    for _, name in doomed:  # the manifest first: a snapshot stops existing before its data goes
        storage.remove(name)
    for name in names:
        match = _DATA_RE.match(name)
        if match and int(match.group(1)) <= committed_step and name not in kept_files:
            storage.remove(name)


def list_snapshots(location: Location) -> list[tuple[int, Manifest]]:
    """``(step, manifest)`` of every snapshot with a readable manifest, oldest first.

    The data is not checked here; ``load_latest_snapshot`` does that.
    """
    storage = open_storage(location)
    found = []
    for step, name in _manifest_names(storage.names()):
        try:
            found.append((step, Manifest.from_json(storage.read(name))))
        except (OSError, ValueError):
            continue
    return found


SkipReporter = Callable[[int, str], None]


def load_latest_snapshot(
    location: Location, on_skip: SkipReporter | None = None
) -> tuple[TrainingState, Manifest] | None:
    """The newest snapshot whose data matches its manifest, or ``None`` if none does.

    Candidates are tried newest step first. A snapshot is skipped, with a
    warning and ``on_skip(step, reason)``, when its manifest is unreadable, its
    data file is missing, shorter or longer than recorded, fails the sha256
    check, or does not load with ``weights_only=True`` onto the CPU.
    """
    storage = open_storage(location)
    for step, name in reversed(_manifest_names(storage.names())):
        try:
            manifest = Manifest.from_json(storage.read(name))
            snapshot = _read_verified(storage, manifest)
        except FileNotFoundError as exc:
            reason = f"missing file: {exc.filename or exc}"
        except (OSError, ValueError) as exc:
            reason = str(exc)
        except Exception as exc:  # what torch.load raises on a file it cannot parse
            reason = f"does not load: {type(exc).__name__}: {exc}"
        else:
            if manifest.step == step and snapshot.step == step:
                return snapshot, manifest
            reason = f"manifest or data holds step {snapshot.step}, not {step}"
        logger.warning("skipping snapshot at step %d in %s: %s", step, storage.location, reason)
        if on_skip is not None:
            on_skip(step, reason)
    return None


def _read_verified(storage: Storage, manifest: Manifest) -> TrainingState:
    data = storage.read(manifest.file)
    if len(data) != manifest.size_bytes:
        raise ValueError(
            f"size mismatch: {len(data)} bytes on storage, {manifest.size_bytes} recorded"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != manifest.sha256:
        raise ValueError(
            f"checksum mismatch: sha256 {digest[:12]}..., {manifest.sha256[:12]}... recorded"
        )
    payload = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    return TrainingState.from_payload(payload)


def atomic_torch_save(
    obj: Any, location: str | os.PathLike[str], before_commit: Callable[[], None] | None = None
) -> str:
    """``torch.save`` ``obj`` to a path or URL that is then either old or complete;
    return where it went. ``before_commit`` may raise to refuse the write."""
    text = os.fspath(location).rstrip("/")
    parent, _, name = text.rpartition("/")
    storage = open_storage(parent or ".")
    storage.write(name, lambda handle: torch.save(obj, handle), before_commit)
    return storage.path_of(name)
