import time

import httpx
import pytest

from contract.protocol import AttemptReport, Heartbeat, NodeRegister, StopReason
from worker.client import (
    ControllerClient,
    ControllerError,
    ControllerUnavailableError,
    EnrolmentRefusedError,
    FencedError,
    UnknownNodeError,
)

ENROL = "enrolment-secret"
REGISTERED = {"node_id": 1, "heartbeat_interval_s": 1.0, "node_token": "rln_one"}
NODE = NodeRegister(name="n", address="a", slots=1, pid=1)


def _client(
    handler: httpx.MockTransport, attempts: int = 3, *, registered: bool = True
) -> ControllerClient:
    """A client; ``registered``: it has registered (through a stand-in answer) first."""
    if not registered:
        return ControllerClient(
            "http://controller:8000/", ENROL, transport=handler, attempts=attempts, backoff_s=0.001
        )
    handled = handler.handle_request

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/register"):
            return httpx.Response(200, json=REGISTERED)
        return handled(request)

    client = ControllerClient(
        "http://controller:8000/",
        ENROL,
        transport=httpx.MockTransport(handle),
        attempts=attempts,
        backoff_s=0.001,
    )
    client.register(NODE)
    return client


def test_register_shows_the_enrolment_token_then_calls_carry_the_node_token() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/register"):
            return httpx.Response(
                200, json={**REGISTERED, "node_id": 4, "heartbeat_interval_s": 1.5}
            )
        return httpx.Response(200, json={"assignments": []})

    with _client(httpx.MockTransport(handle), registered=False) as client:
        with pytest.raises(UnknownNodeError):  # no node token before registering
            client.heartbeat(4, Heartbeat())
        reply = client.register(NodeRegister(name="n", address="a", slots=2, pid=1))
        client.heartbeat(4, Heartbeat())
    assert reply.node_id == 4 and reply.heartbeat_interval_s == 1.5
    assert str(seen[0].url) == "http://controller:8000/api/v1/nodes/register"
    assert NodeRegister.model_validate_json(seen[0].content).slots == 2
    assert seen[0].headers["authorization"] == f"Bearer {ENROL}"
    assert seen[1].headers["authorization"] == "Bearer rln_one"


def test_401_to_the_node_token_means_register_again() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(401, json={"detail": "unknown"}))
    with _client(transport) as client, pytest.raises(UnknownNodeError):
        client.heartbeat(1, Heartbeat())
    with _client(transport, registered=False) as client, pytest.raises(ControllerError) as info:
        client.register(NODE)  # a wrong enrolment token is not "register again"
    assert not isinstance(info.value, UnknownNodeError) and info.value.status_code == 401


def test_connection_errors_are_retried_then_reported_as_unavailable() -> None:
    calls = 0

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"assignments": []})

    with _client(httpx.MockTransport(handle)) as client:
        assert client.heartbeat(1, Heartbeat()).assignments == []
    assert calls == 3

    def always_down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with (
        _client(httpx.MockTransport(always_down)) as client,
        pytest.raises(ControllerUnavailableError),
    ):
        client.heartbeat(1, Heartbeat())


def test_gateway_errors_are_retried() -> None:
    codes = iter([503, 502, 200])

    def handle(request: httpx.Request) -> httpx.Response:
        code = next(codes)
        return httpx.Response(code, json={"accepted": True} if code == 200 else {})

    with _client(httpx.MockTransport(handle)) as client:
        assert client.report(1, AttemptReport(attempt_id=1)).accepted


def test_a_503_that_asks_for_a_long_wait_is_not_retried_in_the_call() -> None:
    """An overloaded controller sheds a heartbeat with Retry-After the fleet's interval:
    the call ends at once (the agent's own schedule sends the next), not three tries in
    half a second."""
    sent: list[float] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(time.monotonic())
        return httpx.Response(503, json={"detail": "overloaded"}, headers={"retry-after": "10"})

    with (
        _client(httpx.MockTransport(handle)) as client,
        pytest.raises(ControllerUnavailableError) as failed,
    ):
        client.heartbeat(1, Heartbeat())
    assert failed.value.status_code == 503
    assert failed.value.retry_after_s == 10  # for the agent's own schedule
    assert len(sent) == 1


def test_a_short_retry_after_is_waited_out_before_the_next_try() -> None:
    sent: list[float] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(time.monotonic())
        if len(sent) == 1:
            return httpx.Response(503, json={"detail": "busy"}, headers={"retry-after": "1"})
        return httpx.Response(200, json={"assignments": []})

    with _client(httpx.MockTransport(handle)) as client:
        assert client.heartbeat(1, Heartbeat()).assignments == []
    assert len(sent) == 2
    assert sent[1] - sent[0] >= 1.0  # not the 1 ms backoff this client is given


def test_404_on_heartbeat_means_unknown_node() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(404, json={"detail": "no"}))
    with _client(transport) as client, pytest.raises(UnknownNodeError):
        client.heartbeat(9, Heartbeat())


def test_409_on_report_means_fenced() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(409, json={"detail": "gone"}))
    with _client(transport) as client, pytest.raises(FencedError) as info:
        client.report(1, AttemptReport(attempt_id=3))
    assert info.value.reason is StopReason.FENCED  # a controller that gives no reason


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"detail": "over", "reason": "cancelled"}, StopReason.CANCELLED),
        ({"detail": "over", "reason": "fenced"}, StopReason.FENCED),
        ({"detail": "over", "reason": "a reason of a later controller"}, StopReason.FENCED),
    ],
)
def test_a_refused_report_says_why_the_attempt_is_over(
    body: dict[str, str], reason: StopReason
) -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(409, json=body))
    with _client(transport) as client, pytest.raises(FencedError) as info:
        client.report(1, AttemptReport(attempt_id=3))
    assert info.value.reason is reason


@pytest.mark.parametrize(
    ("status", "detail"),
    [
        (401, "the enrolment token is wrong"),
        (403, "this controller accepts no nodes: start it with RELAUNCH_ENROLMENT_TOKEN set"),
    ],
)
def test_a_refused_enrolment_token_is_its_own_error(status: int, detail: str) -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(status, json={"detail": detail}))
    with _client(transport, registered=False) as client:
        with pytest.raises(EnrolmentRefusedError) as info:
            client.register(NODE)
        assert info.value.status_code == status and info.value.detail == detail
        with pytest.raises(UnknownNodeError):  # and no node token was taken
            client.heartbeat(1, Heartbeat())


def test_a_server_error_on_registration_is_not_a_refused_token() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(500, text="boom"))
    with _client(transport, registered=False) as client, pytest.raises(ControllerError) as info:
        client.register(NODE)
    assert not isinstance(info.value, EnrolmentRefusedError) and info.value.status_code == 500


def test_other_errors_and_bad_replies_are_controller_errors() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(422, json={"detail": "bad"}))
    with _client(transport) as client, pytest.raises(ControllerError) as info:
        client.report(1, AttemptReport(attempt_id=3))
    assert info.value.status_code == 422

    transport = httpx.MockTransport(lambda r: httpx.Response(200, json={"unexpected": 1}))
    with _client(transport, registered=False) as client, pytest.raises(ControllerError):
        client.register(NODE)
