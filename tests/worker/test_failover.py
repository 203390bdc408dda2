import json
import threading
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from contract.protocol import Heartbeat, NodeRegister
from contract.rendezvous import RendezvousState
from worker.client import ControllerClient, ControllerUnavailableError
from worker.failover import FailoverTransport, controller_urls
from worker.rendezvous import ControllerRendezvous
from worker.runtime.fence import ControllerCounter

A, B, C = "http://a:8080", "http://b:8080", "https://c/relaunch"


@pytest.mark.parametrize(
    ("value", "urls"),
    [
        ("http://a:8080", ("http://a:8080",)),
        ("http://a:8080/", ("http://a:8080",)),
        (" http://a:8080 , https://c/relaunch/", ("http://a:8080", "https://c/relaunch")),
    ],
)
def test_controller_urls_reads_one_url_or_a_comma_separated_list(
    value: str, urls: tuple[str, ...]
) -> None:
    assert controller_urls(value) == urls


@pytest.mark.parametrize(
    "value",
    [
        "",
        "a:8080",
        "ftp://a",
        "http://a:8080,",
        "http://a,,http://b",
        "http://a b",
        "http://a\tb",
        # credentials would be logged and handed to every job's workers, and would
        # replace the node's token in the Authorization header
        "http://user:secret@a:8080",
        "http://a:8080/x@y",
        "http://a:8080?x=1",  # a query or fragment would swallow the API's path
        "http://a:8080/p#f",
        "http://a:port",  # not a URL that httpx can call
        "http://a:70000",
    ],
)
def test_controller_urls_refuses_what_is_not_a_list_of_http_urls(value: str) -> None:
    with pytest.raises(ValueError, match="controller_url must be an http"):
        controller_urls(value)


@pytest.mark.parametrize(
    "value",
    ["http://a:8080,http://a:8080/", "http://a:8080,http://A:8080", "http://a:80,http://a"],
)
def test_controller_urls_refuses_a_controller_named_twice(value: str) -> None:
    with pytest.raises(ValueError, match="twice"):
        controller_urls(value)


class _Controllers:
    """Stand-ins for controllers by host: ``down`` refuse connections, ``busy`` answer 503."""

    def __init__(self, down: Iterable[str] = (), busy: Iterable[str] = ()) -> None:
        self.down, self.busy = set(down), set(busy)
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if host in self.busy:
            return httpx.Response(503, json={"detail": "busy"})
        return httpx.Response(200, json={"host": host})

    def hosts(self) -> list[str]:
        return [r.url.host for r in self.seen]


def _http(controllers: _Controllers, *urls: str) -> httpx.Client:
    transport = FailoverTransport(urls, httpx.MockTransport(controllers))
    return httpx.Client(base_url=urls[0] + "/api/v1", transport=transport)


def test_a_controller_that_refuses_is_left_for_the_next_which_keeps_the_calls() -> None:
    controllers = _Controllers(down={"a"})
    with _http(controllers, A, B) as http:
        assert http.post("/x?q=1", content=b"body").json() == {"host": "b"}
        assert http.get("/y").json() == {"host": "b"}
    assert controllers.hosts() == ["a", "b", "b"]  # sticks to the one that answered
    moved = controllers.seen[1]
    assert str(moved.url) == "http://b:8080/api/v1/x?q=1"
    assert moved.headers["host"] == "b:8080"
    assert moved.content == b"body"


def test_a_path_prefix_of_a_controller_is_kept() -> None:
    controllers = _Controllers(down={"a"})
    with _http(controllers, A, C) as http:
        http.get("/y")
    assert str(controllers.seen[-1].url) == "https://c/relaunch/api/v1/y"


def test_503_moves_on_and_a_refusal_does_not() -> None:
    controllers = _Controllers(busy={"a"})
    with _http(controllers, A, B) as http:
        assert http.get("/y").json() == {"host": "b"}

    def refuses(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"detail": "fenced"})

    transport = FailoverTransport([A, B], httpx.MockTransport(refuses))
    with httpx.Client(base_url=A, transport=transport) as http:
        assert http.get("/y").status_code == 409
    assert transport.current == A


