"""Rank 0's channel to the node agent: one JSON line per runtime event.

The agent tails the file named by ``RELAUNCH_EVENTS_FILE``; the launcher of the
same node may append to it too. Each event is encoded to one line and written
with a single ``os.write`` on an ``O_APPEND`` descriptor, so every line lands
whole at the end of the file; lines are kept under ``MAX_LINE_BYTES`` so that a
reader polling the file never sees a line split over many writes, and lines from
different writers never interleave.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import datetime
from types import TracebackType

from contract.events import MAX_LINE_BYTES, EventData, runtime_event
from contract.protocol import EVENTS_FILE_ENV

logger = logging.getLogger(__name__)


def encode_event(data: EventData, now: datetime | None = None) -> bytes:
    """One newline-terminated JSON line for the event that carries ``data``.

    The shape is ``contract.events.RuntimeEvent``: ``{"time", "kind", "data"}``
    with ``time`` an ISO 8601 UTC timestamp. Raises ``ValueError`` if the line
    would be ``MAX_LINE_BYTES`` or longer (it could no longer be appended
    atomically).
    """
    line = runtime_event(data, now).model_dump_json().encode() + b"\n"
    if len(line) >= MAX_LINE_BYTES:
        raise ValueError(
            f"{data.kind.value} event is {len(line)} bytes encoded; events must stay under "
            f"{MAX_LINE_BYTES} bytes"
        )
    return line


class EventWriter:
    """Appends events to ``path``; with ``path=None`` every ``emit`` is a no-op.

    The file is opened on first use (created if missing, never truncated). A
    failing write is logged and dropped: events are reports, and losing one must
    not stop training. Only rank 0 should hold an enabled writer.
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self._path = os.fspath(path) if path is not None else None
        self._fd: int | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> EventWriter:
        """A writer for ``$RELAUNCH_EVENTS_FILE``, disabled when it is unset or empty."""
        return cls(environ.get(EVENTS_FILE_ENV) or None)

    @classmethod
    def disabled(cls) -> EventWriter:
        return cls(None)

    @property
    def enabled(self) -> bool:
        return self._path is not None

    @property
    def path(self) -> str | None:
        return self._path

    def emit(self, data: EventData) -> None:
        """Append the event that carries ``data``; it must be small (see ``encode_event``)."""
        if self._path is None:
            return
        kind = data.kind
        line = encode_event(data)
        try:
            if self._fd is None:
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                self._fd = os.open(self._path, flags, 0o644)
            written = os.write(self._fd, line)
            if written != len(line):
                logger.warning("short write of %s event to %s", kind.value, self._path)
        except OSError as exc:
            logger.warning("could not write %s event to %s: %s", kind.value, self._path, exc)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
