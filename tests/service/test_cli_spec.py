"""What `relaunch submit` sends: the spec from its file, with its flags on top."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from service import cli
from service.cli import app


@pytest.mark.parametrize(
    ("in_file", "flags", "sent_on_top"),
    [
        (
            "working_dir: /data/old",
            ["--working-dir", "/data/runs/exp1"],
            {"working_dir": "/data/runs/exp1"},
        ),
        (
            "device: cpu",
            ["--device", "cuda", "--nproc-per-node", "4"],
            {"device": "cuda", "nproc_per_node": 4},
        ),
    ],
    ids=["working_dir", "device"],
)
def test_submit_sends_its_flags_over_the_spec_files(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    in_file: str,
    flags: list[str],
    sent_on_top: dict[str, Any],
) -> None:
    sent: list[dict[str, Any]] = []

    def submit(
        self: object, spec: dict[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        sent.append(spec)
        return {"id": 7, "name": spec["name"], "state": "PENDING"}

    monkeypatch.setattr(cli.RelaunchClient, "submit", submit)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(f"name: j\nscript: {{path: /opt/train.py}}\n{in_file}\n")
    result = CliRunner().invoke(
        app, ["submit", str(spec_file), *flags], env={"RELAUNCH_TOKEN": "rlu_anything"}
    )
    assert result.exit_code == 0, result.output
    assert sent == [{"name": "j", "script": {"path": "/opt/train.py"}, **sent_on_top}]
