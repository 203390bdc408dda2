"""The agent forwards the valid lines of an events file and drops the others, once."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from contract.events import TrainingProgress, WorkerFailed, runtime_event
from contract.protocol import (
    AttemptReport,
    NodeRegister,
    NodeRegistered,
    ReportAccepted,
)
from tests.worker.helpers import unstarted_attempt
from worker.agent import Delivery, NodeAgent
from worker.client import ControllerClient
from worker.settings import AgentSettings

TIME = "2026-11-22T00:00:00Z"


class RecordingClient(ControllerClient):
    """Accepts every report, after parsing it as the controller does."""

    def __init__(self) -> None:
        super().__init__("http://unused.invalid", "enrolment-secret")
        self.reports: list[AttemptReport] = []

    def register(self, body: NodeRegister) -> NodeRegistered:
        return NodeRegistered(node_id=7, heartbeat_interval_s=1.0, node_token="rln_seven")

    def report(self, node_id: int, body: AttemptReport) -> ReportAccepted:
        self.reports.append(AttemptReport.model_validate_json(body.model_dump_json()))
        return ReportAccepted(accepted=True)


def _line(kind: str, **data: object) -> str:
    return json.dumps({"time": TIME, "kind": kind, "data": data}) + "\n"


def test_invalid_event_lines_are_dropped_and_the_valid_ones_forwarded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = AgentSettings(
        enrolment_token="t", controller_url="http://c:1", name="n", work_dir=tmp_path
    )
    client = RecordingClient()
    agent = NodeAgent(settings, client, clock=lambda: 100.0)
    attempt = unstarted_attempt(tmp_path, settings)
    failed = runtime_event(WorkerFailed(global_rank=1, exitcode=-9, message="killed"))
    attempt.events_path.write_text(
        _line("progress", step=1, loss=0.5)
        + _line("progress", step=2**31)  # does not fit the controller's 32-bit column
        + _line("snapshot", step=3, bytes=-5)
        + _line("exploded", step=4)  # no such kind
        + "not json\n"
        + failed.model_dump_json()
        + "\n"
        + _line("progress", step=5, loss="NaN")
    )
    with caplog.at_level(logging.WARNING, logger="worker.outbox"):
        assert agent._deliver(attempt, node_id=7) is Delivery.DRAINED
    events = [e for r in client.reports for e in r.events]
    assert [e.data for e in events] == [
        TrainingProgress(step=1, loss=0.5),
        failed.data,
        TrainingProgress(step=5, loss=None),
    ]
    dropped = [r.getMessage() for r in caplog.records if "bad event line" in r.getMessage()]
    assert len(dropped) == 4
    assert "2147483647" in dropped[0] and "bytes" in dropped[1]

    # delivered once: the next pass has nothing to send, the bad lines are not read again
    caplog.clear()
    sent = len(client.reports)
    assert agent._deliver(attempt, node_id=7) is Delivery.DRAINED
    assert len(client.reports) == sent and not caplog.records
