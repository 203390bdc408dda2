"""Who may register a node: the name of an ALIVE node needs its node token, and per-node
enrolment tokens admit registrations while they are live (through the API, with the
real app on each database and a movable clock)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from contract.protocol import Heartbeat
from service.api.app import create_app
from service.db import transaction
from service.errors import Unauthenticated
from service.models import Role
from service.nodes import record_heartbeat
from service.reconciler import Reconciler
from service.settings import ControllerSettings
from tests.helpers import FakeClock
from tests.service.helpers import Cluster, bearer, heartbeat, job, register, submit

REGISTER = "/api/v1/nodes/register"
TOKENS = "/api/v1/enrolment-tokens"


def register_as(
    client: TestClient,
    credential: str,
    name: str,
    node_token: str | None = None,
    key: str | None = None,
) -> httpx.Response:
    body = {
        "name": name,
        "address": "10.0.0.9",
        "slots": 1,
        "pid": 1,
        "node_token": node_token,
        "registration_key": key,
    }
    return client.post(REGISTER, json=body, headers=bearer(credential))


def make_token(api: TestClient, **body: Any) -> tuple[int, str]:
    r = api.post(TOKENS, json=body)
    assert r.status_code == 201, r.text
    made = r.json()
    return made["token"]["id"], made["secret"]


def listed(api: TestClient, token_id: int) -> dict[str, Any]:
    [row] = [t for t in api.get(TOKENS).json()["items"] if t["id"] == token_id]
    return row


def test_the_name_of_an_alive_node_needs_its_node_token(
    api: Cluster, reconciler: Reconciler
) -> None:
    a = register(api, "a")
    b = register(api, "b")
    job_id = submit(api, "1:1")
    reconciler.run_once()
    attempt = job(api, job_id)["attempts"][0]
    assert [m["node_name"] for m in attempt["members"]] == ["a"]
    shared = api.app.state.settings.enrolment_token.get_secret_value()  # type: ignore[attr-defined]
    for node_token in (None, "rln_wrong", api.node_tokens[b]):
        r = register_as(api, shared, "a", node_token)
        assert r.status_code == 409, (node_token, r.text)
        assert (
            r.json()["detail"] == "node a is alive; registering under its name needs its node token"
        )
    # Nothing changed: a still runs its attempt, with its token.
    [assignment] = heartbeat(api, a)
    assert assignment["attempt_id"] == attempt["id"]
    assert job(api, job_id)["state"] == "RUNNING"
    # Its own agent, restarted, takes the name back with the token it kept.
    old = api.node_tokens[a]
    r = register_as(api, shared, "a", old)
    assert r.status_code == 200, r.text
    assert r.json()["node_id"] == a and r.json()["node_token"] != old
    assert (
        api.post(
            f"/api/v1/nodes/{a}/heartbeat", json={"running": []}, headers=bearer(old)
        ).status_code
        == 401
    )


KEY = "k" * 43
OTHER_KEY = "o" * 43


def test_a_retried_registration_whose_answer_was_lost_gets_its_node_back(
    api: Cluster, reconciler: Reconciler
) -> None:
    """The first try registered the node and a pass placed a job on it, but its answer
    (the node token) never reached the agent. The next try, with the same registration
    key and no token, takes the node back with a new token and keeps the placement (the
    agent cannot have started it); a try with another key, or none, is a stranger."""
    shared = api.app.state.settings.enrolment_token.get_secret_value()  # type: ignore[attr-defined]
    lost = register_as(api, shared, "a", key=KEY)
    assert lost.status_code == 200, lost.text
    node_id, lost_token = lost.json()["node_id"], lost.json()["node_token"]
    job_id = submit(api, "1:1")
    reconciler.run_once()
    [attempt] = job(api, job_id)["attempts"]
    for key in (None, OTHER_KEY):
        r = register_as(api, shared, "a", key=key)
        assert r.status_code == 409, (key, r.text)
    retried = register_as(api, shared, "a", key=KEY)
    assert retried.status_code == 200, retried.text
    token = retried.json()["node_token"]
    assert retried.json()["node_id"] == node_id and token != lost_token
    beat = {"running": []}
    path = f"/api/v1/nodes/{node_id}/heartbeat"
    assert api.post(path, json=beat, headers=bearer(lost_token)).status_code == 401
    r = api.post(path, json=beat, headers=bearer(token))
    assert r.status_code == 200, r.text
    [assignment] = r.json()["assignments"]
    assert assignment["attempt_id"] == attempt["id"]
    assert job(api, job_id)["membership_changes"] == 0
    assert [m["state"] for m in job(api, job_id)["attempts"][0]["members"]] == ["ACTIVE"]
    # The token arrived (a heartbeat came with it): the key is spent, and a late copy of
    # the retry cannot take back a node that may now run its job.
    assert register_as(api, shared, "a", key=KEY).status_code == 409
    # A restarted agent (a new key, its kept token) takes the node back; until its token
    # is used, its key is the one that works, not the old one.
    restarted = register_as(api, shared, "a", token, key=OTHER_KEY)
    assert restarted.status_code == 200, restarted.text
    assert register_as(api, shared, "a", key=KEY).status_code == 409
    assert register_as(api, shared, "a", key=OTHER_KEY).status_code == 200


def test_a_registration_key_is_checked(api: Cluster) -> None:
    shared = api.app.state.settings.enrolment_token.get_secret_value()  # type: ignore[attr-defined]
    for bad in ("short", "k" * 129, "k" * 42 + "!"):
        r = register_as(api, shared, "a", key=bad)
        assert r.status_code == 422, (bad, r.text)
        assert "registration_key" in r.text
    assert api.get("/api/v1/nodes").json()["items"] == []


def test_the_name_of_a_node_that_left_or_was_lost_is_free_to_an_admitted_agent(
    api: Cluster, reconciler: Reconciler, clock: FakeClock
) -> None:
    shared = api.app.state.settings.enrolment_token.get_secret_value()  # type: ignore[attr-defined]
    a, b = register(api, "a"), register(api, "b")
    assert api.post(f"/api/v1/nodes/{a}/leave", json={}).json() == {"left": True}
    reconciler.run_once()  # leads from now on
    clock.advance(11)  # b silent past the timeout
    reconciler.run_once()
    states = {n["name"]: n["state"] for n in api.get("/api/v1/nodes").json()["items"]}
    assert states == {"a": "LEFT", "b": "LOST"}
    for name, node_id in (("a", a), ("b", b)):
        r = register_as(api, shared, name)
        assert r.status_code == 200, r.text
        assert r.json()["node_id"] == node_id


def test_a_per_node_token_admits_one_registration_by_default(api: Cluster) -> None:
    token_id, secret = make_token(api)
    assert secret.startswith("rle_")
    row = listed(api, token_id)
    assert (row["single_use"], row["node_name"], row["used_at"], row["revoked_at"]) == (
        True,
        None,
        None,
        None,
    )
    assert "secret" not in row and secret not in str(api.get(TOKENS).json())
    first = register_as(api, secret, "n1")
    assert first.status_code == 200, first.text
    assert first.json()["node_token"].startswith("rln_")
    again = register_as(api, secret, "n2")
    assert again.status_code == 401
    assert "already used" in again.json()["detail"]
    assert listed(api, token_id)["used_at"] is not None


def test_a_single_use_token_admits_the_retry_of_the_registration_that_used_it(
    api: Cluster,
) -> None:
    """The try that used the token registered the node, but its answer was lost: the retry
    with the same registration key is admitted again. Another key, another name, or the
    same key once the node's token was used (a heartbeat) are refused as a used token."""
    _, secret = make_token(api, node_name="n1")
    assert register_as(api, secret, "n1", key=KEY).status_code == 200  # answer lost
    for name, key, status in (("n1", None, 401), ("n1", OTHER_KEY, 401), ("n2", KEY, 401)):
        r = register_as(api, secret, name, key=key)
        assert r.status_code == status, (name, key, r.text)
    retried = register_as(api, secret, "n1", key=KEY)
    assert retried.status_code == 200, retried.text
    node_id, token = retried.json()["node_id"], retried.json()["node_token"]
    beat = api.post(
        f"/api/v1/nodes/{node_id}/heartbeat", json={"running": []}, headers=bearer(token)
    )
    assert beat.status_code == 200, beat.text
    late = register_as(api, secret, "n1", key=KEY)
    assert late.status_code == 401 and "already used" in late.json()["detail"], late.text
    _, unbound = make_token(api)
    assert register_as(api, unbound, "n2", key=OTHER_KEY).status_code == 200
    assert register_as(api, unbound, "n1", key=OTHER_KEY).status_code == 401  # not n1's key


