"""What an attempt has to report, buffered until the controller accepts it.

``LogOutbox`` holds the workers' output lines in memory (the oldest are dropped
past a cap, with a notice); ``EventsTail`` reads the attempt's events file from
the last delivered offset, so events survive any outage. Each hands out a batch
with ``peek`` and forgets it only on ``commit``, after the report was accepted.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from contract.events import EventData, RuntimeEvent, parse_event
from contract.protocol import LogLine

logger = logging.getLogger(__name__)

D = TypeVar("D", bound=EventData)


@dataclass(frozen=True)
class LogBatch:
    lines: list[LogLine]
    upto_seq: int
    dropped: int
    complete: bool


class LogOutbox:
    """Thread-safe FIFO of log lines awaiting delivery; drops the oldest past a cap."""

    def __init__(self, max_lines: int = 50_000, max_chars: int = 32 * 2**20) -> None:
        self._lock = threading.Lock()
        self._items: deque[tuple[int, LogLine]] = deque()
        self._next_seq = 0
        self._chars = 0
        self._dropped = 0
        self._max_lines = max_lines
        self._max_chars = max_chars

    def put(self, line: LogLine) -> None:
        with self._lock:
            self._items.append((self._next_seq, line))
            self._next_seq += 1
            self._chars += len(line.line)
            while len(self._items) > self._max_lines or self._chars > self._max_chars:
                _, old = self._items.popleft()
                self._chars -= len(old.line)
                self._dropped += 1

    def peek(self, limit: int, max_chars: int | None = None) -> LogBatch:
        """Up to ``limit`` oldest lines (at least one, then within ``max_chars``)."""
        with self._lock:
            dropped = self._dropped
            take = list(islice(self._items, max(0, limit - (1 if dropped else 0))))
            if max_chars is not None:
                size = 0
                for i, (_, line) in enumerate(take):
                    size += len(line.line)
                    if size > max_chars and i > 0:
                        take = take[:i]
                        break
            complete = len(take) == len(self._items)
        lines = [line for _, line in take]
        if dropped:
            notice = f"[relaunch agent] {dropped} log lines dropped while the controller was away"
            lines.insert(0, LogLine(time=datetime.now(UTC), stream="stderr", line=notice))
        upto = take[-1][0] if take else -1
        return LogBatch(lines=lines, upto_seq=upto, dropped=dropped, complete=complete)

    def commit(self, batch: LogBatch) -> None:
        with self._lock:
            while self._items and self._items[0][0] <= batch.upto_seq:
                _, old = self._items.popleft()
                self._chars -= len(old.line)
            self._dropped -= batch.dropped


@dataclass(frozen=True)
class EventBatch:
    events: list[RuntimeEvent]
    next_offset: int
    complete: bool


class EventsTail:
    """Reads the attempt's events file from the last delivered offset.

    Each line is validated here (``contract.events``): one that is not a valid
    event (a worker may write anything into the file) is logged and dropped, and
    the lines around it are still delivered.
    """

    _CHUNK = 1 << 20

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def peek(self, limit: int) -> EventBatch:
        try:
            with self.path.open("rb") as fp:
                fp.seek(self._offset)
                data = fp.read(self._CHUNK)
        except FileNotFoundError:
            return EventBatch([], self._offset, True)
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) == self._CHUNK:  # a line longer than a chunk: skip it
            logger.warning("%s: skipping an event line over %d bytes", self.path, self._CHUNK)
            return EventBatch([], self._offset + len(data), False)
        events: list[RuntimeEvent] = []
        consumed = 0
        lines = data[:end].splitlines(keepends=True)
        for line in lines:
            if len(events) >= limit:
                break
            consumed += len(line)
            try:
                events.append(parse_event(line))
            except ValidationError as exc:
                logger.warning("%s: skipping a bad event line: %s", self.path, exc)
        complete = consumed == len(data)
        return EventBatch(events, self._offset + consumed, complete)

    def commit(self, batch: EventBatch) -> None:
        self._offset = batch.next_offset

    def last_of(self, kind: type[D], *, tail_bytes: int = 1 << 16) -> D | None:
        """The payload of the last valid event of ``kind`` within the file's final
        ``tail_bytes``."""
        found = self.last_timed(kind, tail_bytes=tail_bytes)
        return None if found is None else found[1]

    def last_timed(self, kind: type[D], *, tail_bytes: int = 1 << 16) -> tuple[datetime, D] | None:
        """(time, payload) of the last valid event of ``kind`` within the file's final
        ``tail_bytes``."""
        try:
            with self.path.open("rb") as fp:
                fp.seek(max(0, self.path.stat().st_size - tail_bytes))
                data = fp.read()
        except FileNotFoundError:
            return None
        for line in reversed(data.splitlines()):
            try:
                event = parse_event(line)
            except ValidationError:
                continue
            if isinstance(event.data, kind):
                return event.time, event.data
        return None
