"""Fencing of snapshot writes: only the newest rank 0 of a job may commit a file.

A rank 0 that was paused (SIGSTOP) or cut off can come back after the job has
re-formed without it, with a new rank 0 that writes snapshots of its own. The
stale one must not commit: its files would shadow the live lineage's.

Every rank 0 takes a token when it starts: ``add(key, 1)`` on the controller's
store (``STORE_ENDPOINT_ENV``), which the controller keeps up while nodes come
and go. Before each commit it reads the counter again (``add(key, 0)``); a
different value means a newer rank 0 exists, and the write is refused with
``SnapshotFenced``. A rank 0 that cannot reach the store cannot prove it is
the newest, and is refused too. The check and the rename are two steps, so a
writer paused exactly between them is not stopped; every other pause is.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Protocol

from contract.protocol import JOB_ID_ENV, STORE_ENDPOINT_ENV

logger = logging.getLogger(__name__)

STORE_TIMEOUT_S = 10.0


class SnapshotFenced(RuntimeError):
    """A newer rank 0 owns the job's snapshots (or the store cannot be reached)."""


class _Counter(Protocol):
    def add(self, key: str, value: int) -> int: ...


def fence_key(job_id: str) -> str:
    return f"relaunch/job{job_id}/snapshot_writer"


class WriterToken:
    """This rank 0's place in the job's sequence of snapshot writers."""

    def __init__(self, store: _Counter, key: str) -> None:
        self._store = store
        self._key = key
        self.token = int(store.add(key, 1))
        logger.info("snapshot writer token %d (%s)", self.token, key)

    def check(self) -> None:
        """Raise ``SnapshotFenced`` unless this is still the newest writer."""
        try:
            current = int(self._store.add(self._key, 0))
        except Exception as exc:  # timeout, refused, reset: no proof of ownership
            raise SnapshotFenced(f"cannot reach the store to check the token: {exc}") from exc
        if current != self.token:
            raise SnapshotFenced(
                f"a newer rank 0 (writer {current}) owns the snapshots; this one is writer "
                f"{self.token} of an attempt that has been replaced"
            )


def writer_token_from_environ() -> WriterToken | None:
    """A token on the store named by the environment; None outside relaunch."""
    endpoint = os.environ.get(STORE_ENDPOINT_ENV)
    job_id = os.environ.get(JOB_ID_ENV)
    if not endpoint or not job_id:
        return None
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    store = TCPStore(
        host,
        int(port),
        is_master=False,
        timeout=timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
    )
    return WriterToken(store, fence_key(job_id))
