"""The rendezvous the controller serves: compare-and-set of the state, the store, who may
use it, its bounds and its cleanup; and the snapshot fence with its worker tokens."""

from __future__ import annotations

import base64
import threading
from typing import Any

import pytest
from sqlalchemy import func, select

from contract.rendezvous import MEMBER_HEADER
from service import rendezvous
from service.db import transaction
from service.models import RendezvousKey, RendezvousState, SnapshotWriter
from service.reconciler import Reconciler
from tests.helpers import FakeClock
from tests.service.helpers import Cluster, bearer, heartbeat, register, report, submit


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def placed(api: Cluster, reconciler: Reconciler, *names: str) -> dict[str, Any]:
    """A job placed on new nodes ``names``; its first node's assignment, with the ids."""
    ids = [register(api, name) for name in names]
    job_id = submit(api, str(len(names)))
    reconciler.run_once()
    [assignment] = heartbeat(api, ids[0])
    return {
        **assignment,
        "node_ids": ids,
        "url": f"/api/v1/rendezvous/{assignment['rendezvous']['rdzv_id']}",
        "job_id": job_id,
    }


def as_node(api: Cluster, node_id: int) -> dict[str, str]:
    return bearer(api.node_tokens[node_id])


def test_the_state_is_written_with_compare_and_set(api: Cluster, reconciler: Reconciler) -> None:
    job = placed(api, reconciler, "a", "b")
    url, (a, b) = job["url"], job["node_ids"]
    # Every answer counts the attempt's active members: two nodes here.
    assert api.get(f"{url}/state", headers=as_node(api, a)).json() == {
        "state": None, "version": 0, "written": False, "members": 2,
    }  # fmt: skip
    first = api.post(f"{url}/state", json={"state": b64(b"one")}, headers=as_node(api, a)).json()
    assert first == {"state": b64(b"one"), "version": 1, "written": True, "members": 2}
    # Another node also writes "only if none": it gets the state that won.
    lost = api.post(f"{url}/state", json={"state": b64(b"two")}, headers=as_node(api, b)).json()
    assert lost == {"state": b64(b"one"), "version": 1, "written": False, "members": 2}
    ok = api.post(
        f"{url}/state", json={"state": b64(b"two"), "version": 1}, headers=as_node(api, b)
    )
    assert ok.json() == {"state": b64(b"two"), "version": 2, "written": True, "members": 2}
    stale = api.post(
        f"{url}/state", json={"state": b64(b"x"), "version": 1}, headers=as_node(api, a)
    ).json()
    assert stale == {"state": b64(b"two"), "version": 2, "written": False, "members": 2}
    assert api.get(f"{url}/state", headers=as_node(api, a)).json()["state"] == b64(b"two")


def test_a_launcher_may_wait_for_the_state_to_change(api: Cluster, reconciler: Reconciler) -> None:
    job = placed(api, reconciler, "a", "b")
    url, (a, b) = job["url"], job["node_ids"]
    api.post(f"{url}/state", json={"state": b64(b"one")}, headers=as_node(api, a))
    # Another version than the one named: at once.
    now = api.get(f"{url}/state", params={"changed_from": 7, "wait_s": 30}, headers=as_node(api, a))
    assert now.json()["version"] == 1
    # The version named: after the wait, unchanged.
    waited = api.get(
        f"{url}/state", params={"changed_from": 1, "wait_s": 0.3}, headers=as_node(api, a)
    )
    assert waited.json()["version"] == 1
    # A write by another node ends the wait with what it wrote.
    writer = threading.Timer(
        0.3,
        lambda: api.post(
            f"{url}/state", json={"state": b64(b"two"), "version": 1}, headers=as_node(api, b)
        ),
    )
    writer.start()
    woken = api.get(
        f"{url}/state", params={"changed_from": 1, "wait_s": 20}, headers=as_node(api, a)
    )
    writer.join()
    assert woken.json()["version"] == 2 and woken.json()["state"] == b64(b"two")
    bad = api.get(f"{url}/state", params={"changed_from": -1}, headers=as_node(api, a))
    assert bad.status_code == 422


