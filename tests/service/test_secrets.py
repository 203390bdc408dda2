"""Jobs' env values at rest: encrypted in the database, in the clear only for the job's
nodes; the keys, their rotation, a wrong key at start; and who may read the files."""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.fernet import Fernet, InvalidToken
from pydantic import SecretStr
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from service.api.app import create_app
from service.cli import app as cli
from service.db import make_sqlite_parent, transaction
from service.models import Job, Role
from service.reconciler import Reconciler
from service.schemas import REDACTED
from service.secrets import (
    Keyring,
    SecretsKeyError,
    load_keyring,
    open_env,
    public_spec,
    resealed,
    seal_spec,
)
from service.settings import ControllerSettings
from service.spec import JobSpec
from service.states import JobState
from tests.helpers import FakeClock
from tests.service.helpers import Cluster, heartbeat, job, register, submit

SPEC: dict[str, Any] = {
    "name": "j",
    "task": {"name": "regression", "params": {"epochs": 2}},
    "nnodes": "1",
}


def _secret() -> str:
    return f"hunter2-{uuid.uuid4().hex}"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _sqlite_path(db_url: str) -> Path | None:
    url = make_url(db_url)
    return Path(url.database) if url.get_backend_name() == "sqlite" and url.database else None


def _database_text(db_url: str) -> str:
    """Every row of every table, as plain SQL reads it (no relaunch code)."""
    path = _sqlite_path(db_url)
    if path is not None:
        with sqlite3.connect(path) as conn:
            tables = [
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
            ]
            return "\n".join(repr(conn.execute(f'SELECT * FROM "{t}"').fetchall()) for t in tables)
    with psycopg.connect(db_url) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
            )
        ]
        return "\n".join(
            str(conn.execute(f'SELECT row_to_json(t)::text FROM "{t}" t').fetchall())
            for t in tables
        )


def _stored_specs(db_url: str) -> dict[int, dict[str, Any]]:
    """``jobs.spec`` of every job, read with plain SQL."""
    path = _sqlite_path(db_url)
    if path is not None:
        with sqlite3.connect(path) as conn:
            rows = conn.execute("SELECT id, spec FROM jobs").fetchall()
    else:
        with psycopg.connect(db_url) as conn:
            rows = conn.execute("SELECT id, spec::text FROM jobs").fetchall()
    return {job_id: json.loads(spec) for job_id, spec in rows}


def _key_text(settings: ControllerSettings) -> str:
    if settings.secrets_keys is not None:
        return settings.secrets_keys.get_secret_value()
    return (settings.data_dir / "secrets.key").read_text().strip()


@contextmanager
def _controller(settings: ControllerSettings, clock: FakeClock) -> Iterator[Cluster]:
    with Cluster(create_app(settings, clock=clock, run_background=False)) as api:
        api.node_tokens = {}
        api.user_token = api.add_user(f"u{uuid.uuid4().hex[:8]}", Role.ADMIN)
        yield api


def _refused(settings: ControllerSettings, clock: FakeClock) -> SecretsKeyError:
    """The error a controller with ``settings`` refuses to start with."""
    try:
        with _controller(settings, clock):
            pass
    except SecretsKeyError as exc:
        return exc
    raise AssertionError("the controller started")


def _with_keys(settings: ControllerSettings, *keys: str) -> ControllerSettings:
    return settings.model_copy(update={"secrets_keys": SecretStr(",".join(keys))})


def _new_key() -> str:
    return Fernet.generate_key().decode()


# ---- the stored form, alone -------------------------------------------------------------


def test_a_sealed_spec_keeps_names_and_opens_only_with_its_keys() -> None:
    old, new = Fernet.generate_key(), Fernet.generate_key()
    # Values with a space, which no Fernet token (URL-safe base64) holds: a word alone can
    # turn up in a token by chance, as "one" once did.
    spec = {**SPEC, "env": {"A": "value one", "B": "value two"}}
    stored = seal_spec(Keyring((old,), "old"), spec)
    assert set(stored["env"]) == {"A", "B"} and "value one" not in json.dumps(stored)
    assert public_spec(stored) == {**SPEC, "env": {"A": "", "B": ""}}
    assert open_env(Keyring((old,), "old"), stored) == {"A": "value one", "B": "value two"}
    with pytest.raises(SecretsKeyError, match="RELAUNCH_SECRETS_KEYS"):
        open_env(Keyring((new,), "new"), stored)

    rotated = resealed(Keyring((new, old), "both"), stored)
    assert open_env(Keyring((new,), "new"), rotated) == {"A": "value one", "B": "value two"}
    # A row stored before values were encrypted reads as plaintext, and rotates to sealed.
    legacy = {**SPEC, "env": {"A": "value one"}}
    assert open_env(Keyring((new,), "new"), legacy) == {"A": "value one"}
    assert open_env(Keyring((new,), "new"), resealed(Keyring((new,), "new"), legacy)) == {
        "A": "value one"
    }


# ---- through the API, on SQLite and PostgreSQL -------------------------------------------


