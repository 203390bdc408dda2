"""What the agent does when the controller refuses it: a refused enrolment token ends the
agent (a real controller and a real agent process), a refused report stops the attempt
and says why: a cancel is not a fence."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest

from contract.events import TrainingProgress, runtime_event
from contract.protocol import (
    AttemptReport,
    NodeRegister,
    NodeRegistered,
    ReportAccepted,
    StopReason,
)
from service.local_cluster import LocalCluster, free_port
from tests.worker.helpers import unstarted_attempt
from worker.agent import NodeAgent
from worker.attempt import Attempt
from worker.client import (
    ControllerClient,
    ControllerError,
    EnrolmentRefusedError,
    FencedError,
)
from worker.settings import AgentSettings


class RefusingClient(ControllerClient):
    """Answers register and report with the errors it is given, in order."""

    def __init__(self, errors: list[Exception]) -> None:
        super().__init__("http://unused.invalid", "enrolment-secret")
        self.errors = errors
        self.registers = 0

    def register(self, body: NodeRegister) -> NodeRegistered:
        self.registers += 1
        if self.errors:
            raise self.errors.pop(0)
        return NodeRegistered(node_id=7, heartbeat_interval_s=1.0, node_token="rln_seven")

    def report(self, node_id: int, body: AttemptReport) -> ReportAccepted:
        if self.errors:
            raise self.errors.pop(0)
        return ReportAccepted(accepted=True)


def _agent(tmp_path: Path, errors: list[Exception]) -> tuple[NodeAgent, RefusingClient]:
    settings = AgentSettings(
        enrolment_token="t", controller_url="http://c:1", name="n", work_dir=tmp_path
    )
    client = RefusingClient(errors)
    return NodeAgent(settings, client, clock=lambda: 100.0), client


def test_a_refused_enrolment_token_ends_the_agent_saying_what_to_check(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent, client = _agent(tmp_path, [EnrolmentRefusedError("the enrolment token is wrong", 401)])
    with caplog.at_level(logging.INFO), pytest.raises(EnrolmentRefusedError):
        agent.step()
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.levelno == logging.ERROR
    text = record.getMessage()
    assert "refused the enrolment token" in text and "the enrolment token is wrong" in text
    assert "RELAUNCH_AGENT_ENROLMENT_TOKEN" in text and "retry in" not in text
    assert client.registers == 1


def test_a_server_error_on_registration_is_retried(tmp_path: Path) -> None:
    agent, client = _agent(tmp_path, [ControllerError("POST /nodes/register: 500 boom", 500)])
    agent.step()  # logged and retried later, not raised
    assert agent.node_id is None and client.registers == 1


def _attempt_with_output(tmp_path: Path, settings: AgentSettings) -> Attempt:
    attempt = unstarted_attempt(tmp_path, settings)
    event = runtime_event(TrainingProgress(step=1), datetime.now(UTC))
    attempt.events_path.write_text(event.model_dump_json() + "\n")
    return attempt


@pytest.mark.parametrize(
    ("reason", "level", "said", "stop_message"),
    [
        (StopReason.CANCELLED, logging.INFO, "cancelled by its owner", "its job was cancelled"),
        (StopReason.FENCED, logging.WARNING, "fenced by the controller", "fenced"),
    ],
)
def test_a_refused_report_stops_the_attempt_and_says_why(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    reason: StopReason,
    level: int,
    said: str,
    stop_message: str,
) -> None:
    agent, _ = _agent(tmp_path, [FencedError("POST /nodes/7/reports: 409", reason)])
    attempt = _attempt_with_output(tmp_path, agent._settings)
    with caplog.at_level(logging.INFO, logger="worker.agent"):
        agent._deliver(attempt, node_id=7)
    [record] = [r for r in caplog.records if r.name == "worker.agent"]
    assert record.levelno == level and said in record.getMessage()
    assert "fenced" not in record.getMessage() or reason is StopReason.FENCED
    assert attempt.exit is not None and attempt.exit.outcome == "stopped"
    assert stop_message in attempt.exit.message


def test_an_agent_with_a_wrong_enrolment_token_exits_non_zero_and_says_why(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(data_dir=tmp_path, port=free_port())
    try:
        cluster.start_controller()
        work = cluster.agent_dir("wrong")
        args = ["agent", "--controller", cluster.url, "--name", "wrong", "--work-dir", str(work)]
        cluster.spawn("wrong", args, {"RELAUNCH_AGENT_ENROLMENT_TOKEN": "not-the-controllers"})
        # A bound on liveness: the agent must end, not retry for ever.
        code = cluster.procs["wrong"].wait(timeout=60)
    finally:
        cluster.stop_all()
    log = (tmp_path / "wrong.log").read_text()
    assert code == 1, log
    assert "refused the enrolment token" in log and "the enrolment token is wrong" in log
    assert "RELAUNCH_AGENT_ENROLMENT_TOKEN" in log
    assert "register failed" not in log and "Traceback" not in log


def test_waiting_for_nodes_ends_with_what_an_agent_that_exited_said(tmp_path: Path) -> None:
    # The demo and the benches wait for their agents: one that gave up must end the wait at
    # once with its reason, not after the wait's whole timeout with a count.
    cluster = LocalCluster(data_dir=tmp_path, port=free_port())
    try:
        cluster.start_controller()
        cluster.start_agent(
            "wrong", extra_env={"RELAUNCH_AGENT_ENROLMENT_TOKEN": "not-the-controllers"}
        )
        with pytest.raises(RuntimeError) as raised:
            cluster.wait_nodes(1, timeout_s=600)
    finally:
        cluster.stop_all()
    said = str(raised.value)
    assert "fewer than 1 node agents are running: wrong (exit status 1)" in said
    assert "refused the enrolment token" in said
