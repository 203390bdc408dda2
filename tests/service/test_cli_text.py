"""What the CLI prints from the controller is printed as text, never read as markup."""

from __future__ import annotations

import pytest

from service import cli

GLOO_ERROR = (
    "worker rank 1 failed: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:553] Connection closed by peer [bold]"
)


def test_a_timeline_message_with_brackets_prints_as_it_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cli.console.width = 400
    cli.print_timeline(
        [{"time": "2026-11-22T18:00:00.000000", "kind": "worker_failed", "message": GLOO_ERROR}]
    )
    assert "pair.cc:553] Connection closed by peer [bold]" in capsys.readouterr().out


def test_an_error_with_brackets_prints_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    cli.err_console.width = 400
    cli._fail(GLOO_ERROR)
    assert "[/__w/pytorch" in capsys.readouterr().err
