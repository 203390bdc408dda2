"""Conditional GETs: every JSON answer of the API carries an ETag, and a client that
sends it back in If-None-Match gets 304 with no body while nothing changed.

The ETag is the sha256 of the body, so it changes exactly when the answer
does, and is per caller without any bookkeeping: two users who see different
things get different bodies. The route still runs (the caller is checked, the
database is read); what a poller saves is the transfer and its own parsing. A
route that already knows its body's ETag (``etag_of``, from
``service.api.answers``) sets it, and the body is not hashed again. ``Cache-Control: private,
no-cache`` lets a browser keep the answer but ask every time, and never lets a
shared cache hold it.
"""

from __future__ import annotations

import hashlib

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CACHE_CONTROL = "private, no-cache"


def etag_of(body: bytes) -> str:
    return f'"{hashlib.sha256(body).hexdigest()[:32]}"'


def _matches(if_none_match: str, etag: str) -> bool:
    candidates = {c.strip().removeprefix("W/") for c in if_none_match.split(",")}
    return "*" in candidates or etag in candidates


class ConditionalGet:
    """ETag and 304 for successful GETs under ``prefix``."""

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in ("GET", "HEAD")
            or not scope["path"].startswith(self.prefix)
        ):
            await self.app(scope, receive, send)
            return
        if_none_match = Headers(scope=scope).get("if-none-match")
        start: Message | None = None
        chunks: list[bytes] = []

        async def buffered(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                if message["status"] != 200:
                    await send(message)
                    return
                start = message
                return
            if start is None:  # not a 200: pass the body through
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            headers = MutableHeaders(scope=start)
            etag = headers.get("etag") or etag_of(body)
            headers["etag"] = etag
            headers["cache-control"] = CACHE_CONTROL
            headers.append("vary", "Authorization")
            if if_none_match is not None and _matches(if_none_match, etag):
                del headers["content-length"]
                del headers["content-type"]
                await send({**start, "status": 304})
                await send({"type": "http.response.body", "body": b""})
                return
            await send(start)
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, buffered)
