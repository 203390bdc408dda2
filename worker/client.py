"""HTTP client of the controller API, as the node agent uses it.

Connection failures and gateway errors (502/503/504) are retried a few times
with backoff; whatever still fails surfaces as a ``ControllerError`` subclass,
so callers decide per endpoint what a failure means:

- ``UnknownNodeError`` (404, or 401 to a node token): the controller does not know this
  node or its token; register again.
- ``FencedError`` (409 on a report): the attempt is no longer this node's; stop it.
- ``ControllerUnavailableError``: no answer; keep the data and try again later.

Delivery is at least once: a report whose reply was lost is sent again.

Registration carries the controller's enrolment token; its reply carries this
node's own token, which every later call carries instead.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import httpx
import tenacity
from pydantic import BaseModel, ValidationError

from worker.protocol import (
    AttemptReport,
    Heartbeat,
    HeartbeatReply,
    NodeLeave,
    NodeLeft,
    NodeRegister,
    NodeRegistered,
    ReportAccepted,
)

logger = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)
_RETRY_STATUS = frozenset({502, 503, 504})


class ControllerError(Exception):
    """The controller did not accept a request."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ControllerUnavailableError(ControllerError):
    """No usable answer after the retries (connection refused, timeout, 502-504)."""


class UnknownNodeError(ControllerError):
    """404 or 401: the controller does not know this node id or its token (it lost its
    state, or the node registered again elsewhere)."""


class FencedError(ControllerError):
    """409 on a report: the attempt is no longer assigned to this node."""


class _RetryableStatus(Exception):
    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


class ControllerClient:
    """Talks to ``{base_url}/api/v1``; one instance per agent, not thread-safe."""

    def __init__(
        self,
        base_url: str,
        enrolment_token: str,
        *,
        timeout_s: float = 5.0,
        attempts: int = 3,
        backoff_s: float = 0.2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be >= 1")
        self._http = httpx.Client(
            base_url=base_url.rstrip("/") + "/api/v1", timeout=timeout_s, transport=transport
        )
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._enrolment_token = enrolment_token
        self._node_token: str | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def register(self, body: NodeRegister) -> NodeRegistered:
        reply = self._call("/nodes/register", body, NodeRegistered, self._enrolment_token)
        self._node_token = reply.node_token
        return reply

    def heartbeat(self, node_id: int, body: Heartbeat) -> HeartbeatReply:
        return self._call(f"/nodes/{node_id}/heartbeat", body, HeartbeatReply, self._as_node())

    def report(self, node_id: int, body: AttemptReport) -> ReportAccepted:
        try:
            return self._call(f"/nodes/{node_id}/reports", body, ReportAccepted, self._as_node())
        except ControllerError as exc:
            if exc.status_code == 409:
                raise FencedError(str(exc), 409) from exc
            raise

    def leave(self, node_id: int, body: NodeLeave) -> NodeLeft:
        return self._call(f"/nodes/{node_id}/leave", body, NodeLeft, self._as_node())

    def _as_node(self) -> str:
        if self._node_token is None:
            raise UnknownNodeError("this agent has not registered yet", None)
        return self._node_token

    def _call(self, path: str, body: BaseModel, reply_type: type[_M], token: str) -> _M:
        response = self._post(path, body, token)
        if response.status_code == 404 or (
            response.status_code == 401 and token is self._node_token
        ):
            raise UnknownNodeError(
                f"POST {path}: {response.status_code} {response.text[:200]}",
                response.status_code,
            )
        if response.is_error:
            raise ControllerError(
                f"POST {path}: {response.status_code} {response.text[:500]}",
                response.status_code,
            )
        try:
            return reply_type.model_validate_json(response.content)
        except ValidationError as exc:
            raise ControllerError(f"POST {path}: unexpected reply: {exc}") from exc

    def _post(self, path: str, body: BaseModel, token: str) -> httpx.Response:
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type((httpx.TransportError, _RetryableStatus)),
            stop=tenacity.stop_after_attempt(self._attempts),
            wait=tenacity.wait_exponential(multiplier=self._backoff_s, max=2.0),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    response = self._http.post(
                        path,
                        content=body.model_dump_json(),
                        headers={
                            "content-type": "application/json",
                            "authorization": f"Bearer {token}",
                        },
                    )
                    if response.status_code in _RETRY_STATUS:
                        raise _RetryableStatus(response)
                    return response
        except httpx.TransportError as exc:
            raise ControllerUnavailableError(f"POST {path}: {type(exc).__name__}: {exc}") from exc
        except _RetryableStatus as exc:
            raise ControllerUnavailableError(
                f"POST {path}: {exc.response.status_code}", exc.response.status_code
            ) from exc
        raise AssertionError("unreachable: tenacity either returns or reraises")
