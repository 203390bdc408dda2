"""Bad and hostile input: oversize bodies, unbounded fields, path tricks, secrets, retries,
and users who would pass their limits."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from contract.paths import UnsafePath, inside, plain_name
from service.db import transaction
from service.schemas import JobCreate
from tests.service.helpers import Cluster, bearer, heartbeat, register

SPEC: dict[str, Any] = {"name": "j", "task": {"name": "regression", "params": {"epochs": 2}}}


def total_jobs(api: Cluster) -> int:
    count: int = api.get("/api/v1/jobs").json()["total"]
    return count


def test_a_body_over_the_limit_is_413_and_writes_nothing(api: Cluster) -> None:
    limit = api.app.state.settings.max_body_bytes  # type: ignore[attr-defined]
    big = {**SPEC, "env": {f"V{i}": "x" * 4000 for i in range(64)}}  # ~256 KB: within
    assert api.post("/api/v1/jobs", json=big).status_code == 201
    huge = {**SPEC, "script": None, "padding": "x" * (limit + 1)}
    r = api.post("/api/v1/jobs", json=huge)
    assert r.status_code == 413 and "larger than" in r.json()["detail"]
    before = total_jobs(api)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b'{"name": "j", "task": {"name": "regression"}, "env": {"A": "'
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536
        yield b'"}}'

    r = api.post("/api/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = api.post("/api/v1/jobs", content=b"{}", headers={"content-length": "nonsense"})
    assert r.status_code in (400, 413)
    assert total_jobs(api) == before


def _unbounded(schema: dict[str, Any], defs: dict[str, Any], where: str) -> list[str]:
    """Every string, array and map in a JSON schema that has no upper bound."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return _unbounded(defs[name], defs, f"{where}->{name}")
    found: list[str] = []
    for key in ("anyOf", "allOf", "oneOf"):
        for i, sub in enumerate(schema.get(key, [])):
            found += _unbounded(sub, defs, f"{where}|{i}")
    kind = schema.get("type")
    if kind == "string" and not {"maxLength", "enum", "const"} & schema.keys():
        found.append(where)
    if kind == "array":
        if "maxItems" not in schema:
            found.append(where)
        found += _unbounded(schema.get("items", {}), defs, f"{where}[]")
    if kind == "object":
        extra = schema.get("additionalProperties", False)
        if extra is not False and "maxProperties" not in schema:
            found.append(where)
        for name, sub in schema.get("properties", {}).items():
            found += _unbounded(sub, defs, f"{where}.{name}")
        if isinstance(schema.get("additionalProperties"), dict):
            found += _unbounded(schema["additionalProperties"], defs, f"{where}{{}}")
    return found


def test_every_string_list_and_map_of_a_spec_has_a_bound() -> None:
    schema = JobCreate.model_json_schema()
    assert _unbounded(schema, schema.get("$defs", {}), "spec") == []


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/jobs/..%2F..%2Fetc%2Fpasswd",
        "/api/v1/jobs/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/api/v1/jobs/..%5c..%5cetc%5cpasswd",
        "/api/v1/jobs/1%00",
        "/api/v1/jobs/-1",
        "/api/v1/jobs/99999999999999999999999",
        "/api/v1/jobs/1/logs?node_id=99999999999999999999999",
        "/api/v1/jobs/1/logs?local_rank=../../etc",
        "/api/v1/jobs//etc/passwd",
        "/api/v1/nodes/..%2Fregister/heartbeat",
        "/api/v1/users/..%2F..%2F/tokens",
    ],
)
def test_path_tricks_are_refused_without_a_500(api: Cluster, path: str) -> None:
    api.post("/api/v1/jobs", json=SPEC)
    for method in ("GET", "POST"):
        r = api.request(method, path, json={})
        assert 400 <= r.status_code < 500, (method, path, r.status_code, r.text)
        assert "root:" not in r.text


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"name": "../../x", "task": {"name": "regression"}}, "name"),
        ({"name": "j", "script": {"path": "/opt/jobs/../../etc/x.py"}}, "'..'"),
        ({"name": "j", "script": {"path": "jobs/train.py"}}, "absolute"),
        ({"name": "j", "script": {"module": "../evil"}}, "module"),
        ({"name": "j", "task": {"name": "../regression"}}, "task"),
    ],
)
def test_names_and_paths_in_a_spec_are_checked(
    api: Cluster, spec: dict[str, Any], fragment: str
) -> None:
    r = api.post("/api/v1/jobs", json=spec)
    assert r.status_code == 422
    assert fragment in r.text


