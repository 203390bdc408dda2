"""An agent keeps its node token, and with it takes its name back after a crash; an agent
that has not got it cannot take the name of a node that is alive, unless it retries the
registration whose answer it lost (a real controller and real agent processes)."""

from __future__ import annotations

import signal
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from service.local_cluster import LocalCluster, free_port
from tests.helpers import wait_for
from worker import node_token


def _node(cluster: LocalCluster, name: str) -> dict[str, Any]:
    with cluster.client() as client:
        [node] = [n for n in client.nodes() if n["name"] == name]
    return node


def test_a_crashed_agent_takes_its_name_back_and_an_impostor_cannot(tmp_path: Path) -> None:
    cluster = LocalCluster(data_dir=tmp_path, port=free_port())
    try:
        # A long timeout: the crashed agent's node stays ALIVE through the test.
        cluster.start_controller({"RELAUNCH_NODE_TIMEOUT_S": "600"})
        cluster.start_agent("n1")
        cluster.wait_nodes(1)
        first = _node(cluster, "n1")
        saved = node_token.token_file(cluster.agent_dir("n1"))
        wait_for("the agent to save its node token", saved.exists)
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        assert saved.read_text().startswith("rln_")

        cluster.kill_node("n1")  # no leave: the controller still sees n1 ALIVE
        assert _node(cluster, "n1")["state"] == "ALIVE"

        # Same name, same enrolment token, but not n1's node token.
        work = cluster.nodes_dir / "elsewhere"
        args = ["agent", "--controller", cluster.url, "--name", "n1", "--work-dir", str(work)]
        cluster.spawn("impostor", args, {"RELAUNCH_AGENT_ENROLMENT_TOKEN": cluster.enrolment_token})
        log = tmp_path / "impostor.log"
        wait_for(
            "the impostor to be refused the name",
            lambda: "registering under its name needs its node token" in log.read_text(),
        )
        assert cluster.procs["impostor"].poll() is None  # it waits: 409 is not a bad token
        assert _node(cluster, "n1")["registered_at"] == first["registered_at"]
        assert not node_token.token_file(work).exists()
        cluster.stop("impostor", signal.SIGKILL)

        cluster.start_agent("n1")  # the same work dir: the saved token
        again = wait_for(
            "n1 to register again",
            lambda: (n := _node(cluster, "n1"))["registered_at"] != first["registered_at"] and n,
        )
        assert (again["id"], again["state"]) == (first["id"], "ALIVE")
        assert "needs its node token" not in (tmp_path / "n1.log").read_text()
    finally:
        cluster.stop_all()


def test_the_saved_token_is_private_and_replaced_whole(tmp_path: Path) -> None:
    path = node_token.token_file(tmp_path)
    assert node_token.load(path) is None
    node_token.save(path, "rln_first")
    node_token.save(path, "rln_second")
    assert node_token.load(path) == "rln_second"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [node_token.FILE_NAME]
    path.write_text("not\na token\x00")
    assert node_token.load(path) is None


@contextmanager
def answer_lost_once(upstream: str) -> Iterator[tuple[str, list[str]]]:
    """A proxy in front of ``upstream`` that passes every request on, but hangs up without
    an answer on the first registration once the controller has handled it: a registration
    whose answer the network lost. Yields its URL and what it did, request by request."""
    did: list[str] = []
    client = httpx.Client(base_url=upstream, timeout=30.0)

    class Forward(BaseHTTPRequestHandler):
        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
            reply = client.request(self.command, self.path, content=body, headers=headers)
            if self.path.endswith("/nodes/register") and not any("lost" in d for d in did):
                did.append(f"{self.command} {self.path} {reply.status_code}: answer lost")
                self.close_connection = True
                return
            did.append(f"{self.command} {self.path} {reply.status_code}")
            self.send_response(reply.status_code)
            for name in ("content-type", "retry-after", "etag"):
                if name in reply.headers:
                    self.send_header(name, reply.headers[name])
            self.send_header("content-length", str(len(reply.content)))
            self.end_headers()
            self.wfile.write(reply.content)

        do_GET = do_POST = do_PUT = do_DELETE = _forward

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", did
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
        client.close()


def test_an_agent_whose_registration_answer_was_lost_gets_its_node_back(tmp_path: Path) -> None:
    """The controller registered the node, but the answer, with the node token, never
    reached the agent. Its next try carries the same registration key and takes the node
    back at once; without the key, the name would be refused (409) until the node was
    lost, here 600 s."""
    cluster = LocalCluster(data_dir=tmp_path, port=free_port())
    try:
        cluster.start_controller({"RELAUNCH_NODE_TIMEOUT_S": "600"})
        with answer_lost_once(cluster.url) as (url, did):
            cluster.start_agent("n1", controller=url)
            wait_for(
                "the agent's heartbeats through the proxy after a lost answer",
                lambda: any("lost" in d for d in did) and any("/heartbeat 200" in d for d in did),
                timeout_s=60,
            )
            registrations = [d for d in did if d.startswith("POST /api/v1/nodes/register")]
            assert registrations[:2] == [
                "POST /api/v1/nodes/register 200: answer lost",
                "POST /api/v1/nodes/register 200",
            ], did
            assert _node(cluster, "n1")["state"] == "ALIVE"
            saved = node_token.token_file(cluster.agent_dir("n1"))
            assert saved.read_text().startswith("rln_")
        assert "needs its node token" not in (tmp_path / "n1.log").read_text()
    finally:
        cluster.stop_all()
