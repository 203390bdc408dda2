"""The routes a fleet calls at its rate go to a worker thread once for their work, and
no more: each trip waits for a free thread and hands the interpreter lock over twice.
FastAPI makes a trip for every plain-function dependency and, after a plain-function
route, another to validate the model the route returned; these routes avoid both."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio.to_thread
import pytest

from contract.rendezvous import MEMBER_HEADER
from service.reconciler import Reconciler
from tests.service.helpers import Cluster, event, report
from tests.service.test_rendezvous import as_node, b64, placed


@contextmanager
def trips(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The functions sent to a worker thread while the block runs, by name."""
    sent: list[str] = []
    real = anyio.to_thread.run_sync

    async def counted(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        sent.append(getattr(func, "__name__", type(func).__name__))
        return await real(func, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(anyio.to_thread, "run_sync", counted)
        yield sent


def test_a_heartbeat_and_a_report_each_go_to_a_worker_thread_once(
    api: Cluster, reconciler: Reconciler, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = placed(api, reconciler, "a")
    node_id, attempt_id = at["node_ids"][0], at["attempt_id"]
    running = {"running": [{"attempt_id": attempt_id}]}
    with trips(monkeypatch) as sent:
        answer = api.post(f"/api/v1/nodes/{node_id}/heartbeat", json=running)
    assert answer.status_code == 200, answer.text
    assert [a["attempt_id"] for a in answer.json()["assignments"]] == [attempt_id]
    assert len(sent) == 1, sent
    progress = [event("progress", step=1, loss=0.5, world_size=1)]
    with trips(monkeypatch) as sent:
        r = report(api, node_id, attempt_id, member_id=at["member_id"], events=progress)
    assert r.status_code == 200, r.text
    assert r.json() == {"accepted": True}
    assert len(sent) == 1, sent


def test_a_store_write_goes_to_a_worker_thread_once(
    api: Cluster, reconciler: Reconciler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its token is checked in the route's own statement that reads the attempt and the
    membership, not on a trip and in a transaction of its own before the route."""
    at = placed(api, reconciler, "a")
    headers = {**as_node(api, at["node_ids"][0]), MEMBER_HEADER: str(at["member_id"])}
    key = {"items": [{"key": "k", "value": b64(b"v")}]}
    with trips(monkeypatch) as sent:
        r = api.post(f"{at['url']}/store/set", json=key, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json() == {"value": 1}
    assert len(sent) == 1, sent
    with trips(monkeypatch) as sent:
        r = api.post(f"{at['url']}/store/add", json={"key": "n", "amount": 2}, headers=headers)
    assert (r.status_code, r.json()) == (200, {"value": 2}), r.text
    assert len(sent) == 1, sent
