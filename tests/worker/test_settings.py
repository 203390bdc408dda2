"""The agent's settings: the enrolment token from a file, and the isolation of jobs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from worker import sandbox
from worker.settings import AgentSettings


def test_the_enrolment_token_is_read_from_a_file_only_its_owner_may_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RELAUNCH_AGENT_ENROLMENT_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("s3cr3t\n")
    token_file.chmod(0o600)
    monkeypatch.setenv("RELAUNCH_AGENT_ENROLMENT_TOKEN_FILE", str(token_file))
    assert AgentSettings().token == "s3cr3t"

    token_file.chmod(0o640)
    with pytest.raises(ValidationError, match=f"open to group or others.*chmod 600 {token_file}"):
        AgentSettings()


def test_without_a_token_the_settings_say_where_to_put_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RELAUNCH_AGENT_ENROLMENT_TOKEN", raising=False)
    monkeypatch.delenv("RELAUNCH_AGENT_ENROLMENT_TOKEN_FILE", raising=False)
    with pytest.raises(ValidationError, match="RELAUNCH_AGENT_ENROLMENT_TOKEN_FILE"):
        AgentSettings()


def test_isolation_defaults_to_a_user_per_job() -> None:
    settings = AgentSettings(enrolment_token="t")
    assert (settings.isolation, settings.job_uid_base) == ("user", 200000)
    user = sandbox.job_user("user", settings.job_uid_base, 42)
    assert user is not None and (user.uid, user.gid) == (200042, 200042)
    assert sandbox.job_user("none", settings.job_uid_base, 42) is None
    with pytest.raises(ValueError, match="beyond"):
        sandbox.job_user("user", 2**31 - 10, 100)


def test_credentials_leave_the_environment_once_read() -> None:
    environ = {"RELAUNCH_AGENT_ENROLMENT_TOKEN": "a", "RELAUNCH_TOKEN": "b", "PATH": "/bin"}
    sandbox.forget_credentials(environ)
    assert environ == {"PATH": "/bin"}


def test_no_isolation_is_allowed_with_one_warning(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    with caplog.at_level(logging.WARNING):
        assert sandbox.start_refusal("none", 200000, tmp_path) is None
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "one trusted tenant" in caplog.records[0].getMessage()


def test_the_jobs_variables_win_over_the_agents_but_never_over_torchs() -> None:
    launcher = {"PATH": "/bin", "RELAUNCH_JOB_ID": "3"}
    worker = {**launcher, "PATH": "/job/bin", "SECRET": "x"}
    overlay = sandbox.job_env_overlay(worker, launcher)
    assert overlay == {"PATH": "/job/bin", "SECRET": "x"}
    torch_env = {**launcher, "RANK": "1", "OMP_NUM_THREADS": "1"}
    launcher_environ = {**launcher, "OMP_NUM_THREADS": "1"}
    job = {**overlay, "RANK": "0", "OMP_NUM_THREADS": "4"}
    merged = sandbox.merge_worker_env(torch_env, job, launcher_environ)
    assert merged["RANK"] == "1"  # torch's, for this worker
    assert merged["OMP_NUM_THREADS"] == "4"  # inherited by torch, so the job's wins
    assert (merged["PATH"], merged["SECRET"]) == ("/job/bin", "x")


def test_the_controller_url_may_list_several_controllers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAUNCH_AGENT_CONTROLLER_URL", "http://a:8080/, https://b:8443")
    assert AgentSettings(enrolment_token="t").controller_url == "http://a:8080,https://b:8443"
    monkeypatch.setenv("RELAUNCH_AGENT_CONTROLLER_URL", "http://a:8080,b:8080")
    with pytest.raises(ValidationError, match="controller_url must be an http"):
        AgentSettings(enrolment_token="t")