def test_the_list_comes_round_when_the_one_in_use_goes_away() -> None:
    controllers = _Controllers(down={"a"})
    with _http(controllers, A, B) as http:
        http.get("/1")
        controllers.down = {"b"}
        assert http.get("/2").json() == {"host": "a"}
    assert controllers.hosts() == ["a", "b", "b", "a"]


def test_when_none_answers_the_last_failure_is_the_callers() -> None:
    with _http(_Controllers(down={"a", "b"}), A, B) as http, pytest.raises(httpx.ConnectError):
        http.get("/y")
    with _http(_Controllers(down={"a"}, busy={"b"}), A, B) as http:
        assert http.get("/y").status_code == 503


def test_one_url_passes_every_request_through_unchanged() -> None:
    controllers = _Controllers(busy={"a"})
    transport = FailoverTransport([A], httpx.MockTransport(controllers))
    with httpx.Client(base_url=A, transport=transport) as http:
        assert http.get("/y").status_code == 503
    assert controllers.hosts() == ["a"]


def test_the_agent_registers_where_it_can_and_its_node_token_serves_at_any_controller() -> None:
    controllers = _Controllers(down={"a"})
    tokens: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        tokens.append(request.headers["authorization"])
        if request.url.host in controllers.down | controllers.busy:
            return controllers(request)
        controllers.seen.append(request)
        if request.url.path.endswith("/register"):
            return httpx.Response(
                200, json={"node_id": 1, "heartbeat_interval_s": 1.0, "node_token": "rln_n"}
            )
        return httpx.Response(200, json={"assignments": []})

    with ControllerClient(f"{A},{B}", "enrol", transport=httpx.MockTransport(handle)) as client:
        client.register(NodeRegister(name="n", address="x", slots=1, pid=1))
        controllers.down, controllers.busy = set(), {"b"}  # b busy now: back to a
        client.heartbeat(1, Heartbeat())
    assert controllers.hosts() == ["a", "b", "b", "a"]
    assert tokens == ["Bearer enrol", "Bearer enrol", "Bearer rln_n", "Bearer rln_n"]


def test_the_agent_client_fails_as_before_when_no_controller_answers() -> None:
    controllers = _Controllers(down={"a", "b"})
    transport = httpx.MockTransport(controllers)
    with (
        ControllerClient(f"{A},{B}", "e", transport=transport, attempts=2, backoff_s=0) as client,
        pytest.raises(ControllerUnavailableError),
    ):
        client.register(NodeRegister(name="n", address="x", slots=1, pid=1))
    assert controllers.hosts() == ["a", "b", "a", "b"]


def test_the_snapshot_fence_asks_the_next_controller() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        assert request.url.path == "/api/v1/workers/jobs/7/snapshot-writer"
        return httpx.Response(200, json={"token": 3})

    counter = ControllerCounter(f"{A},{B}", 7, "w", transport=httpx.MockTransport(handle))
    assert counter.take() == 3


class _Proxy(BaseHTTPRequestHandler):
    """A forward proxy that answers every request itself and records its target."""

    seen: list[str]

    def _answer(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path.endswith("/register"):
            body = {"node_id": 1, "heartbeat_interval_s": 1.0, "node_token": "rln_n"}
        else:
            body = {"version": 0}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The requests that reach the proxy named in ``HTTP_PROXY``."""
    seen: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("P", (_Proxy,), {"seen": seen}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_client_of_one_controller_keeps_the_proxy_its_environment_names(
    proxy: list[str],
) -> None:
    """As before several controllers could be named: a node behind a forward proxy."""
    with ControllerClient("http://controller.invalid:8080", "e", attempts=1) as client:
        client.register(NodeRegister(name="n", address="x", slots=1, pid=1))
    rendezvous = ControllerRendezvous("http://controller.invalid:8080", "r1", "t", retry_s=0)
    try:
        rendezvous.call("GET", "/state", None, RendezvousState)
    finally:
        rendezvous.close()
    assert proxy == [
        "POST http://controller.invalid:8080/api/v1/nodes/register",
        "GET http://controller.invalid:8080/api/v1/rendezvous/r1/state",
    ]
