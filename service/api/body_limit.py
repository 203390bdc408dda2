"""A cap on request bodies, enforced before a route reads them."""

from __future__ import annotations

import json

from fastapi import HTTPException, status
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _too_large(limit: int) -> str:
    return f"the request body is larger than {limit} bytes; send less"


class BodyLimit:
    """413 for a body over ``max_bytes``: at once when Content-Length says so, and
    while reading when a chunked body runs past it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await _reply(send, status.HTTP_413_CONTENT_TOO_LARGE, _too_large(self.max_bytes))
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(
                        status.HTTP_413_CONTENT_TOO_LARGE, _too_large(self.max_bytes)
                    )
            return message

        await self.app(scope, counted, send)


async def _reply(send: Send, code: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
