"""Polling is cheap: an answer that did not change comes back as 304 with no body."""

from __future__ import annotations

from tests.service.helpers import Cluster, bearer, submit


def test_an_unchanged_answer_is_304_and_a_changed_one_is_200(api: Cluster) -> None:
    job_id = submit(api, "1")
    first = api.get(f"/api/v1/jobs/{job_id}")
    etag = first.headers["etag"]
    assert first.status_code == 200 and etag.startswith('"')
    assert first.headers["cache-control"] == "private, no-cache"
    assert "Authorization" in first.headers["vary"]

    same = api.get(f"/api/v1/jobs/{job_id}", headers={"if-none-match": etag})
    assert same.status_code == 304 and same.content == b"" and same.headers["etag"] == etag
    weak = api.get(f"/api/v1/jobs/{job_id}", headers={"if-none-match": f'"x", W/{etag}'})
    assert weak.status_code == 304

    api.post(f"/api/v1/jobs/{job_id}/cancel")
    changed = api.get(f"/api/v1/jobs/{job_id}", headers={"if-none-match": etag})
    assert changed.status_code == 200 and changed.json()["state"] == "CANCELLED"
    assert changed.headers["etag"] != etag


def test_lists_and_timelines_are_conditional_too(api: Cluster) -> None:
    job_id = submit(api, "1")
    for path in ("/api/v1/jobs", f"/api/v1/jobs/{job_id}/events", "/api/v1/nodes"):
        etag = api.get(path).headers["etag"]
        assert api.get(path, headers={"if-none-match": etag}).status_code == 304, path
    etag = api.get("/api/v1/jobs").headers["etag"]
    submit(api, "1")
    assert api.get("/api/v1/jobs", headers={"if-none-match": etag}).status_code == 200


def test_a_conditional_request_still_needs_its_credential(api: Cluster) -> None:
    job_id = submit(api, "1")
    etag = api.get(f"/api/v1/jobs/{job_id}").headers["etag"]
    anonymous = {"if-none-match": etag, "authorization": ""}
    assert api.get(f"/api/v1/jobs/{job_id}", headers=anonymous).status_code == 401
    other = {"if-none-match": etag, **bearer(api.add_user("eve"))}
    assert api.get(f"/api/v1/jobs/{job_id}", headers=other).status_code == 404
    # Each caller's answer has its own ETag: eve's list is empty, the admin's is not.
    eve_list = api.get("/api/v1/jobs", headers=other)
    assert eve_list.headers["etag"] != api.get("/api/v1/jobs").headers["etag"]


def test_errors_and_writes_carry_no_etag(api: Cluster) -> None:
    assert "etag" not in api.get("/api/v1/jobs/999").headers
    r = api.post("/api/v1/jobs", json={"name": "j", "task": {"name": "regression"}})
    assert r.status_code == 201 and "etag" not in r.headers
    assert "etag" not in api.get("/healthz").headers
