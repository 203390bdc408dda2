"""Bodies of recent job reads, kept with the version of the data they were built from.

A body is served again only for the same version, read from the database by the
request that serves it: the version is every stored value the body shows (see
``service.jobs.job_version``), so when anything in the body changes, the version
does, and the next read builds a new body. What the cache saves is building and
serialising the body, never the check; several controllers may share the database.
Visibility is checked before the cache is asked: it holds no caller's rights.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from fastapi import Response

from service.api.conditional import etag_of

# Bodies kept at most, in bytes and in number; the least recently used go first.
MAX_BYTES = 32 * 2**20
MAX_ENTRIES = 4096


@dataclass(frozen=True)
class Answer:
    """A serialised JSON body and its ETag."""

    body: bytes
    etag: str

    @classmethod
    def of(cls, body: bytes) -> Answer:
        return cls(body, etag_of(body))

    def response(self) -> Response:
        return Response(self.body, media_type="application/json", headers={"etag": self.etag})


@dataclass(frozen=True)
class _Entry:
    version: object
    answer: Answer


class AnswerCache:
    """One body per key (a job's detail, one page of a caller's job list), with the
    version it was built from; bounded by ``max_bytes`` and ``max_entries``."""

    def __init__(self, max_bytes: int = MAX_BYTES, max_entries: int = MAX_ENTRIES) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def answer(
        self, key: Hashable, version_of: Callable[[], object], build: Callable[[], str]
    ) -> Answer:
        """The body kept for ``key`` if it was built from the version read now; else the
        body ``build`` makes, kept only if the version is still the same once it is built
        (on PostgreSQL each statement of a transaction sees the newest commit, so the
        body may be newer than the version read before it)."""
        version = version_of()
        answer = self.get(key, version)
        if answer is None:
            answer = Answer.of(build().encode())
            if version_of() == version:
                self.put(key, version, answer)
        return answer

    def get(self, key: Hashable, version: object) -> Answer | None:
        """The body kept for ``key``, if it was built from ``version``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.version != version:
                return None
            self._entries.move_to_end(key)
            return entry.answer

    def put(self, key: Hashable, version: object, answer: Answer) -> None:
        if len(answer.body) > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old.answer.body)
            self._entries[key] = _Entry(version, answer)
            self._bytes += len(answer.body)
            while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped.answer.body)

    def __len__(self) -> int:
        return len(self._entries)
