"""``SnapshotSaver``: rank 0's snapshot writes, off the training path.

The trainer hands over a ``TrainingState`` whose tensors are already private copies
(``copy_off``), so training may change the live ones at once. In background
mode one thread serializes, hashes and writes it while the next steps run, at
a lower CPU priority than training. At most one save is in flight: a save that
comes due while the previous one is still writing is dropped (and logged), not
queued, so a slow disk can never pile up copies in memory.

A save that fails with an I/O error (disk full, a storage error) is reported
through ``on_failed`` and training goes on; the previous snapshot stays. A
save refused by the fence (``SnapshotFenced``), or any other error, is raised
in the training thread at the next ``submit`` or ``wait``: this rank 0 has been
replaced, or something is wrong that a retry will not fix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from worker.runtime.snapshot import Fault, Location, Manifest, TrainingState, save_snapshot
from worker.runtime.storage import open_storage

logger = logging.getLogger(__name__)

WRITER_NICENESS = 10  # added to the writer thread's nice value (Linux: per thread)

Saved = Callable[[Manifest, float, bool], None]
Failed = Callable[[int, str], None]


def copy_off(value: Any) -> Any:
    """A copy of ``value`` (nested dicts, lists and tuples) with every tensor detached
    and on the CPU; when it returns, every copy is complete and the live tensors may
    change at once.

    CPU tensors are cloned. CUDA tensors are copied into pinned (page-locked) CPU
    memory with ``non_blocking`` copies, all queued on each tensor's current stream
    first, then one ``torch.cuda.synchronize`` per device for the whole state: the
    training thread waits for one transfer at full bandwidth, not one round trip per
    tensor. torch's caching host allocator keeps the pinned blocks of a snapshot
    that was written and dropped, so later snapshots reuse them. A CUDA tensor that
    is not strided (sparse) is copied the plain, blocking way.
    """
    devices: set[torch.device] = set()
    copied = _copy_tree(value, devices)
    for device in devices:
        torch.cuda.synchronize(device)
    return copied


def _copy_tree(value: Any, devices: set[torch.device]) -> Any:
    if isinstance(value, torch.Tensor):
        return _copy_tensor(value.detach(), devices)
    if isinstance(value, dict):
        return {key: _copy_tree(item, devices) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_tree(item, devices) for item in value]
    if isinstance(value, tuple):
        return tuple(_copy_tree(item, devices) for item in value)
    return value


def _copy_tensor(tensor: torch.Tensor, devices: set[torch.device]) -> torch.Tensor:
    """``tensor``'s CPU copy; for a CUDA tensor, queued only (``copy_off`` waits)."""
    if tensor.device.type != "cuda" or tensor.layout != torch.strided:
        return tensor.to("cpu", copy=True)
    pinned = torch.empty_like(tensor, device="cpu", pin_memory=True)
    pinned.copy_(tensor, non_blocking=True)
    devices.add(tensor.device)
    return pinned


class SnapshotSaver:
    """Writes one snapshot at a time to ``location``, in a thread if ``background``."""

    def __init__(
        self,
        location: Location,
        *,
        keep: int,
        background: bool = True,
        before_commit: Callable[[], None] | None = None,
        fault: Fault | None = None,
        on_saved: Saved | None = None,
        on_failed: Failed | None = None,
    ) -> None:
        self.storage = open_storage(location)
        self.keep = keep
        self.background = background
        self.before_commit = before_commit
        self.fault = fault
        self.on_saved = on_saved
        self.on_failed = on_failed
        self.dropped = 0  # saves that came due while one was still in flight
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def drop_if_busy(self, step: int) -> bool:
        """Drop the save of ``step`` if one is still in flight (True then), so that the
        caller need not copy a state that ``submit`` would drop."""
        self._raise_pending()
        if not self.in_flight:
            return False
        self.dropped += 1
        logger.warning(
            "snapshot at step %d dropped: the previous save is still being written", step
        )
        return True

    def submit(self, snapshot: TrainingState) -> bool:
        """Start saving ``snapshot``; False if one is still in flight (this one is dropped)."""
        if self.drop_if_busy(snapshot.step):
            return False
        if not self.background:
            self._write(snapshot)
            self._raise_pending()
            return True
        self._thread = threading.Thread(
            target=self._write, args=(snapshot, True), name="snapshot-writer", daemon=True
        )
        self._thread.start()
        return True

    def wait(self) -> None:
        """Block until no save is in flight; raise what a finished save left to raise."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def _raise_pending(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _write(self, snapshot: TrainingState, in_thread: bool = False) -> None:
        if in_thread:
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        started = time.monotonic()
        try:
            manifest = save_snapshot(
                self.storage, snapshot, self.keep, self.before_commit, self.fault
            )
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
            logger.error("snapshot at step %d failed, training goes on: %s", snapshot.step, error)
            if self.on_failed is not None:
                self.on_failed(snapshot.step, error)
            return
        except BaseException as exc:
            self._error = exc
            return
        if self.on_saved is not None:
            self.on_saved(manifest, time.monotonic() - started, in_thread)