def test_an_env_secret_is_stored_encrypted_and_reaches_its_node_in_the_clear(
    api: Cluster,
    reconciler: Reconciler,
    settings: ControllerSettings,
    db_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = _secret()
    node = register(api, "a")
    job_id = submit(api, "1", env={"HF_TOKEN": secret, "PLAIN": "1"})
    reconciler.run_once()

    [assignment] = heartbeat(api, node)
    assert assignment["env"] == {"HF_TOKEN": secret, "PLAIN": "1"}
    # The owner sees what the API always showed: the names, each value redacted.
    assert job(api, job_id)["spec"]["env"] == {"HF_TOKEN": REDACTED, "PLAIN": REDACTED}

    raw = _database_text(db_url)
    assert "HF_TOKEN" in raw and secret not in raw
    stored = _stored_specs(db_url)[job_id]
    assert stored["env_format"] == "fernet"
    assert Fernet(_key_text(settings).split(",")[0]).decrypt(stored["env"]["HF_TOKEN"]) == (
        secret.encode()
    )
    path = _sqlite_path(db_url)
    if path is not None:  # nor in the file's bytes, its write-ahead log included
        for each in (path, path.with_name(path.name + "-wal")):
            if each.exists():
                assert secret.encode() not in each.read_bytes()
    for text in (secret, _key_text(settings), stored["env"]["HF_TOKEN"]):
        assert text not in caplog.text


def test_rotation_re_encrypts_every_row_for_the_new_key_alone(
    settings: ControllerSettings, db_url: str, clock: FakeClock, tmp_path: Path
) -> None:
    old, new = _new_key(), _new_key()
    secret, legacy_secret = _secret(), _secret()
    with _controller(_with_keys(settings, old), clock) as api:
        job_id = submit(api, "1", env={"TOKEN": secret})
        with transaction(api.app.state.session_factory) as session:  # type: ignore[attr-defined]
            legacy = Job(  # as stored before values were encrypted
                name="old",
                spec={**SPEC, "env": {"TOKEN": legacy_secret}},
                state=JobState.SUCCEEDED,
                created_at=clock(),
                updated_at=clock(),
                attempt_count=0,
                restart_count=0,
                membership_changes=0,
                message="",
            )
            session.add(legacy)
            session.flush()
            legacy_id = legacy.id
    assert _stored_specs(db_url)[legacy_id]["env"] == {"TOKEN": legacy_secret}

    env = {
        "DATABASE_URL": db_url,
        "RELAUNCH_DATA_DIR": str(tmp_path / "elsewhere"),
        "RELAUNCH_SECRETS_KEYS": f"{new},{old}",
    }
    result = CliRunner().invoke(cli, ["admin", "rotate-secrets"], env=env)
    assert result.exit_code == 0, result.output
    assert "re-encrypted the env of 2 jobs" in result.output
    assert new not in result.output and old not in result.output

    specs = _stored_specs(db_url)
    assert secret not in _database_text(db_url) and legacy_secret not in _database_text(db_url)
    for job_id_, plain in ((job_id, secret), (legacy_id, legacy_secret)):
        token = specs[job_id_]["env"]["TOKEN"]
        assert specs[job_id_]["env_format"] == "fernet"
        assert Fernet(new).decrypt(token) == plain.encode()
        with pytest.raises(InvalidToken):
            Fernet(old).decrypt(token)

    # The new key alone starts a controller and opens every row; the old one alone no more.
    with _controller(_with_keys(settings, new), clock) as api:
        assert job(api, job_id)["spec"]["env"] == {"TOKEN": REDACTED}
    assert "cannot be decrypted" in str(_refused(_with_keys(settings, old), clock))


def test_an_idempotency_key_keeps_no_guessable_digest_of_the_env_and_survives_rotation(
    settings: ControllerSettings, db_url: str, clock: FakeClock
) -> None:
    old, new = _new_key(), _new_key()
    body = {**SPEC, "env": {"PASSWORD": "letmein"}}
    key = {"idempotency-key": "k-1"}
    with _controller(_with_keys(settings, old), clock) as api:
        first = api.post("/api/v1/jobs", json=body, headers=key)
        assert first.status_code == 201, first.text
        owner = api.user_token
    canonical = json.dumps(
        JobSpec.model_validate(body).model_dump(mode="json"), sort_keys=True, separators=(",", ":")
    )
    # Plain sha256 of the body would let a reader of the database try passwords against it.
    assert hashlib.sha256(canonical.encode()).hexdigest() not in _database_text(db_url)
    with _controller(_with_keys(settings, new, old), clock) as api:  # rotating
        api.user_token = owner
        again = api.post("/api/v1/jobs", json=body, headers=key)
        assert (again.status_code, again.json()["id"]) == (200, first.json()["id"])
        other = api.post("/api/v1/jobs", json={**body, "env": {"PASSWORD": "guess"}}, headers=key)
        assert other.status_code == 422


def test_rotation_never_makes_a_key(tmp_path: Path) -> None:
    env = {"RELAUNCH_DATA_DIR": str(tmp_path / "data")}
    result = CliRunner().invoke(cli, ["admin", "rotate-secrets"], env=env)
    assert result.exit_code == 2, result.output
    assert "RELAUNCH_SECRETS_KEY_FILE" in " ".join(result.output.split())
    assert not (tmp_path / "data" / "secrets.key").exists()


def test_a_controller_with_the_wrong_key_refuses_to_start(
    settings: ControllerSettings, clock: FakeClock
) -> None:
    with _controller(settings, clock) as api:
        job_id = submit(api, "1", env={"TOKEN": _secret()})
        assert api.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 200
        submit(api, "1")  # newer, unfinished, and without env: it proves nothing of the key
    wrong = _new_key()
    refused = str(_refused(_with_keys(settings, wrong), clock))
    assert "cannot be decrypted" in refused and "RELAUNCH_SECRETS_KEYS" in refused
    assert wrong not in refused


def test_a_lost_key_file_is_not_silently_replaced_by_a_new_key(
    tmp_path: Path, clock: FakeClock
) -> None:
    settings = ControllerSettings(data_dir=tmp_path / "data")
    with _controller(settings, clock) as api:
        submit(api, "1", env={"TOKEN": _secret()})
    key_file = settings.data_dir / "secrets.key"
    assert _mode(key_file) == 0o600
    key_file.unlink()
    refused = str(_refused(settings, clock))
    assert "made one" in refused and "RELAUNCH_SECRETS_KEY_FILE" in refused
    assert not key_file.exists()  # the wrong new key is not left in the way


@pytest.mark.postgres
def test_a_controller_on_postgresql_must_be_given_its_key(
    pg_database: str, tmp_path: Path, clock: FakeClock
) -> None:
    settings = ControllerSettings(data_dir=tmp_path / "data", database_url=pg_database)
    assert "RELAUNCH_SECRETS_KEY_FILE" in str(_refused(settings, clock))
    assert not (tmp_path / "data" / "secrets.key").exists()


def test_a_key_file_names_its_keys_first_to_last(tmp_path: Path) -> None:
    old, new = _new_key(), _new_key()
    key_file = tmp_path / "keys"
    key_file.write_text(f"# rotated\n{new}\n{old}\n")
    key_file.chmod(0o644)
    settings = ControllerSettings(data_dir=tmp_path, secrets_key_file=key_file)
    keyring = load_keyring(settings)
    stored = {"env": {"A": Fernet(old).encrypt(b"x").decode()}, "env_format": "fernet"}
    assert open_env(keyring, stored) == {"A": "x"}
    assert Fernet(new).decrypt(keyring.seal("y")) == b"y"
    assert _mode(key_file) == 0o600  # tightened


@pytest.mark.parametrize(
    ("write", "expected"),
    [
        (None, "cannot read the key file"),
        ("not a key\n", "key 1 of RELAUNCH_SECRETS_KEY_FILE"),
        ("\n", "holds no key"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_setting(
    tmp_path: Path, write: str | None, expected: str
) -> None:
    key_file = tmp_path / "keys"
    if write is not None:
        key_file.write_text(write)
    settings = ControllerSettings(data_dir=tmp_path, secrets_key_file=key_file)
    with pytest.raises(SecretsKeyError, match=expected) as refused:
        load_keyring(settings)
    assert "not a key" not in str(refused.value)


def test_a_bad_key_setting_is_refused_at_start_without_echoing_it(tmp_path: Path) -> None:
    env = {"RELAUNCH_DATA_DIR": str(tmp_path), "RELAUNCH_SECRETS_KEYS": "sekrit-not-a-key"}
    result = CliRunner().invoke(cli, ["server"], env=env)
    assert result.exit_code == 2, result.output
    assert "RELAUNCH_SECRETS_KEYS=<hidden>: key 1 is not a Fernet key" in " ".join(
        result.output.split()
    )
    assert "sekrit" not in result.output


# ---- who may read the files ---------------------------------------------------------------


def test_the_data_dir_database_and_key_are_the_owners_only(
    tmp_path: Path, clock: FakeClock
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    db = data / "relaunch.db"
    db.touch(mode=0o644)
    db.chmod(0o644)  # made wider before this version
    settings = ControllerSettings(data_dir=data)
    with _controller(settings, clock) as api:
        submit(api, "1", env={"TOKEN": _secret()})
    assert _mode(data) == 0o711
    assert _mode(db) == 0o600
    assert _mode(data / "secrets.key") == 0o600
    for name in ("relaunch.db-wal", "relaunch.db-shm"):
        if (data / name).exists():
            assert _mode(data / name) & 0o077 == 0, name


def test_a_new_sqlite_file_is_made_private_in_a_private_dir(tmp_path: Path) -> None:
    db = tmp_path / "new" / "dir" / "relaunch.db"
    make_sqlite_parent(f"sqlite:///{db}")
    assert _mode(db.parent) == 0o711
    assert _mode(db) == 0o600
    # A directory that is already there is the operator's: its mode is left as it is.
    tmp_path.chmod(0o755)
    make_sqlite_parent(f"sqlite:///{tmp_path / 'other.db'}")
    assert _mode(tmp_path) == 0o755
    assert _mode(tmp_path / "other.db") == 0o600
