"""Who may call what: every route of the OpenAPI document, walked as each kind of caller."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text

from service import auth
from service.api import deps, users
from service.api.app import FIRST_ADMIN_BANNER, create_app
from service.db import transaction
from service.models import ApiToken, Role, User
from service.settings import ControllerSettings
from tests.helpers import FakeClock
from tests.service.helpers import ENROLMENT_TOKEN, Cluster, bearer, register, submit

PUBLIC = {("GET", "/healthz")}
ADMIN_ONLY = {
    ("POST", "/api/v1/users"),
    ("GET", "/api/v1/users"),
    ("GET", "/api/v1/users/{user_id}/tokens"),
    ("POST", "/api/v1/users/{user_id}/tokens"),
    ("POST", "/api/v1/tokens/{token_id}/revoke"),
    ("POST", "/api/v1/enrolment-tokens"),
    ("GET", "/api/v1/enrolment-tokens"),
    ("POST", "/api/v1/enrolment-tokens/{token_id}/revoke"),
}
NODE_ROUTES = {
    ("POST", "/api/v1/nodes/{node_id}/heartbeat"),
    ("POST", "/api/v1/nodes/{node_id}/reports"),
    ("POST", "/api/v1/nodes/{node_id}/leave"),
}
# A node's launcher keeps its attempt's rendezvous here; workers their job's snapshot fence.
RDZV = "/api/v1/rendezvous/{rdzv_id}"
RENDEZVOUS_ROUTES = {
    ("GET", f"{RDZV}/state"),
    ("POST", f"{RDZV}/state"),
    ("POST", f"{RDZV}/store/set"),
    ("POST", f"{RDZV}/store/get"),
    ("POST", f"{RDZV}/store/add"),
    ("POST", f"{RDZV}/store/compare_set"),
    ("POST", f"{RDZV}/store/delete_key"),
    ("GET", f"{RDZV}/store/num_keys"),
}
WORKER_ROUTES = {
    ("GET", "/api/v1/workers/jobs/{job_id}/snapshot-writer"),
    ("POST", "/api/v1/workers/jobs/{job_id}/snapshot-writer"),
}
REGISTER = ("POST", "/api/v1/nodes/register")
# Routes about one job: another user's job must look like no job at all.
JOB_ROUTES = re.compile(r"^/api/v1/jobs/\{job_id\}")

BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/api/v1/jobs"): {"name": "walk", "task": {"name": "regression"}},
    ("POST", "/api/v1/users"): {"name": "walker"},
    ("POST", "/api/v1/users/{user_id}/tokens"): {"label": "walk"},
    ("POST", "/api/v1/enrolment-tokens"): {},
    REGISTER: {"name": "walk-node", "address": "127.0.0.1", "slots": 1, "pid": 1},
    ("POST", "/api/v1/nodes/{node_id}/heartbeat"): {"running": []},
    ("POST", "/api/v1/nodes/{node_id}/reports"): {"attempt_id": 1},
    ("POST", "/api/v1/nodes/{node_id}/leave"): {},
    ("POST", f"{RDZV}/state"): {"state": "AA=="},
    ("POST", f"{RDZV}/store/set"): {"items": [{"key": "k", "value": "AA=="}]},
    ("POST", f"{RDZV}/store/get"): {"keys": ["k"]},
    ("POST", f"{RDZV}/store/add"): {"key": "k", "amount": 1},
    ("POST", f"{RDZV}/store/compare_set"): {"key": "k", "expected": "", "desired": "AA=="},
    ("POST", f"{RDZV}/store/delete_key"): {"key": "k"},
}


def routes(app: Any) -> list[tuple[str, str]]:
    paths = app.openapi()["paths"]
    return sorted((method.upper(), path) for path, ops in paths.items() for method in ops)


class World:
    """Two users with a job each, an admin, and a registered node."""

    def __init__(self, api: Cluster) -> None:
        self.api = api
        self.alice = api.add_user("alice")
        self.bob = api.add_user("bob")
        self.alice_job = submit_as(api, self.alice)
        self.bob_job = submit_as(api, self.bob)
        self.node = register(api, "n1")
        self.node_token = api.node_tokens[self.node]
        self.alice_id = api.get("/api/v1/users/me", headers=bearer(self.alice)).json()["id"]

    def url(self, path: str, job_id: int | None = None) -> str:
        return path.format(
            job_id=job_id or self.alice_job,
            node_id=self.node,
            user_id=self.alice_id,
            token_id=1,
            rdzv_id="relaunch-job1-attempt1",
        )

    def call(self, method: str, path: str, token: str | None, job_id: int | None = None) -> Any:
        headers = bearer(token) if token is not None else {"authorization": ""}
        body = BODIES.get((method, path))
        return self.api.request(
            method, self.url(path, job_id), headers=headers, json=body if body else None
        )


def submit_as(api: Cluster, token: str, **extra: Any) -> int:
    spec = {"name": "mine", "task": {"name": "regression"}, **extra}
    r = api.post("/api/v1/jobs", json=spec, headers=bearer(token))
    assert r.status_code == 201, r.text
    job_id: int = r.json()["id"]
    return job_id


@pytest.fixture
def world(api: Cluster) -> World:
    return World(api)


def test_the_walk_covers_every_route(api: Cluster) -> None:
    known = PUBLIC | ADMIN_ONLY | NODE_ROUTES | RENDEZVOUS_ROUTES | WORKER_ROUTES | {REGISTER}
    user_routes = [r for r in routes(api.app) if r not in known]
    assert len(user_routes) == 11, user_routes  # a new route must be walked too
    assert {r for r in known if r in routes(api.app)} == known


def test_every_route_but_the_health_check_answers_401_without_a_credential(
    world: World,
) -> None:
    for method, path in routes(world.api.app):
        for token in (None, "", "rlu_not-a-real-token", "rln_not-a-real-token", "garbage"):
            r = world.call(method, path, token)
            if (method, path) in PUBLIC:
                assert r.status_code == 200
                continue
            assert r.status_code == 401, (method, path, token, r.status_code, r.text)
            assert r.headers["www-authenticate"] == "Bearer"


def test_users_are_refused_admin_routes_and_node_routes(world: World) -> None:
    for method, path in sorted(ADMIN_ONLY | NODE_ROUTES | RENDEZVOUS_ROUTES):
        r = world.call(method, path, world.alice)
        assert r.status_code == 403, (method, path, r.text)
    for method, path in sorted(WORKER_ROUTES):  # a user's token is no worker token
        assert world.call(method, path, world.alice).status_code == 401
    r = world.call(*REGISTER, world.alice)  # a user token is not the enrolment token
    assert r.status_code == 401


def test_a_node_token_is_refused_every_user_route(world: World) -> None:
    for method, path in routes(world.api.app):
        if (method, path) in PUBLIC | NODE_ROUTES | RENDEZVOUS_ROUTES or (method, path) == REGISTER:
            continue
        if (method, path) in WORKER_ROUTES:  # a node's token is no worker token
            assert world.call(method, path, world.node_token).status_code == 401
            continue
        r = world.call(method, path, world.node_token)
        assert r.status_code == 403, (method, path, r.text)
        assert "node" in r.json()["detail"]


def test_another_users_job_answers_404_on_every_job_route(world: World) -> None:
    job_routes = [r for r in routes(world.api.app) if JOB_ROUTES.match(r[1])]
    assert len(job_routes) == 7
    for method, path in job_routes:
        theirs = world.call(method, path, world.alice, job_id=world.bob_job)
        missing = world.call(method, path, world.alice, job_id=10**9)
        assert theirs.status_code == missing.status_code == 404, (method, path)
        # The same answer as a job that does not exist: no hint that it exists.
        assert theirs.json()["detail"] == f"job {world.bob_job} does not exist"
        mine = world.call(method, path, world.alice)
        assert mine.status_code == 200, (method, path, mine.text)
    bob = world.api.get(f"/api/v1/jobs/{world.bob_job}", headers=bearer(world.bob))
    assert bob.json()["state"] == "PENDING"  # alice's cancel did not touch it


def test_a_user_lists_only_their_jobs_and_an_admin_lists_all(world: World) -> None:
    mine = world.api.get("/api/v1/jobs", headers=bearer(world.alice)).json()
    assert [j["id"] for j in mine["items"]] == [world.alice_job] and mine["total"] == 1
    assert mine["items"][0]["owner"] == "alice"
    every = world.api.get("/api/v1/jobs").json()  # the admin
    assert {world.alice_job, world.bob_job} <= {j["id"] for j in every["items"]}


def test_nodes_show_the_job_they_serve_only_to_its_owner(world: World, reconciler: Any) -> None:
    reconciler.run_once()  # places alice's job on n1 (the first submitted)
    seen = {
        who: world.api.get("/api/v1/nodes", headers=bearer(token)).json()["items"][0]
        for who, token in (("alice", world.alice), ("bob", world.bob))
    }
    assert seen["alice"]["job_id"] == world.alice_job and seen["alice"]["busy"]
    assert seen["bob"]["job_id"] is None and seen["bob"]["attempt_id"] is None
    assert seen["bob"]["busy"]


def attempt_and_nodes(api: Cluster, reconciler: Any) -> tuple[int, dict[str, Any], int, int]:
    """A job of one node placed on one of two: its id, its attempt, the node it runs on
    and the other node."""
    a, b = register(api, "a"), register(api, "b")
    job_id = submit(api, "1:1")
    reconciler.run_once()
    attempt: dict[str, Any] = api.get(f"/api/v1/jobs/{job_id}").json()["attempts"][0]
    owner: int = attempt["members"][0]["node_id"]
    return job_id, attempt, owner, b if owner == a else a


def test_a_node_acts_only_as_itself(api: Cluster, reconciler: Any) -> None:
    job_id, attempt, owner, other = attempt_and_nodes(api, reconciler)
    as_other = bearer(api.node_tokens[other])
    for path, body in (
        (f"/api/v1/nodes/{owner}/heartbeat", {"running": []}),
        (f"/api/v1/nodes/{owner}/reports", {"attempt_id": attempt["id"]}),
        (f"/api/v1/nodes/{owner}/leave", {}),
    ):
        assert api.post(path, json=body, headers=as_other).status_code == 403, path
    # Under its own id, the other node is fenced from an attempt it is not in.
    r = api.post(
        f"/api/v1/nodes/{other}/reports", json={"attempt_id": attempt["id"]}, headers=as_other
    )
    assert r.status_code == 409
    assert api.get(f"/api/v1/jobs/{job_id}").json()["state"] == "RUNNING"


def test_a_report_with_a_token_not_the_nodes_writes_nothing(api: Cluster, reconciler: Any) -> None:
    """The report's own transaction checks the token: a refused one leaves no line."""
    job_id, attempt, owner, other = attempt_and_nodes(api, reconciler)
    line = {"time": "2026-01-01T00:00:00Z", "line": "forged"}
    body = {"attempt_id": attempt["id"], "logs": [line]}
    for token, refused in ((api.node_tokens[other], 403), ("rln_" + "x" * 43, 401), (None, 401)):
        headers = bearer(token) if token is not None else {"authorization": ""}
        r = api.post(f"/api/v1/nodes/{owner}/reports", json=body, headers=headers)
        assert r.status_code == refused, r.text
    no_node = owner + other + 1  # an id no node has
    assert api.post(f"/api/v1/nodes/{no_node}/reports", json=body).status_code in (401, 403)
    assert "forged" not in api.get(f"/api/v1/jobs/{job_id}/logs").text
    own = bearer(api.node_tokens[owner])
    r = api.post(f"/api/v1/nodes/{owner}/reports", json=body, headers=own)
    assert r.status_code == 200, r.text
    assert "forged" in api.get(f"/api/v1/jobs/{job_id}/logs").text