def test_a_reusable_per_node_token_admits_until_it_expires(api: Cluster, clock: FakeClock) -> None:
    _, secret = make_token(api, single_use=False, expires_in_s=3600)
    for name in ("n1", "n2", "n3"):
        assert register_as(api, secret, name).status_code == 200
    clock.advance(3600)
    r = register_as(api, secret, "n4")
    assert r.status_code == 401 and "expired" in r.json()["detail"]


def test_an_expired_per_node_token_is_refused(api: Cluster, clock: FakeClock) -> None:
    token_id, secret = make_token(api, expires_in_s=60)
    assert listed(api, token_id)["expires_at"].startswith("2026-01-01T00:01:00")
    clock.advance(61)
    r = register_as(api, secret, "n1")
    assert r.status_code == 401
    assert r.json()["detail"].startswith("this enrolment token expired at 2026-01-01 00:01:00")


def test_a_revoked_per_node_token_is_refused_at_once(api: Cluster) -> None:
    token_id, secret = make_token(api, single_use=False)
    assert register_as(api, secret, "n1").status_code == 200
    r = api.post(f"{TOKENS}/{token_id}/revoke")
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    assert api.post(f"{TOKENS}/{token_id}/revoke").json() == r.json()  # again: no change
    refused = register_as(api, secret, "n2")
    assert refused.status_code == 401
    assert "revoked" in refused.json()["detail"]
    assert api.post(f"{TOKENS}/999999/revoke").status_code == 404


