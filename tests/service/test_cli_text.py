"""What the CLI prints from the controller is printed as text, never read as markup."""

from __future__ import annotations

import pytest

import contract.cli
from service import cli
from service.timeline import print_timeline

GLOO_ERROR = (
    "worker rank 1 failed: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:553] Connection closed by peer [bold]"
)


def test_a_timeline_message_with_brackets_prints_as_it_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cli.console.width = 400
    print_timeline(
        cli.console,
        [{"time": "2026-11-22T18:00:00.000000", "kind": "worker_failed", "message": GLOO_ERROR}],
    )
    assert "pair.cc:553] Connection closed by peer [bold]" in capsys.readouterr().out


def test_an_error_with_brackets_prints_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    contract.cli.err_console.width = 400
    contract.cli.fail(GLOO_ERROR)
    assert "[/__w/pytorch" in capsys.readouterr().err


def test_log_lines_use_the_labels_of_relaunch_status() -> None:
    line = {"node_id": 7, "node_name": "node-a", "attempt_number": 2, "local_rank": 0}
    assert cli.log_line_label({**line, "global_rank": 3}) == "attempt 2 node node-a rank 3"
    assert cli.log_line_label({**line, "global_rank": None}) == "attempt 2 node node-a local rank 0"
    launcher = {**line, "local_rank": None, "global_rank": None}
    assert cli.log_line_label(launcher) == "attempt 2 node node-a launcher"


def test_status_names_the_device_and_each_members_gpus() -> None:
    job = {
        "id": 3,
        "name": "j",
        "state": "RUNNING",
        "last_step": 0,
        "total_steps": None,
        "world_size": 6,
        "restart_count": 0,
        "spec": {"max_restarts": 3},
        "membership_changes": 0,
        "message": "",
        "attempts": [
            {
                "number": 1,
                "state": "RUNNING",
                "device": "cuda",
                "members": [
                    {"node_name": "big", "state": "ACTIVE", "gpus": [0, 1, 2, 3]},
                    {"node_name": "small", "state": "ACTIVE", "gpus": [1]},
                ],
            },
            {"number": 0, "state": "STOPPED", "members": [{"node_name": "a", "state": "LEFT"}]},
        ],
    }
    lines = cli._status_lines(job)
    assert (
        lines[1] == "  attempt 1 RUNNING on cuda: big(active, GPUs 0,1,2,3), small(active, GPU 1)"
    )
    assert lines[2] == "  attempt 0 STOPPED: a(left)"