def test_registering_again_replaces_the_node_token(api: Cluster) -> None:
    node = register(api, "a")
    old = api.node_tokens[node]
    assert register(api, "a") == node
    assert api.node_tokens[node] != old
    beat = api.post(f"/api/v1/nodes/{node}/heartbeat", json={"running": []}, headers=bearer(old))
    assert beat.status_code == 401


def test_registration_needs_the_enrolment_token(
    settings: ControllerSettings, clock: FakeClock
) -> None:
    body = BODIES[REGISTER]
    with TestClient(create_app(settings, clock=clock, run_background=False)) as client:
        assert client.post("/api/v1/nodes/register", json=body).status_code == 401
        wrong = client.post("/api/v1/nodes/register", json=body, headers=bearer("x" * 32))
        assert wrong.status_code == 401
        right = client.post("/api/v1/nodes/register", json=body, headers=bearer(ENROLMENT_TOKEN))
        assert right.status_code == 200 and right.json()["node_token"].startswith("rln_")
    # Without a shared token, only a per-node token an admin made admits a node.
    closed = settings.model_copy(update={"enrolment_token": None})
    with TestClient(create_app(closed, clock=clock, run_background=False)) as client:
        r = client.post("/api/v1/nodes/register", json=body, headers=bearer(ENROLMENT_TOKEN))
        assert r.status_code == 401 and "RELAUNCH_ENROLMENT_TOKEN" in r.json()["detail"]
        assert "relaunch nodes token create" in r.json()["detail"]


