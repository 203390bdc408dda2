"""Tenant isolation: a second user's job attacks the first user's job from inside its worker.

Alice trains a two-node job with a secret in its ``env``. While she trains, Bob, an
ordinary user of the same controller, runs ``attacks/bob.py`` as a one-node script job
on the same host. It tries to read and write Alice's rendezvous state, bump her
snapshot fence, read other processes' environments, her snapshot directory and the
controller's database, and register nodes with a leaked or revoked enrolment token.
Each test below asserts that one attack failed, and that Alice's job never noticed.

The scenario runs once per module (about a minute): a real controller, three
real agents (two for Alice, one for Bob) with the isolation the cluster gives by
default, two users made by the admin as the README's "Using it" does.
"""

from __future__ import annotations

import json
import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.client import RelaunchClient, WaitTimeout
from service.local_cluster import LocalCluster
from tests.e2e.helpers import all_logs, dump_job, regression, running_cluster, wait_world_size

pytestmark = pytest.mark.e2e

BOB = Path(__file__).resolve().parent / "attacks" / "bob.py"
ATTACKS = (
    "rendezvous_keys",
    "rendezvous_pickle",
    "proc_environ",
    "snapshot_read",
    "database_read",
    "fence_bump",
    "revoked_token",
    "register_alive",
)
REFUSED = (401, 403)  # what a refusal answers; a route not there answers 404
ALICE_TRAINS_S = 240  # an upper bound, not an expectation: about 45 s
BOB_ATTACKS_S = 150  # likewise: about 30 s


@dataclass(frozen=True)
class Scenario:
    """What came of Bob's attacks on Alice's job."""

    alice: dict[str, Any]  # her job, as it ended
    alice_timeline: list[str]  # her job's events: what disturbed it, if anything
    alice_running_when_bob_ended: str  # her job's state then
    bob: dict[str, Any]  # his job, as it ended
    bob_output: list[str]  # every log line of his job
    results: dict[str, dict[str, Any]]  # attack name -> its JSON line
    secret: str  # the value in Alice's env
    marker: Path  # the file the pickled rendezvous state writes where it is loaded
    revoked_kind: str  # "per-node", or "shared" where the controller has no other kind


def revoked_enrolment_token(cluster: LocalCluster) -> tuple[str, str]:
    """An enrolment token an admin made, that admitted a node, and that the admin then
    revoked; and its kind.

    A controller without per-node enrolment tokens (``POST /api/v1/enrolment-tokens``
    answers 404) has only its shared token, which no admin can revoke: that one stands
    in, so the test shows that what an admin would want revoked still admits a node.
    """
    headers = {"authorization": f"Bearer {cluster.admin_token}"}
    with httpx.Client(base_url=f"{cluster.url}/api/v1", headers=headers, timeout=10) as api:
        # Neither single-use nor short-lived: only its revocation can keep a node out.
        made = api.post("/enrolment-tokens", json={"expires_in_s": 3600, "single_use": False})
        if made.status_code == 404:
            return cluster.enrolment_token, "shared"
        made.raise_for_status()
        created = made.json()
        token = created["secret"]
        # It works before it is revoked: a node registers with it and leaves at once,
        # so that nothing is ever placed on that node.
        node = {"name": "enrolled-then-revoked", "address": "127.0.0.1", "slots": 1, "pid": 1}
        registered = api.post(
            "/nodes/register", json=node, headers={"authorization": f"Bearer {token}"}
        )
        registered.raise_for_status()
        reply = registered.json()
        api.post(
            f"/nodes/{reply['node_id']}/leave",
            json={"reason": "only here to show the token worked"},
            headers={"authorization": f"Bearer {reply['node_token']}"},
        ).raise_for_status()
        api.post(f"/enrolment-tokens/{created['token']['id']}/revoke").raise_for_status()
    return token, "per-node"


def bob_spec(cluster: LocalCluster, victim: dict[str, Any], token: str, marker: Path) -> dict:
    """Bob's job: his attack program, told what an attacker can know about Alice's job."""
    [attempt] = victim["attempts"]
    args = {
        "--controller": cluster.url,
        "--victim-job": str(victim["id"]),
        "--victim-node": attempt["members"][0]["node_name"],
        "--snapshot-root": str(cluster.snapshot_dir(victim["id"]).parent),
        "--data-dir": str(cluster.data_dir),
        "--enrolment-token": cluster.enrolment_token,
        "--revoked-token": token,
        "--marker": str(marker),
    }
    # Where the controller runs a c10d store, a port scan finds it.
    store_port = getattr(cluster, "store_port", None)
    if store_port is not None:
        args["--store-endpoint"] = f"{cluster.host}:{store_port}"
    return {
        "name": "bob",
        # "--flag=value": a token may begin with "-", which argparse would take for a flag.
        "script": {"path": str(BOB), "args": [f"{flag}={value}" for flag, value in args.items()]},
        "nnodes": "1:1",
        "max_restarts": 0,
    }