def test_store_operations(api: Cluster, reconciler: Reconciler) -> None:
    job = placed(api, reconciler, "a")
    url, headers = job["url"], as_node(api, job["node_ids"][0])

    def call(op: str, **body: Any) -> Any:
        r = api.post(f"{url}/store/{op}", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()

    call("set", items=[{"key": "k", "value": b64(b"v")}, {"key": "k2", "value": b64(b"\x00")}])
    assert call("get", keys=["k", "k2"]) == {
        "values": {"k": b64(b"v"), "k2": b64(b"\x00")}, "complete": True,
    }  # fmt: skip
    assert call("get", keys=["k", "nope"]) == {"values": {"k": b64(b"v")}, "complete": False}
    assert call("get", keys=["k"], with_values=False) == {"values": {}, "complete": True}
    assert call("add", key="n", amount=2)["value"] == 2
    assert call("add", key="n", amount=-5)["value"] == -3
    assert call("get", keys=["n"])["values"]["n"] == b64(b"-3")  # as TCPStore keeps it
    assert call("compare_set", key="c", expected=b64(b"x"), desired=b64(b"y"))["value"] == b64(
        b"x"
    )  # absent and something expected: not set
    assert call("compare_set", key="c", expected="", desired=b64(b"y"))["value"] == b64(b"y")
    assert call("compare_set", key="c", expected=b64(b"z"), desired=b64(b"w"))["value"] == b64(b"y")
    assert api.get(f"{url}/store/num_keys", headers=headers).json() == {"value": 4}
    assert call("delete_key", key="c") == {"deleted": True}
    assert call("delete_key", key="c") == {"deleted": False}
    # add on a value that is not a counter is refused, and changes nothing
    r = api.post(f"{url}/store/add", json={"key": "k", "amount": 1}, headers=headers)
    assert r.status_code == 409
    assert call("get", keys=["k"])["values"]["k"] == b64(b"v")


def test_a_read_waits_for_a_key_written_meanwhile(api: Cluster, reconciler: Reconciler) -> None:
    job = placed(api, reconciler, "a", "b")
    url, (a, b) = job["url"], job["node_ids"]
    written = threading.Event()

    def write_later() -> None:
        written.wait(10)
        api.post(
            f"{url}/store/set",
            json={"items": [{"key": "MASTER_ADDR", "value": b64(b"10.0.0.1")}]},
            headers=as_node(api, b),
        )

    writer = threading.Thread(target=write_later)
    writer.start()
    threading.Timer(0.3, written.set).start()
    reply = api.post(
        f"{url}/store/get", json={"keys": ["MASTER_ADDR"], "wait_s": 5}, headers=as_node(api, a)
    ).json()
    writer.join()
    assert reply == {"values": {"MASTER_ADDR": b64(b"10.0.0.1")}, "complete": True}


def test_only_members_of_the_running_attempt_may_use_its_rendezvous(
    api: Cluster, reconciler: Reconciler
) -> None:
    job = placed(api, reconciler, "a", "b")
    other = placed(api, reconciler, "x")
    url, (a, b) = job["url"], job["node_ids"]
    get = {"keys": ["k"]}
    assert api.post(f"{url}/store/get", json=get, headers=as_node(api, a)).status_code == 200
    # a node of another job
    stranger = as_node(api, other["node_ids"][0])
    for r in (
        api.post(f"{url}/store/get", json=get, headers=stranger),
        api.get(f"{url}/state", headers=stranger),
        api.post(f"{url}/state", json={"state": b64(b"evil")}, headers=stranger),
        api.post(f"{url}/store/add", json={"key": "k", "amount": 1}, headers=stranger),
    ):
        assert r.status_code == 403, r.text
    # no token, a user's token, an unknown token, an unknown rendezvous
    assert api.post(f"{url}/store/get", json=get, headers={"authorization": ""}).status_code == 401
    assert api.post(f"{url}/store/get", json=get, headers=bearer(api.user_token)).status_code == 403
    assert api.post(f"{url}/store/get", json=get, headers=bearer("rln_nope")).status_code == 401
    # the attempt's own worker token is for the fence only
    worker = bearer(job["worker_token"])
    assert api.post(f"{url}/store/get", json=get, headers=worker).status_code == 401
    missing = api.post("/api/v1/rendezvous/nope/store/get", json=get, headers=as_node(api, a))
    assert missing.status_code == 404
    # a refused token is refused first: it learns nothing of which rendezvous exist
    for token, refused in ((bearer("rln_nope"), 401), (bearer(api.user_token), 403)):
        for where in ("nope", url.rsplit("/", 1)[1]):
            add = {"key": "k", "amount": 1}
            r = api.post(f"/api/v1/rendezvous/{where}/store/add", json=add, headers=token)
            assert r.status_code == refused, (where, r.text)
    # a node that left the attempt
    assert api.post(f"/api/v1/nodes/{b}/leave", json={}).status_code == 200
    assert api.post(f"{url}/store/get", json=get, headers=as_node(api, b)).status_code == 403
    assert api.get(f"{url}/state", headers=as_node(api, b)).status_code == 403


def test_a_node_joining_in_place_may_use_the_rendezvous(
    api: Cluster, reconciler: Reconciler
) -> None:
    a = register(api, "a")
    submit(api, "1:2")
    reconciler.run_once()
    [assignment] = heartbeat(api, a)
    url = f"/api/v1/rendezvous/{assignment['rendezvous']['rdzv_id']}"
    b = register(api, "b")
    reconciler.run_once()  # b joins the running attempt
    [joined] = heartbeat(api, b)
    assert joined["attempt_id"] == assignment["attempt_id"]
    assert api.get(f"{url}/state", headers=as_node(api, b)).status_code == 200


def test_the_launcher_of_an_ended_membership_is_refused(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    """A node dropped for silence and placed again in the same attempt runs two
    launchers for a while: the old one, not yet stopped, must not touch the rendezvous
    (torch closes it for everyone when a launcher ends), the new one must."""
    a, b = register(api, "a"), register(api, "b")
    submit(api, "1:2")  # one node is enough: b's loss is a membership change
    reconciler.run_once()
    [old] = heartbeat(api, b)
    url = f"/api/v1/rendezvous/{old['rendezvous']['rdzv_id']}"
    clock.advance(8)
    heartbeat(api, a)
    clock.advance(5)
    reconciler.run_once()  # b lost
    heartbeat(api, b)
    reconciler.run_once()  # b back, placed again in the same attempt
    [new] = heartbeat(api, b)
    assert new["member_id"] != old["member_id"] and new["attempt_id"] == old["attempt_id"]

    def as_member(member_id: Any) -> dict[str, str]:
        return {**as_node(api, b), MEMBER_HEADER: str(member_id)}

    close = {"state": b64(b"closed"), "version": None}
    for r in (
        api.get(f"{url}/state", headers=as_member(old["member_id"])),
        api.post(f"{url}/state", json=close, headers=as_member(old["member_id"])),
        api.post(
            f"{url}/store/add", json={"key": "k", "amount": 1}, headers=as_member(old["member_id"])
        ),
    ):
        assert r.status_code == 403, r.text
        assert "has ended" in r.json()["detail"]
    assert api.get(f"{url}/state", headers=as_member(new["member_id"])).status_code == 200
    assert api.get(f"{url}/state", headers=as_node(api, b)).status_code == 200  # no header
    assert api.get(f"{url}/state", headers=as_member("x")).status_code == 422


def test_sizes_are_bounded(
    api: Cluster, reconciler: Reconciler, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = placed(api, reconciler, "a")
    url, headers = job["url"], as_node(api, job["node_ids"][0])

    def set_(key: str, value: bytes) -> Any:
        return api.post(
            f"{url}/store/set", json={"items": [{"key": key, "value": b64(value)}]}, headers=headers
        )

    big = set_("k", b"x" * (rendezvous.MAX_VALUE_BYTES + 1))
    assert big.status_code == 413 and "over" in big.json()["detail"]
    state = api.post(
        f"{url}/state",
        json={"state": b64(b"s" * (rendezvous.MAX_STATE_BYTES + 1))},
        headers=headers,
    )
    assert state.status_code == 413
    assert set_("k" * 513, b"v").status_code == 422
    assert set_("", b"v").status_code == 422
    assert set_("nul\x00", b"v").status_code == 422
    bad_id = api.post("/api/v1/rendezvous/x%00y/store/get", json={"keys": ["k"]}, headers=headers)
    assert bad_id.status_code == 422
    bad = api.post(
        f"{url}/store/set", json={"items": [{"key": "k", "value": "not base64!"}]}, headers=headers
    )
    assert bad.status_code == 422
    assert api.post(f"{url}/state", json={"state": "@@"}, headers=headers).status_code == 422
    assert api.post(f"{url}/store/get", json={"keys": []}, headers=headers).status_code == 422
    huge = {"key": "n", "amount": 2**63}
    assert api.post(f"{url}/store/add", json=huge, headers=headers).status_code == 422
    assert api.post(f"{url}/store/get", content=b"{", headers=headers).status_code == 422

    monkeypatch.setattr(rendezvous, "MAX_KEYS_PER_ATTEMPT", 2)
    assert set_("one", b"1").status_code == 200
    assert set_("two", b"2").status_code == 200
    assert set_("two", b"again").status_code == 200  # replacing a key adds none
    assert set_("three", b"3").status_code == 413
    assert (
        api.post(f"{url}/store/add", json={"key": "n", "amount": 1}, headers=headers).status_code
        == 413
    )


def _rows(api: Cluster, model: Any) -> int:
    with transaction(api.app.state.session_factory) as session:  # type: ignore[attr-defined]
        return int(session.scalar(select(func.count()).select_from(model)) or 0)


def test_an_attempts_rendezvous_and_a_jobs_fence_go_when_they_end(
    api: Cluster, reconciler: Reconciler
) -> None:
    job = placed(api, reconciler, "a")
    url, a = job["url"], job["node_ids"][0]
    api.post(f"{url}/state", json={"state": b64(b"s")}, headers=as_node(api, a))
    api.post(
        f"{url}/store/set",
        json={"items": [{"key": "k", "value": b64(b"v")}]},
        headers=as_node(api, a),
    )
    writer = f"/api/v1/workers/jobs/{job['job_id']}/snapshot-writer"
    assert api.post(writer, headers=bearer(job["worker_token"])).json() == {"token": 1}
    assert (_rows(api, RendezvousState), _rows(api, RendezvousKey), _rows(api, SnapshotWriter)) == (
        1,
        1,
        1,
    )

    exit_ = {"outcome": "succeeded", "exit_code": 0}
    assert report(api, a, job["attempt_id"], exit=exit_).status_code == 200
    assert api.get(f"/api/v1/jobs/{job['job_id']}").json()["state"] == "SUCCEEDED"
    assert (_rows(api, RendezvousState), _rows(api, RendezvousKey), _rows(api, SnapshotWriter)) == (
        0,
        0,
        0,
    )
    assert api.get(f"{url}/state", headers=as_node(api, a)).status_code == 403


def test_a_worker_token_fences_only_its_own_job(api: Cluster, reconciler: Reconciler) -> None:
    mine = placed(api, reconciler, "a")
    theirs = placed(api, reconciler, "b")
    writer = f"/api/v1/workers/jobs/{mine['job_id']}/snapshot-writer"
    token = bearer(mine["worker_token"])
    assert api.get(writer, headers=token).json() == {"token": 0}
    assert api.post(writer, headers=token).json() == {"token": 1}
    assert api.post(writer, headers=token).json() == {"token": 2}
    assert api.get(writer, headers=token).json() == {"token": 2}

    # Another job's worker token, a node's token, a user's, none: refused, nothing taken.
    foreign = bearer(theirs["worker_token"])
    assert api.post(writer, headers=foreign).status_code == 403
    assert api.get(writer, headers=foreign).status_code == 403
    assert api.post(writer, headers=as_node(api, mine["node_ids"][0])).status_code == 401
    assert api.post(writer, headers=bearer(api.user_token)).status_code == 401
    assert api.post(writer, headers={"authorization": ""}).status_code == 401
    assert api.get(writer, headers=token).json() == {"token": 2}

    # A node is sent a new worker token while it does not run the attempt; the one its
    # workers hold stays good once it reports running it.
    running = {"running": [{"attempt_id": mine["attempt_id"]}]}
    node = mine["node_ids"][0]
    [again] = api.post(f"/api/v1/nodes/{node}/heartbeat", json=running).json()["assignments"]
    assert again["worker_token"] is None
    assert api.get(writer, headers=token).status_code == 200

    # Its node leaves: the token is no longer good.
    assert api.post(f"/api/v1/nodes/{node}/leave", json={}).status_code == 200
    assert api.get(writer, headers=token).status_code == 401
