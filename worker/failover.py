"""Several controllers of one database behind one client: whichever answers serves.

Every controller of a database serves the whole node protocol (registration,
heartbeats, reports, rendezvous, the snapshot fence) from that database, and
they share its secrets, so a node may talk to any of them. A node is given
them as one comma-separated list (``RELAUNCH_AGENT_CONTROLLER_URL``, and for
its launchers and workers ``RELAUNCH_CONTROLLER_URL``): ``controller_urls``
reads it.

``FailoverTransport`` sends each request to the controller that answered last.
One that does not answer (a connection error or a timeout) or answers
``FAILOVER_STATUS`` is left for the next in the list, at most once round the
list per request; the last failure of a round is what the caller sees, so a
caller's own retries (and their budgets) work as with one controller. A client
of one controller gets no ``FailoverTransport`` (``controller_transport``), so it
keeps httpx's defaults, the proxies of ``HTTP(S)_PROXY`` among them; one of
several goes to each controller directly.

A request whose answer was lost may have been served: it is sent again to the
next controller, as a caller's retry would send it again to the same one, so
the node protocol's at-least-once delivery covers both.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence

import httpx

logger = logging.getLogger(__name__)

# No controller behind this address now (a proxy's 502/504), or this one cannot serve
# (503: its database is busy or a write lost a race; any controller of the database
# may serve the retry).
FAILOVER_STATUS = frozenset({502, 503, 504})
# How long a client waits for a connection: a controller whose host is gone answers
# nothing, and the next one on the list should be asked soon.
CONNECT_TIMEOUT_S = 5.0
# scheme://host[:port][/path]: no credentials (a node's calls carry its token, and the list
# is logged and handed to every job's workers), no query or fragment, no whitespace.
_URL = re.compile(r"^https?://[^/\s,@?#]+(/[^\s,@?#]*)?$")


def controller_urls(value: str) -> tuple[str, ...]:
    """The controllers that ``value`` names, one or more http(s) URLs separated by commas,
    each without its trailing slash, in the order given.

    ``ValueError`` for an empty list or entry, an entry that is not an http(s) URL of a
    host and an optional path (credentials, a query or a fragment are refused), or one
    controller named twice (however its host's case or default port is spelled)."""
    urls = tuple(part.strip().rstrip("/") for part in value.split(","))
    parsed = {_parse(url, value) for url in urls}
    if len(parsed) != len(urls):
        raise ValueError(f"controller_url names a controller twice: {value!r}")
    return urls


def _parse(url: str, value: str) -> httpx.URL:
    """``url``, one entry of ``value``, parsed; ``ValueError`` if it is not a controller's."""
    problem = (
        "controller_url must be an http(s) URL or a comma-separated list of them, "
        f"got {url!r} in {value!r}"
    )
    if _URL.match(url):
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:
            problem = f"{problem}: {exc}"
        else:
            if parsed.port is None or 0 < parsed.port < 65536:
                return parsed
            problem = f"{problem}: port {parsed.port} is out of range"
    raise ValueError(problem)


def controller_transport(
    urls: Sequence[str], inner: httpx.BaseTransport | None = None
) -> httpx.BaseTransport | None:
    """The transport of a client of ``urls``: ``inner`` itself for one controller, so a
    client of one keeps httpx's defaults (``inner`` None: the proxies that ``HTTP_PROXY``,
    ``HTTPS_PROXY`` and ``NO_PROXY`` name), else a ``FailoverTransport`` over ``inner``,
    which goes to every controller directly."""
    return inner if len(urls) == 1 else FailoverTransport(urls, inner)


class FailoverTransport(httpx.BaseTransport):
    """Sends a client's requests to one of ``urls``, sticking to the one that answered last.

    The client's ``base_url`` must start with ``urls[0]``; a request goes to another
    controller with that prefix replaced by the controller's URL. Thread-safe."""

    def __init__(self, urls: Sequence[str], inner: httpx.BaseTransport | None = None) -> None:
        if not urls:
            raise ValueError("at least one controller URL is needed")
        self._urls = [httpx.URL(url.rstrip("/")) for url in urls]
        self._inner = inner if inner is not None else httpx.HTTPTransport()
        self._current = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        """The controller the next request goes to first."""
        return str(self._urls[self._current])

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if len(self._urls) == 1:
            return self._inner.handle_request(request)
        request.read()  # the body is sent again to the next controller
        start = self._current
        count = len(self._urls)
        for offset in range(count):
            index = (start + offset) % count
            last = offset == count - 1
            try:
                response = self._inner.handle_request(self._to(index, request))
            except httpx.TransportError as exc:
                self._leave(index, f"{type(exc).__name__}: {exc}", last)
                if last:
                    raise
                continue
            if response.status_code in FAILOVER_STATUS:
                self._leave(index, f"HTTP {response.status_code}", last)
                if last:
                    return response
                response.read()
                response.close()
                continue
            with self._lock:
                self._current = index
            return response
        raise AssertionError("unreachable: the last controller's answer is returned or raised")

    def close(self) -> None:
        self._inner.close()

    def _leave(self, index: int, problem: str, last: bool) -> None:
        """The next request goes first to the controller after ``index``."""
        following = (index + 1) % len(self._urls)
        with self._lock:
            if self._current == index:
                self._current = following
        if not last:
            logger.warning(
                "controller %s did not answer (%s); trying %s",
                self._urls[index],
                problem,
                self._urls[following],
            )

    def _to(self, index: int, request: httpx.Request) -> httpx.Request:
        """``request`` addressed to controller ``index`` instead of the first one."""
        if index == 0:
            return request
        first, target = self._urls[0], self._urls[index]
        prefix = first.raw_path.rstrip(b"/")
        path = request.url.raw_path
        if not path.startswith(prefix):
            raise ValueError(f"{request.url} is not under the first controller's URL {first}")
        url = target.copy_with(raw_path=target.raw_path.rstrip(b"/") + path[len(prefix) :])
        headers = request.headers.copy()
        del headers["host"]  # the target's, set by httpx
        return httpx.Request(
            request.method,
            url,
            headers=headers,
            content=request.content,
            extensions=request.extensions,
        )