def test_plain_names_stay_under_their_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    assert inside(root, "attempts", "12") == root / "attempts" / "12"
    for bad in ("..", "../x", "/etc/passwd", "%2e%2e", "a%2fb", "a\\b", "", ".", "a\x00"):
        with pytest.raises(UnsafePath):
            plain_name(bad)
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    with pytest.raises(UnsafePath, match="outside"):
        inside(root, "link")


def test_environment_values_are_never_echoed(
    api: Cluster, reconciler: Any, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "hunter2-s3cr3t-value"
    caplog.set_level(logging.DEBUG)
    node = register(api, "a")
    made = api.post("/api/v1/jobs", json={**SPEC, "env": {"WANDB_API_KEY": secret}})
    assert made.status_code == 201
    job_id = made.json()["id"]
    assert made.json()["spec"]["env"] == {"WANDB_API_KEY": "<redacted>"}
    reconciler.run_once()
    [assignment] = heartbeat(api, node)
    assert assignment["env"]["WANDB_API_KEY"] == secret  # the node needs it to run the job
    for path in ("", f"/{job_id}", f"/{job_id}/events", f"/{job_id}/logs"):
        assert secret not in api.get(f"/api/v1/jobs{path}").text, path
    assert secret not in api.get("/api/v1/nodes").text
    assert secret not in caplog.text


def test_the_same_idempotency_key_gives_the_same_job(api: Cluster) -> None:
    key = {"idempotency-key": "submit-7f3a"}
    first = api.post("/api/v1/jobs", json=SPEC, headers=key)
    again = api.post("/api/v1/jobs", json=SPEC, headers=key)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    # The same body spelt differently is the same body.
    respelt = {"task": {"params": {"epochs": 2}, "name": "regression"}, "name": "j", "nnodes": 1}
    assert api.post("/api/v1/jobs", json=respelt, headers=key).json()["id"] == first.json()["id"]
    other = api.post("/api/v1/jobs", json={**SPEC, "name": "k"}, headers=key)
    assert other.status_code == 422 and "different body" in other.json()["detail"][0]["msg"]
    # Keys belong to their user: another user's same key is a new job.
    carol = api.add_user("carol")
    theirs = api.post("/api/v1/jobs", json=SPEC, headers={**key, **bearer(carol)})
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]
    assert api.post("/api/v1/jobs", json=SPEC, headers={"idempotency-key": ""}).status_code == 422


def test_concurrent_submits_with_one_key_make_exactly_one_job(api: Cluster) -> None:
    before = total_jobs(api)
    barrier = threading.Barrier(8)
    answers: list[tuple[int, int]] = []

    def submit() -> None:
        barrier.wait()
        r = api.post("/api/v1/jobs", json=SPEC, headers={"idempotency-key": "race"})
        answers.append((r.status_code, r.json().get("id", -1)))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert total_jobs(api) == before + 1
    assert sorted(code for code, _ in answers) == [200] * 7 + [201], answers
    assert len({job_id for _, job_id in answers}) == 1


def test_a_user_cannot_pass_their_limits(api: Cluster) -> None:
    dan = bearer(api.add_user("dan", max_active_jobs=2, max_nodes=3))
    first = api.post("/api/v1/jobs", json={**SPEC, "nnodes": "1:2"}, headers=dan)
    assert first.status_code == 201
    too_wide = api.post("/api/v1/jobs", json={**SPEC, "nnodes": "2"}, headers=dan)
    assert too_wide.status_code == 409 and "limit is 3" in too_wide.json()["detail"]
    assert api.post("/api/v1/jobs", json=SPEC, headers=dan).status_code == 201
    third = api.post("/api/v1/jobs", json=SPEC, headers=dan)
    assert third.status_code == 409 and "2 unfinished jobs" in third.json()["detail"]
    cancel = api.post(f"/api/v1/jobs/{first.json()['id']}/cancel", headers=dan)
    assert cancel.status_code == 200
    assert api.post("/api/v1/jobs", json=SPEC, headers=dan).status_code == 201