def ended(client: RelaunchClient, job_id: int, timeout_s: float) -> dict[str, Any]:
    """The job once it ended; cancelled, and as it was then, if it had not by
    ``timeout_s``."""
    try:
        return client.wait(job_id, timeout_s=timeout_s, poll_s=0.3)
    except WaitTimeout as exc:
        dump_job(client, job_id)
        client.cancel(job_id)
        return exc.job


def attack_results(lines: list[str]) -> dict[str, dict[str, Any]]:
    """Bob's ``ATTACK {...}`` lines, by attack name."""
    results = {}
    for line in lines:
        _, mark, payload = line.partition("ATTACK ")
        if mark:
            result = json.loads(payload)
            results[result["attack"]] = result
    return results


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    secret = secrets.token_urlsafe(24)
    # Straight in /tmp, which every OS user may write: a payload run by any user shows.
    marker = Path(tempfile.gettempdir()) / f"relaunch-pickle-marker-{secrets.token_hex(8)}"
    data = tmp_path_factory.mktemp("isolation")
    try:
        with (
            running_cluster(data, ("node-a", "node-b", "node-c")) as cluster,
            cluster.client() as admin,
        ):
            users = {name: admin.create_user(name)["token"]["secret"] for name in ("alice", "bob")}
            revoked, revoked_kind = revoked_enrolment_token(cluster)
            with (
                RelaunchClient(cluster.url, users["alice"]) as alice,
                RelaunchClient(cluster.url, users["bob"]) as bob,
            ):
                alice_id = alice.submit(
                    regression(
                        "alice",
                        "2:2",
                        # About 45 s: past the end of Bob's job (about 25 s from its
                        # submission) with time to spare, which the test asserts.
                        params={"epochs": 11, "step_delay": 0.25},
                        snapshot={"every_steps": 10},
                        env={"ALICE_SECRET": secret, "OMP_NUM_THREADS": "1"},
                    )
                )["id"]
                wait_world_size(alice, alice_id, 2)
                bob_id = bob.submit(bob_spec(cluster, alice.job(alice_id), revoked, marker))["id"]
                bob_job = ended(bob, bob_id, BOB_ATTACKS_S)
                alice_then = alice.job(alice_id)["state"]
                alice_job = ended(alice, alice_id, ALICE_TRAINS_S)
                timeline = [f"{e['kind']}: {e['message']}" for e in alice.events(alice_id)]
                output = [entry["line"] for entry in all_logs(bob, bob_id)]
        yield Scenario(
            alice=alice_job,
            alice_timeline=timeline,
            alice_running_when_bob_ended=alice_then,
            bob=bob_job,
            bob_output=output,
            results=attack_results(output),
            secret=secret,
            marker=marker,
            revoked_kind=revoked_kind,
        )
    finally:
        marker.unlink(missing_ok=True)


def failed(scenario: Scenario, attack: str) -> dict[str, Any]:
    """Bob's report of ``attack``, which must say it did not succeed."""
    result = scenario.results.get(attack)
    assert result is not None, f"Bob reported nothing for {attack}: {scenario.bob_output[-20:]}"
    assert result["succeeded"] is False, f"{attack} succeeded: {result['detail']}"
    return result


def http_answers(scenario: Scenario, attack: str, *requests: str) -> dict[str, list[int]]:
    """What the controller answered ``attack``'s ``requests`` (``METHOD /path`` below
    ``/api/v1``, ``{rdzv}`` for the rendezvous id of Alice's attempt and ``{job}`` for
    her job's id), one status per credential Bob showed; which must include his own
    worker token, so that a refusal is not only that of a request with no credential."""
    detail = json.loads(failed(scenario, attack)["detail"])
    assert "Bob's worker token" in detail["credentials"], detail
    [attempt] = scenario.alice["attempts"]
    names = {"rdzv": attempt["rdzv_id"], "job": scenario.alice["id"]}
    answers = {r: detail["http"]["answers"].get(r.format(**names)) for r in requests}
    assert all(answers.values()), detail  # each request was made, and its route is there
    return answers


