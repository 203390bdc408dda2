"""`relaunch nodes token create|list|revoke` against the real app, and the tokens they make
admitting (or no longer admitting) a node."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from typer.testing import CliRunner, Result

from service import cli
from service.client import RelaunchClient
from service.models import Role
from tests.service.helpers import Cluster, bearer

Invoke = Callable[..., Result]


@pytest.fixture
def invoke(api: Cluster, monkeypatch: pytest.MonkeyPatch) -> Invoke:
    """Run a command against the app as the user whose token is given (the admin's by default)."""
    monkeypatch.setattr(
        cli,
        "RelaunchClient",
        lambda _url, token, **_k: RelaunchClient(token=token, http_client=api),
    )
    monkeypatch.setattr(cli.console, "width", 300)

    def run(*args: str, token: str | None = None) -> Result:
        env = {"RELAUNCH_TOKEN": token or api.user_token}
        return CliRunner().invoke(cli.app, list(args), env=env)

    return run


def _register(api: Cluster, secret: str, name: str) -> int:
    body = {"name": name, "address": "10.0.0.9", "slots": 1, "pid": 1}
    return api.post("/api/v1/nodes/register", json=body, headers=bearer(secret)).status_code


def _secret(result: Result) -> str:
    assert result.exit_code == 0, result.output
    [secret] = [line for line in result.output.splitlines() if line.startswith("rle_")]
    return secret


def test_create_list_and_revoke(api: Cluster, invoke: Invoke) -> None:
    made = invoke("nodes", "token", "create", "--name", "n1", "--expires-in", "1h")
    assert "enrolment token 1 for n1, single-use, expires 2026-01-01T01:00:00" in made.output
    secret = _secret(made)
    assert _register(api, secret, "n2") == 403  # bound to n1
    assert _register(api, secret, "n1") == 200
    assert _register(api, secret, "n1") == 401  # single-use: used
    reusable = _secret(invoke("nodes", "token", "create", "--reusable", "--expires-in", "7d"))
    assert _register(api, reusable, "n3") == _register(api, reusable, "n4") == 200

    listed = invoke("nodes", "token", "list")
    assert listed.exit_code == 0, listed.output
    rows = {line.split()[1]: line for line in listed.output.splitlines() if "│" in line}
    assert "n1" in rows["1"] and "single" in rows["1"] and "2026-01-01T00:00:00" in rows["1"]
    assert "any" in rows["2"] and "reusable" in rows["2"] and "2026-01-08T00:00:00" in rows["2"]
    assert secret not in listed.output and reusable not in listed.output

    revoked = invoke("nodes", "token", "revoke", "2")
    assert revoked.exit_code == 0 and "enrolment token 2 revoked" in revoked.output
    assert _register(api, reusable, "n5") == 401
    missing = invoke("nodes", "token", "revoke", "99")
    assert missing.exit_code == 2 and "enrolment token 99 does not exist" in missing.output


def test_a_single_use_token_that_expires_in_a_day_is_the_default(
    api: Cluster, invoke: Invoke
) -> None:
    made = invoke("nodes", "token", "create")
    assert "for any node name, single-use, expires 2026-01-02T00:00:00" in made.output
    assert _register(api, _secret(made), "anything") == 200


def test_a_bad_duration_and_a_non_admin_are_refused(api: Cluster, invoke: Invoke) -> None:
    bad = invoke("nodes", "token", "create", "--expires-in", "soon")
    assert bad.exit_code == 2 and "'soon' is not a duration like 30m, 1h or 7d" in bad.output
    alice = api.add_user("alice", Role.USER)
    for args in (("create",), ("list",), ("revoke", "1")):
        refused = invoke("nodes", "token", *args, token=alice)
        assert refused.exit_code == 2 and "is not an admin" in refused.output, args