def test_the_first_start_makes_one_admin_and_shows_its_token_once(
    settings: ControllerSettings, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    with TestClient(create_app(settings, clock=clock, run_background=False)) as client:
        out = capsys.readouterr().err.splitlines()
        token = out[out.index(FIRST_ADMIN_BANNER) + 1]
        me = client.get("/api/v1/users/me", headers=bearer(token)).json()
        assert me["name"] == "admin" and me["role"] == "admin"
    with TestClient(create_app(settings, clock=clock, run_background=False)):
        assert FIRST_ADMIN_BANNER not in capsys.readouterr().err  # a restart makes none


def test_controllers_starting_together_make_one_admin(api: Cluster) -> None:
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:  # back to an empty users table
        session.execute(text("DELETE FROM jobs"))
        session.execute(text("DELETE FROM users"))
    tokens: list[str | None] = []
    barrier = threading.Barrier(6)

    def start() -> None:
        barrier.wait()
        tokens.append(auth.bootstrap_admin(factory, api.app.state.clock()))  # type: ignore[attr-defined]

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len([t for t in tokens if t]) == 1, tokens


def test_tokens_are_stored_only_as_hashes(world: World) -> None:
    factory = world.api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        dump = "\n".join(
            str(row)
            for table in ("users", "api_tokens", "nodes")
            for row in session.execute(text(f"SELECT * FROM {table}"))
        )
        stored = {r.token_hash for r in session.scalars(select(ApiToken))}
    for token in (world.alice, world.bob, world.node_token, world.api.user_token):
        assert token not in dump
    assert auth.token_hash(world.alice) in stored


def test_a_revoked_token_is_refused_at_once(world: World) -> None:
    made = world.api.post(f"/api/v1/users/{world.alice_id}/tokens", json={"label": "ci"})
    assert made.status_code == 201
    second, token_id = made.json()["secret"], made.json()["token"]["id"]
    assert world.api.get("/api/v1/users/me", headers=bearer(second)).status_code == 200
    listed = world.api.get(f"/api/v1/users/{world.alice_id}/tokens").json()["items"]
    assert [t["label"] for t in listed] == ["initial", "ci"]
    assert second not in str(listed)
    revoked = world.api.post(f"/api/v1/tokens/{token_id}/revoke")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert world.api.get("/api/v1/users/me", headers=bearer(second)).status_code == 401
    assert world.api.get("/api/v1/users/me", headers=bearer(world.alice)).status_code == 200


def test_an_admin_makes_users_and_names_are_unique(api: Cluster) -> None:
    made = api.post("/api/v1/users", json={"name": "erin", "role": "admin"})
    assert made.status_code == 201
    erin = made.json()["token"]["secret"]
    assert api.get("/api/v1/users", headers=bearer(erin)).status_code == 200
    again = api.post("/api/v1/users", json={"name": "erin"})
    assert again.status_code == 409 and "already exists" in again.json()["detail"]
    bad = api.post("/api/v1/users", json={"name": "../etc", "role": "root"})
    assert bad.status_code == 422
    users = api.get("/api/v1/users").json()
    names = {u["name"] for u in users["items"]}
    assert users["total"] == 3 and names == {"admin", "root", "erin"}  # admin: the first start


def test_an_unowned_job_from_before_users_is_seen_only_by_admins(world: World) -> None:
    factory = world.api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        session.execute(
            text("UPDATE jobs SET owner_id = NULL WHERE id = :id"), {"id": world.bob_job}
        )
    assert world.api.get(f"/api/v1/jobs/{world.bob_job}").json()["owner"] is None
    r = world.api.get(f"/api/v1/jobs/{world.bob_job}", headers=bearer(world.bob))
    assert r.status_code == 404


def test_roles_are_what_the_table_allows(api: Cluster) -> None:
    assert {r.value for r in Role} == {"admin", "user"}
    r = api.post("/api/v1/users", json={"name": "mallory", "role": "superuser"})
    assert r.status_code == 422


def test_the_last_live_admin_token_cannot_be_revoked(api: Cluster) -> None:
    admins = [u for u in api.get("/api/v1/users").json()["items"] if u["role"] == "admin"]
    live = [
        t["id"]
        for u in admins
        for t in api.get(f"/api/v1/users/{u['id']}/tokens").json()["items"]
        if t["revoked_at"] is None
    ]
    assert len(live) == 2  # the first start's admin and the fixture's
    *others, mine = sorted(live)  # the fixture's admin (made last) calls
    for token_id in others:
        assert api.post(f"/api/v1/tokens/{token_id}/revoke").status_code == 200
    last = api.post(f"/api/v1/tokens/{mine}/revoke")
    assert last.status_code == 409 and "last live admin token" in last.json()["detail"]
    assert api.get("/api/v1/users/me").status_code == 200


def _revoke_in_the_database(api: Cluster, token: str) -> None:
    """As another controller sharing the database (or an operator) would."""
    factory = api.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        session.execute(
            text("UPDATE api_tokens SET revoked_at = created_at WHERE token_hash = :h"),
            {"h": auth.token_hash(token)},
        )


def test_a_token_revoked_elsewhere_stops_working_within_the_cache_time(
    world: World, clock: FakeClock, settings: ControllerSettings
) -> None:
    me = "/api/v1/users/me"
    assert world.api.get(me, headers=bearer(world.alice)).status_code == 200
    _revoke_in_the_database(world.api, world.alice)
    clock.advance(settings.credential_cache_s / 2)
    assert world.api.get(me, headers=bearer(world.alice)).status_code == 200  # still cached
    clock.advance(settings.credential_cache_s / 2)
    assert world.api.get(me, headers=bearer(world.alice)).status_code == 401
    assert world.api.get(me, headers=bearer(world.bob)).status_code == 200


def test_a_clock_that_went_back_ends_the_cached_credentials(world: World, clock: FakeClock) -> None:
    me = "/api/v1/users/me"
    clock.advance(60)
    assert world.api.get(me, headers=bearer(world.alice)).status_code == 200
    _revoke_in_the_database(world.api, world.alice)
    clock.advance(-1)
    assert world.api.get(me, headers=bearer(world.alice)).status_code == 401


def test_without_a_cache_time_every_request_asks_the_database(
    settings: ControllerSettings, clock: FakeClock
) -> None:
    app = create_app(
        settings.model_copy(update={"credential_cache_s": 0}), clock=clock, run_background=False
    )
    with Cluster(app) as api:
        api.user_token = api.add_user("root", Role.ADMIN)
        alice = api.add_user("alice")
        assert api.get("/api/v1/users/me", headers=bearer(alice)).status_code == 200
        _revoke_in_the_database(api, alice)
        assert api.get("/api/v1/users/me", headers=bearer(alice)).status_code == 401


def test_the_cache_holds_users_not_token_texts_nor_refusals(world: World) -> None:
    cache = world.api.app.state.credentials  # type: ignore[attr-defined]
    world.api.get("/api/v1/users/me", headers=bearer(world.alice))
    world.api.get("/api/v1/users/me", headers=bearer("rlu_not-a-real-token"))
    world.api.get("/api/v1/jobs", headers=bearer(world.node_token))
    kept = repr(cache._entries)
    assert world.alice not in kept and auth.token_hash(world.alice) in kept
    assert auth.token_hash("rlu_not-a-real-token") not in kept
    assert auth.token_hash(world.node_token) not in kept


def test_each_request_gets_its_own_copy_of_a_cached_user(world: World) -> None:
    cache = world.api.app.state.credentials  # type: ignore[attr-defined]
    now = world.api.app.state.clock()  # type: ignore[attr-defined]
    world.api.get("/api/v1/users/me", headers=bearer(world.alice))
    first, second = cache.user(world.alice, now), cache.user(world.alice, now)
    assert first is not second and first.name == second.name == "alice"
    first.role = Role.ADMIN
    assert cache.user(world.alice, now).role is Role.USER


def test_a_check_that_read_a_token_just_before_its_revoke_does_not_cache_it(
    world: World, monkeypatch: pytest.MonkeyPatch, clock: FakeClock, settings: ControllerSettings
) -> None:
    """A request looks the token up, the token is revoked through this controller, and
    only then does the request store what it found: the revoke still holds at once."""
    state = world.api.app.state  # type: ignore[attr-defined]
    with transaction(state.session_factory) as session:
        token_id = session.scalars(
            select(ApiToken.id).where(ApiToken.token_hash == auth.token_hash(world.alice))
        ).one()
        admin = session.scalars(select(User).where(User.role == Role.ADMIN)).first()
    looked_up = deps.user_from_database
    revoked = []

    def revoked_meanwhile(*args: Any) -> Any:
        found = looked_up(*args)
        if found.name == "alice":
            users.revoke_token(token_id, admin, state.session_factory, state.credentials, clock())
            revoked.append(token_id)
        return found

    clock.advance(settings.credential_cache_s)  # what the fixture cached has ended
    monkeypatch.setattr(deps, "user_from_database", revoked_meanwhile)
    me = "/api/v1/users/me"
    assert world.api.get(me, headers=bearer(world.alice)).status_code == 200  # checked before
    assert revoked == [token_id]
    monkeypatch.setattr(deps, "user_from_database", looked_up)
    assert world.api.get(me, headers=bearer(world.alice)).status_code == 401