def test_a_per_node_token_bound_to_a_name_admits_only_that_name(api: Cluster) -> None:
    _, secret = make_token(api, node_name="gpu-1")
    r = register_as(api, secret, "gpu-2")
    assert r.status_code == 403 and "does not admit the name 'gpu-2'" in r.json()["detail"]
    assert register_as(api, secret, "gpu-1").status_code == 200  # not used up by the refusal


def test_a_token_is_not_used_up_by_a_registration_refused_for_an_alive_name(
    api: Cluster,
) -> None:
    register(api, "a")
    _, secret = make_token(api)
    assert register_as(api, secret, "a").status_code == 409
    assert register_as(api, secret, "b").status_code == 200


def test_an_unknown_token_gets_the_same_answer_whatever_it_looks_like(api: Cluster) -> None:
    make_token(api)
    answers = {
        (r.status_code, r.json()["detail"])
        for r in (register_as(api, t, "n1") for t in ("rle_" + "x" * 43, "x" * 32, "rlu_x"))
    }
    assert answers == {(401, "the enrolment token is wrong")}


def test_one_single_use_token_racing_admits_exactly_one_node(api: Cluster) -> None:
    _, secret = make_token(api)
    barrier = threading.Barrier(6)
    codes: list[int] = []

    def race(name: str) -> None:
        barrier.wait()
        codes.append(register_as(api, secret, name).status_code)

    threads = [threading.Thread(target=race, args=(f"n{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200] + [401] * 5, codes
    assert len(api.get("/api/v1/nodes").json()["items"]) == 1


def test_tries_of_one_registration_racing_with_a_single_use_token_are_all_admitted(
    api: Cluster,
) -> None:
    """An agent's tries of one registration may overlap (a retry sent while the first
    still runs): the one that waited for the token's use reads the node the first made,
    and is admitted as its retry, not refused as a used token."""
    _, secret = make_token(api, node_name="n1")
    barrier = threading.Barrier(4)
    answers: list[httpx.Response] = []

    def race() -> None:
        barrier.wait()
        answers.append(register_as(api, secret, "n1", key=KEY))

    threads = [threading.Thread(target=race) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    [node] = api.get("/api/v1/nodes").json()["items"]
    live = [
        r.json()["node_token"]
        for r in answers
        if api.post(
            f"/api/v1/nodes/{node['id']}/heartbeat",
            json={"running": []},
            headers=bearer(r.json()["node_token"]),
        ).status_code
        == 200
    ]
    assert len(live) == 1  # the last registration's token; the others were replaced


def test_a_heartbeat_with_a_token_replaced_meanwhile_does_not_spend_the_new_key(
    api: Cluster,
) -> None:
    """The slow way of a heartbeat (a LOST node) checks the caller's token again under the
    row's lock: a registration that committed since made it stale, and the new agent's
    key stays unspent for its retry."""
    shared = api.app.state.settings.enrolment_token.get_secret_value()  # type: ignore[attr-defined]
    first = register_as(api, shared, "a", key=OTHER_KEY).json()
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    again = register_as(api, shared, "a", first["node_token"], key=KEY)
    assert again.status_code == 200, again.text
    with transaction(factory) as session, pytest.raises(Unauthenticated, match="registered again"):
        record_heartbeat(
            session, first["node_id"], Heartbeat(), datetime.now(UTC), token=first["node_token"]
        )
    assert register_as(api, shared, "a", key=KEY).status_code == 200  # the key is unspent


def test_only_admins_make_list_and_revoke_per_node_tokens(api: Cluster) -> None:
    token_id, _ = make_token(api)
    alice = bearer(api.add_user("alice", Role.USER))
    assert api.post(TOKENS, json={}, headers=alice).status_code == 403
    assert api.get(TOKENS, headers=alice).status_code == 403
    assert api.post(f"{TOKENS}/{token_id}/revoke", headers=alice).status_code == 403
    assert listed(api, token_id)["revoked_at"] is None


def test_per_node_tokens_are_stored_only_as_hashes(api: Cluster) -> None:
    _, secret = make_token(api, node_name="n1")
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        dump = "\n".join(str(r) for r in session.execute(text("SELECT * FROM enrolment_tokens")))
    assert secret not in dump and secret[4:] not in dump


def test_a_controller_without_a_shared_token_admits_nodes_with_per_node_tokens(
    settings: ControllerSettings, clock: FakeClock
) -> None:
    closed = settings.model_copy(update={"enrolment_token": None})
    with Cluster(create_app(closed, clock=clock, run_background=False)) as client:
        client.node_tokens, client.name_tokens = {}, {}
        client.user_token = client.add_user("root", Role.ADMIN)
        _, secret = make_token(client, node_name="n1")
        r = register_as(client, secret, "n1")
        assert r.status_code == 200, r.text