def test_list_endpoints_page(api: Cluster) -> None:
    for name in ("a", "b", "c"):
        register(api, name)
    page = api.get("/api/v1/nodes", params={"limit": 2, "offset": 1}).json()
    assert [n["name"] for n in page["items"]] == ["b", "c"] and page["total"] == 3
    assert api.get("/api/v1/nodes", params={"limit": 0}).status_code == 422
    assert api.get("/api/v1/users", params={"limit": 1}).json()["total"] >= 2


def test_nul_characters_never_reach_the_database(api: Cluster, reconciler: Any) -> None:
    """PostgreSQL text holds no NUL: names with one are refused, printed text keeps it shown."""
    bad = {"name": "n", "address": "10.0.0.1\x00", "slots": 1, "pid": 1}
    assert api.post("/api/v1/nodes/register", json=bad).status_code == 422
    node = register(api, "a")
    assert api.post(f"/api/v1/nodes/{node}/leave", json={"reason": "x\x00"}).status_code == 422
    label = api.post("/api/v1/users/1/tokens", json={"label": "\x00"})
    assert label.status_code == 422
    job_id = api.post("/api/v1/jobs", json=SPEC).json()["id"]
    reconciler.run_once()
    [assignment] = heartbeat(api, node)
    report = {
        "attempt_id": assignment["attempt_id"],
        "logs": [{"time": "2026-11-22T00:00:00Z", "line": "bin\x00ary", "local_rank": 0}],
        "events": [
            {
                "time": "2026-11-22T00:00:00Z",
                "kind": "snapshot",
                "data": {"step": 1, "epoch": 0, "path": "/s/\x00", "bytes": 1},
            }
        ],
    }
    assert api.post(f"/api/v1/nodes/{node}/reports", json=report).status_code == 200
    [line] = api.get(f"/api/v1/jobs/{job_id}/logs").json()["items"]
    assert line["line"] == "bin\ufffdary"
    [snapshot] = api.get(f"/api/v1/jobs/{job_id}/snapshots").json()["items"]
    assert snapshot["path"] == "/s/\ufffd"


def test_a_snapshot_over_2_gib_keeps_its_size(api: Cluster, reconciler: Any) -> None:
    node = register(api, "a")
    job_id = api.post("/api/v1/jobs", json=SPEC).json()["id"]
    reconciler.run_once()
    [assignment] = heartbeat(api, node)
    event = {"step": 1, "epoch": 0, "path": "/s/x", "bytes": 5 * 2**30}
    report = {
        "attempt_id": assignment["attempt_id"],
        "events": [{"time": "2026-11-22T00:00:00Z", "kind": "snapshot", "data": event}],
    }
    assert api.post(f"/api/v1/nodes/{node}/reports", json=report).status_code == 200
    [snapshot] = api.get(f"/api/v1/jobs/{job_id}/snapshots").json()["items"]
    assert snapshot["bytes"] == 5 * 2**30


def test_a_limit_set_in_the_database_holds_while_the_callers_token_is_cached(
    api: Cluster,
) -> None:
    erin = bearer(api.add_user("erin", max_active_jobs=2))
    assert api.get("/api/v1/users/me", headers=erin).json()["max_active_jobs"] == 2  # cached
    with transaction(api.app.state.session_factory) as session:  # type: ignore[attr-defined]
        session.execute(text("UPDATE users SET max_active_jobs = 1 WHERE name = 'erin'"))
    assert api.post("/api/v1/jobs", json=SPEC, headers=erin).status_code == 201
    second = api.post("/api/v1/jobs", json=SPEC, headers=erin)
    assert second.status_code == 409 and "the limit is 1" in second.json()["detail"]
