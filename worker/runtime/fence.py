"""Fencing of snapshot writes: only the newest rank 0 of a job may commit a file.

A rank 0 that was paused (SIGSTOP) or cut off can come back after the job has
re-formed without it, with a new rank 0 that writes snapshots of its own. The
stale one must not commit: its files would shadow the live lineage's.

Every rank 0 takes a token when it starts: the next number of its job's writer
count, kept by the controller (``CONTROLLER_URL_ENV``), which the worker proves
it may use with its attempt's worker token (``WORKER_TOKEN_ENV``, valid for its
own job only). Before each commit it reads the newest number again; a different
value means a newer rank 0 exists, and the write is refused with
``SnapshotFenced``. A rank 0 whose token is no longer accepted (its node left
the attempt), or that cannot reach a controller for ``FENCE_RETRY_S`` (a
controller restart is waited out; a list of controllers is tried in turn,
``worker.failover``), cannot prove it is the newest, and is
refused too. The check and the rename are two steps, so a
writer paused exactly between them is not stopped; every other pause is.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

import httpx

from contract.protocol import CONTROLLER_URL_ENV, JOB_ID_ENV, WORKER_TOKEN_ENV
from contract.rendezvous import SnapshotWriter
from worker.failover import CONNECT_TIMEOUT_S, FailoverTransport, controller_urls

logger = logging.getLogger(__name__)

FENCE_TIMEOUT_S = 10.0
FENCE_RETRY_S = 60.0
_RETRY_STATUS = frozenset({500, 502, 503, 504})


class SnapshotFenced(RuntimeError):
    """A newer rank 0 owns the job's snapshots (or the controller cannot vouch for this one)."""


class WriterCounter(Protocol):
    def take(self) -> int:
        """The job's next writer token."""
        ...

    def current(self) -> int:
        """The job's newest writer token."""
        ...


class ControllerCounter:
    """The job's writer count at the controller (one of ``controller_url``'s list), called
    with the attempt's worker token."""

    def __init__(
        self,
        controller_url: str,
        job_id: int,
        worker_token: str,
        *,
        timeout_s: float = FENCE_TIMEOUT_S,
        retry_s: float = FENCE_RETRY_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._path = f"/api/v1/workers/jobs/{job_id}/snapshot-writer"
        self._retry_s = retry_s
        urls = controller_urls(controller_url)
        # With several controllers the next one is the retry of a failed connection.
        connection_retries = 3 if len(urls) == 1 else 0
        self._http = httpx.Client(
            base_url=urls[0],
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S)),
            headers={"authorization": f"Bearer {worker_token}"},
            transport=FailoverTransport(
                urls, transport or httpx.HTTPTransport(retries=connection_retries)
            ),
        )

    def take(self) -> int:
        return self._call("POST")

    def current(self) -> int:
        return self._call("GET")

    def _call(self, method: str) -> int:
        """The token the controller answers; asked again while it does not answer (or
        answers 5xx) for up to ``retry_s``. A refusal (4xx) raises at once."""
        deadline = time.monotonic() + self._retry_s
        delay = 0.2
        while True:
            try:
                response = self._http.request(method, self._path)
                if response.status_code not in _RETRY_STATUS or time.monotonic() > deadline:
                    response.raise_for_status()
                    return SnapshotWriter.model_validate_json(response.content).token
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(delay)
            delay = min(2 * delay, 2.0)


class WriterToken:
    """This rank 0's place in the job's sequence of snapshot writers."""

    def __init__(self, counter: WriterCounter) -> None:
        self._counter = counter
        self.token = int(counter.take())
        logger.info("snapshot writer token %d", self.token)

    def check(self) -> None:
        """Raise ``SnapshotFenced`` unless this is still the newest writer."""
        try:
            current = int(self._counter.current())
        except Exception as exc:  # unreachable, timeout, refused token: no proof of ownership
            raise SnapshotFenced(f"cannot check the writer token at the controller: {exc}") from exc
        if current != self.token:
            raise SnapshotFenced(
                f"a newer rank 0 (writer {current}) owns the snapshots; this one is writer "
                f"{self.token} of an attempt that has been replaced"
            )


def writer_token_from_environ() -> WriterToken | None:
    """A token of the job the environment names; None outside relaunch."""
    url = os.environ.get(CONTROLLER_URL_ENV)
    token = os.environ.get(WORKER_TOKEN_ENV)
    job_id = os.environ.get(JOB_ID_ENV)
    if not url or not token or not job_id:
        return None
    return WriterToken(ControllerCounter(url, int(job_id), token))
