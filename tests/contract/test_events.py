"""Runtime events: one payload model per kind, bounded, and the same JSON on the wire."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from contract.events import (
    ColdStarted,
    EventData,
    EventKind,
    HangDetected,
    LauncherExited,
    RendezvousComplete,
    SnapshotFailed,
    SnapshotSaved,
    SnapshotSkipped,
    TrainingFinished,
    TrainingProgress,
    TrainingStarted,
    WorkerFailed,
    ZygoteChanged,
    parse_event,
    runtime_event,
)
from contract.protocol import AttemptReport

PAYLOADS: list[type[EventData]] = [
    RendezvousComplete,
    WorkerFailed,
    HangDetected,
    LauncherExited,
    TrainingStarted,
    TrainingProgress,
    SnapshotSaved,
    SnapshotFailed,
    SnapshotSkipped,
    TrainingFinished,
    ZygoteChanged,
    ColdStarted,
]
TIME = "2026-11-22T00:00:00Z"


def line(kind: str, **data: Any) -> str:
    return json.dumps({"time": TIME, "kind": kind, "data": data})


def test_every_kind_has_one_payload_model() -> None:
    assert sorted(p.kind for p in PAYLOADS) == sorted(EventKind)


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: p.__name__)
def test_each_payload_travels_as_time_kind_and_data(payload: type[EventData]) -> None:
    event = runtime_event(payload(), datetime(2026, 11, 22, tzinfo=UTC))
    wire = json.loads(event.model_dump_json())
    assert list(wire) == ["time", "kind", "data"]
    assert wire["kind"] == payload.kind.value
    assert wire["time"] == TIME
    back = parse_event(event.model_dump_json())
    assert type(back.data) is payload and back == event


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: p.__name__)
def test_data_may_leave_fields_out_and_add_unknown_ones(payload: type[EventData]) -> None:
    assert parse_event(line(payload.kind.value)).data == payload()
    newer = parse_event(line(payload.kind.value, from_a_newer_node=1)).data
    assert newer == payload() and "from_a_newer_node" not in newer.model_dump()
    assert parse_event(json.dumps({"time": TIME, "kind": payload.kind.value})).data == payload()


def test_an_unknown_kind_or_no_time_is_refused() -> None:
    with pytest.raises(ValidationError):
        parse_event(line("teleported"))
    with pytest.raises(ValidationError):
        parse_event(json.dumps({"kind": "progress", "data": {}}))


@pytest.mark.parametrize(
    ("kind", "field"),
    [
        ("progress", "step"),
        ("progress", "epoch"),
        ("progress", "world_size"),
        ("snapshot", "step"),
        ("started", "resumed_from_step"),
        ("started", "total_steps"),
        ("rendezvous", "group_rank"),
        ("worker_failed", "global_rank"),
        ("hang", "local_rank"),
        ("finished", "step"),
    ],
)
def test_counts_are_32_bit_and_not_negative(kind: str, field: str) -> None:
    assert getattr(parse_event(line(kind, **{field: 2**31 - 1})).data, field) == 2**31 - 1
    for bad in (2**31, -1, "many", 1.5):
        with pytest.raises(ValidationError, match=field):
            parse_event(line(kind, **{field: bad}))


def test_exit_codes_are_signed_32_bit() -> None:
    assert parse_event(line("worker_failed", exitcode=-9)).data == WorkerFailed(exitcode=-9)
    assert parse_event(line("launcher_exit", exitcode=1)).data == LauncherExited(exitcode=1)
    for bad in (2**31, -(2**31) - 1):
        with pytest.raises(ValidationError, match="exitcode"):
            parse_event(line("worker_failed", exitcode=bad))


def test_a_snapshot_over_2_gib_keeps_its_size_up_to_64_bits() -> None:
    assert SnapshotSaved.model_validate({"bytes": 5 * 2**30}).bytes == 5 * 2**30
    assert SnapshotSaved.model_validate({"bytes": 2**63 - 1}).bytes == 2**63 - 1
    for bad in (2**63, -1):
        with pytest.raises(ValidationError, match="bytes"):
            SnapshotSaved.model_validate({"bytes": bad})


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (TrainingProgress, "loss"),
        (TrainingProgress, "samples_per_s"),
        (SnapshotSaved, "seconds"),
        (HangDetected, "idle_s"),
        (HangDetected, "timeout_s"),
        (TrainingFinished, "loss"),
    ],
)
def test_nan_and_infinities_read_as_no_value(payload: type[EventData], field: str) -> None:
    for value in (float("nan"), float("inf"), float("-inf"), "NaN"):
        assert getattr(payload.model_validate({field: value}), field) is None
    text = line(payload.kind.value, **{field: 0.0}).replace("0.0", "NaN")  # NaN: not JSON
    assert getattr(parse_event(text).data, field) is None
    assert getattr(payload.model_validate({field: 0.25}), field) == 0.25
    with pytest.raises(ValidationError, match=field):
        payload.model_validate({field: "fast"})


def test_a_sha256_is_64_hex_digits_or_none() -> None:
    digest = "0123456789abcdef" * 4
    assert SnapshotSaved(sha256=digest).sha256 == digest
    for bad in ("not-a-digest", digest.upper(), digest[:-1], 123, None):
        assert SnapshotSaved.model_validate({"sha256": bad}).sha256 is None


@pytest.mark.parametrize(
    ("payload", "field", "limit"),
    [
        (WorkerFailed, "message", 4096),
        (WorkerFailed, "cause", 64),
        (LauncherExited, "message", 4096),
        (SnapshotSaved, "path", 4096),
        (SnapshotFailed, "error", 4096),
        (SnapshotSkipped, "reason", 4096),
        (TrainingFinished, "output_path", 4096),
    ],
)
def test_text_is_bounded_and_shows_nul(payload: type[EventData], field: str, limit: int) -> None:
    assert getattr(payload.model_validate({field: "x" * limit}), field) == "x" * limit
    with pytest.raises(ValidationError, match=field):
        payload.model_validate({field: "x" * (limit + 1)})
    assert getattr(payload.model_validate({field: "a\x00b"}), field) == "a\ufffdb"


def test_a_launcher_outcome_is_succeeded_or_failed() -> None:
    assert LauncherExited(outcome="failed").outcome == "failed"
    with pytest.raises(ValidationError, match="outcome"):
        LauncherExited.model_validate({"outcome": "exploded"})


def test_a_report_holds_typed_events() -> None:
    body = {
        "attempt_id": 1,
        "events": [
            json.loads(line("progress", step=3, loss=0.5)),
            json.loads(line("snapshot", step=3, bytes=5 * 2**30)),
        ],
    }
    report = AttemptReport.model_validate(body)
    assert [type(e.data) for e in report.events] == [TrainingProgress, SnapshotSaved]
    assert json.loads(report.model_dump_json())["events"][1]["data"]["bytes"] == 5 * 2**30
    body["events"].append(json.loads(line("progress", step=-1)))
    with pytest.raises(ValidationError, match="step"):
        AttemptReport.model_validate(body)


STARTUP = {
    "process_started_at": "2026-11-22T00:00:01Z",
    "imported_at": "2026-11-22T00:00:03Z",
    "process_group_at": "2026-11-22T00:00:04Z",
    "snapshot_loaded_at": None,
    "first_step_at": "2026-11-22T00:00:05Z",
}


@pytest.mark.parametrize("kind", ["started", "progress"])
def test_a_start_without_its_moments_reads_as_before_and_travels_without_them(kind: str) -> None:
    event = parse_event(line(kind, world_size=2))
    assert event.data.startup is None  # type: ignore[union-attr]
    back = parse_event(event.model_dump_json())
    assert back == event
    assert json.loads(event.model_dump_json())["data"]["startup"] is None


@pytest.mark.parametrize("kind", ["started", "progress"])
def test_a_start_with_its_moments_travels_and_comes_back_the_same(kind: str) -> None:
    event = parse_event(line(kind, world_size=2, startup=STARTUP))
    startup = event.data.startup  # type: ignore[union-attr]
    assert startup is not None
    assert startup.process_started_at == datetime(2026, 11, 22, 0, 0, 1, tzinfo=UTC)
    assert startup.snapshot_loaded_at is None
    wire = json.loads(event.model_dump_json())["data"]["startup"]
    assert wire == STARTUP
    assert parse_event(event.model_dump_json()) == event


def test_a_start_moment_that_is_no_time_is_refused() -> None:
    with pytest.raises(ValidationError, match="imported_at"):
        parse_event(line("started", startup={"imported_at": "soon"}))
