"""HTTP client of the controller API, as the node agent uses it.

Connection failures and gateway errors (502/503/504) are retried a few times
with backoff; whatever still fails surfaces as a ``ControllerError`` subclass,
so callers decide per endpoint what a failure means:

- ``UnknownNodeError`` (404, or 401 to a node token): the controller does not know this
  node or its token; register again.
- ``FencedError`` (409 on a report): the attempt is no longer this node's; stop it.
  Its ``reason`` says whether the job was cancelled or the attempt went on without it.
- ``EnrolmentRefusedError`` (401 or 403 on registration): the controller refuses the
  enrolment token; asking again cannot help.
- ``ControllerUnavailableError``: no answer; keep the data and try again later.

Delivery is at least once: a report whose reply was lost is sent again.

``base_url`` may name several controllers of one database, separated by commas
(``worker.failover``): a call that one of them leaves unanswered goes to the next.

Registration carries the controller's enrolment token; its reply carries this
node's own token, which every later call carries instead.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import httpx
import tenacity
from pydantic import BaseModel, ValidationError

from contract.protocol import (
    AttemptReport,
    Heartbeat,
    HeartbeatReply,
    NodeLeave,
    NodeLeft,
    NodeRegister,
    NodeRegistered,
    ReportAccepted,
    ReportRefused,
    StopReason,
)
from worker.failover import controller_transport, controller_urls

logger = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)
_RETRY_STATUS = frozenset({502, 503, 504})


class ControllerError(Exception):
    """The controller did not accept a request."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ControllerUnavailableError(ControllerError):
    """No usable answer after the retries (connection refused, timeout, 502-504).
    ``retry_after_s``: how long the controller's last answer asked to be left alone
    (its ``Retry-After``; 0 where it said nothing)."""

    def __init__(
        self, message: str, status_code: int | None = None, retry_after_s: float = 0.0
    ) -> None:
        super().__init__(message, status_code)
        self.retry_after_s = retry_after_s


class UnknownNodeError(ControllerError):
    """404 or 401: the controller does not know this node id or its token (it lost its
    state, or the node registered again elsewhere)."""


class FencedError(ControllerError):
    """409 on a report: the attempt is no longer assigned to this node; ``reason`` says why."""

    def __init__(self, message: str, reason: StopReason = StopReason.FENCED) -> None:
        super().__init__(message, 409)
        self.reason = reason


class EnrolmentRefusedError(ControllerError):
    """401 or 403 on registration: the controller refuses the enrolment token (a wrong
    token, or a controller that accepts no nodes); ``detail`` is the controller's word."""

    def __init__(self, detail: str, status_code: int) -> None:
        super().__init__(f"POST /nodes/register: {status_code} {detail}", status_code)
        self.detail = detail


# The longest Retry-After a call waits out before it asks again; a controller that asks
# for longer (an overloaded one shedding heartbeats says the fleet's interval) gets no
# second try in this call: the caller's own schedule decides when to ask again.
RETRY_AFTER_IN_CALL_MAX_S = 2.0


class _RetryableStatus(Exception):
    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response
        self.retry_after_s = _retry_after_s(response)


def _retry_after_s(response: httpx.Response) -> float:
    """The Retry-After of ``response`` in seconds (0: none, or a date, which the
    controller never sends)."""
    try:
        return max(0.0, float(response.headers.get("retry-after", "0")))
    except ValueError:
        return 0.0


def _worth_retrying(exc: BaseException) -> bool:
    if isinstance(exc, _RetryableStatus):
        return exc.retry_after_s <= RETRY_AFTER_IN_CALL_MAX_S
    return isinstance(exc, httpx.TransportError)


# How long the agent keeps an idle connection to the controller for its next call: longer
# than the heartbeat pace (10 s at 1,000 nodes) and shorter than the controller keeps its
# side (RELAUNCH_KEEP_ALIVE_S, 75 s), so that a heartbeat reuses the last one's
# connection instead of opening one (a TCP handshake, a TLS one through a proxy) each time.
KEEP_ALIVE_S = 60.0
KEEP_ALIVE = httpx.Limits(keepalive_expiry=KEEP_ALIVE_S)


class ControllerClient:
    """Talks to ``{base_url}/api/v1`` (one controller of ``base_url``'s list); one instance
    per agent, not thread-safe."""

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
        urls = controller_urls(base_url)
        self._http = httpx.Client(
            base_url=urls[0] + "/api/v1",
            timeout=timeout_s,
            limits=KEEP_ALIVE,
            transport=controller_transport(
                urls, transport if transport is not None or len(urls) == 1 else _kept_alive()
            ),
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
        path = "/nodes/register"
        response = self._post(path, body, self._enrolment_token)
        if response.status_code in (401, 403):
            raise EnrolmentRefusedError(_detail(response), response.status_code)
        reply = self._read(path, response, NodeRegistered, self._enrolment_token)
        self._node_token = reply.node_token
        return reply

    @property
    def node_token(self) -> str | None:
        """This node's token, once registered; the launchers' rendezvous credential."""
        return self._node_token

    def heartbeat(self, node_id: int, body: Heartbeat) -> HeartbeatReply:
        return self._call(f"/nodes/{node_id}/heartbeat", body, HeartbeatReply, self._as_node())

    def report(self, node_id: int, body: AttemptReport) -> ReportAccepted:
        path, token = f"/nodes/{node_id}/reports", self._as_node()
        response = self._post(path, body, token)
        if response.status_code == 409:
            raise FencedError(f"POST {path}: 409 {response.text[:200]}", _stop_reason(response))
        return self._read(path, response, ReportAccepted, token)

    def leave(self, node_id: int, body: NodeLeave) -> NodeLeft:
        return self._call(f"/nodes/{node_id}/leave", body, NodeLeft, self._as_node())

    def _as_node(self) -> str:
        if self._node_token is None:
            raise UnknownNodeError("this agent has not registered yet", None)
        return self._node_token

    def _call(self, path: str, body: BaseModel, reply_type: type[_M], token: str) -> _M:
        return self._read(path, self._post(path, body, token), reply_type, token)

    def _read(self, path: str, response: httpx.Response, reply_type: type[_M], token: str) -> _M:
        """The reply of a 2xx answer; a ``ControllerError`` for any other."""
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
        backoff = tenacity.wait_exponential(multiplier=self._backoff_s, max=2.0)

        def wait(state: tenacity.RetryCallState) -> float:
            """The backoff, or the controller's Retry-After if that is longer."""
            failed = state.outcome.exception() if state.outcome is not None else None
            asked = failed.retry_after_s if isinstance(failed, _RetryableStatus) else 0.0
            return max(backoff(state), asked)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_worth_retrying),
            stop=tenacity.stop_after_attempt(self._attempts),
            wait=wait,
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
                f"POST {path}: {exc.response.status_code}",
                exc.response.status_code,
                exc.retry_after_s,
            ) from exc
        raise AssertionError("unreachable: tenacity either returns or reraises")


def _kept_alive() -> httpx.BaseTransport:
    """The transport under a failover between controllers: a client's ``limits`` reach
    only the transport it makes itself."""
    return httpx.HTTPTransport(limits=KEEP_ALIVE)


def _detail(response: httpx.Response) -> str:
    """The controller's ``detail`` of an error answer, or the start of its text."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail) if detail else response.text[:200]


def _stop_reason(response: httpx.Response) -> StopReason:
    """Why a report was refused; an answer that does not say (an older controller) is a fence."""
    try:
        return ReportRefused.model_validate_json(response.content).reason
    except ValidationError:
        return StopReason.FENCED