def test_bob_ran_every_attack_while_alice_trained(scenario: Scenario) -> None:
    """Each attack ran to its end against a running job: one that raised or ran out of
    time proves nothing."""
    assert scenario.bob["state"] == "SUCCEEDED", scenario.bob_output[-20:]
    assert sorted(scenario.results) == sorted(ATTACKS), scenario.bob_output[-20:]
    broken = [r for r in scenario.results.values() if r["detail"].startswith(("raised", "timed"))]
    assert not broken, broken
    assert scenario.alice_running_when_bob_ended == "RUNNING"


def test_alice_trains_undisturbed(scenario: Scenario) -> None:
    alice, timeline = scenario.alice, "\n".join(scenario.alice_timeline)
    assert alice["state"] == "SUCCEEDED", timeline
    assert alice["restart_count"] == 0, timeline
    assert alice["membership_changes"] == 0, timeline
    assert len(alice["attempts"]) == 1, timeline


def test_alice_secret_reaches_none_of_bob_output(scenario: Scenario) -> None:
    leaked = [line for line in scenario.bob_output if scenario.secret in line]
    assert not leaked, leaked


def test_bob_reads_no_rendezvous_state_of_alice(scenario: Scenario) -> None:
    answers = http_answers(
        scenario,
        "rendezvous_keys",
        "GET /rendezvous/{rdzv}/state",
        "GET /rendezvous/{rdzv}/store/num_keys",
        "POST /rendezvous/{rdzv}/store/get",
    )
    assert all(s in REFUSED for statuses in answers.values() for s in statuses), answers


def test_bob_writes_no_rendezvous_state_of_alice(scenario: Scenario) -> None:
    """A pickle in the rendezvous state runs code in whoever loads it."""
    answers = http_answers(
        scenario,
        "rendezvous_pickle",
        "GET /rendezvous/{rdzv}/state",
        "POST /rendezvous/{rdzv}/state",
    )
    assert all(s in REFUSED for statuses in answers.values() for s in statuses), answers


def test_no_code_of_bob_runs_in_alice_processes(scenario: Scenario) -> None:
    """Bob's pickled rendezvous state writes the marker wherever it is unpickled."""
    assert not scenario.marker.exists(), scenario.marker.read_text()


def test_bob_cannot_bump_alice_snapshot_fence(scenario: Scenario) -> None:
    """A bumped fence makes Alice's rank 0 refuse its own snapshots and stop. Bob's
    worker token is a real one, of his own job: refused for hers (403); none is 401."""
    answers = http_answers(scenario, "fence_bump", "POST /workers/jobs/{job}/snapshot-writer")
    assert list(answers.values()) == [[403, 401]], answers


def test_bob_reads_no_other_process_environment(scenario: Scenario) -> None:
    """Refused (EACCES), Alice's launchers among them: not merely none in sight."""
    detail = json.loads(failed(scenario, "proc_environ")["detail"])
    assert detail["refused_of_victim"], detail


def test_bob_reads_nothing_of_alice_snapshots(scenario: Scenario) -> None:
    """Refused (EACCES) both ways: not a directory that is not there."""
    detail = json.loads(failed(scenario, "snapshot_read")["detail"])
    assert "[Errno 13]" in detail["read_error"], detail
    assert "[Errno 13]" in detail["write_error"], detail


def test_bob_cannot_open_the_controller_database(scenario: Scenario) -> None:
    """Refused (EACCES): not a file that is not there."""
    detail = json.loads(failed(scenario, "database_read")["detail"])
    assert "[Errno 13]" in detail["raw_error"], detail
    assert "sqlite_error" in detail, detail


def test_a_leaked_enrolment_token_takes_over_no_alive_node(scenario: Scenario) -> None:
    """Registering under an ALIVE node's name needs that node's own token (409: the
    leaked enrolment token itself is good), and Bob finds none: the node-token files
    her launchers' command lines name are gone or closed to him."""
    detail = json.loads(failed(scenario, "register_alive")["detail"])
    assert [a["status"] for a in detail["answers"]] == [409], detail
    assert detail["token_files"], detail
    assert "read" not in detail["token_files"].values(), detail


def test_a_revoked_enrolment_token_registers_no_node(scenario: Scenario) -> None:
    """The token admitted a node before the admin revoked it; now it admits none."""
    result = failed(scenario, "revoked_token")
    assert scenario.revoked_kind == "per-node", (
        "this controller has no per-node enrolment tokens (POST /api/v1/enrolment-tokens "
        "answers 404), so an admin cannot revoke the token a node registers with"
    )
    assert json.loads(result["detail"])["status"] in (401, 403), result
