"""What `relaunch submit` sends: the spec from its file, with its flags on top."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from service import cli
from service.cli import app


def test_submit_sends_the_working_dir_flag_over_the_spec_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[dict[str, Any]] = []

    def submit(
        self: object, spec: dict[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        sent.append(spec)
        return {"id": 7, "name": spec["name"], "state": "PENDING"}

    monkeypatch.setattr(cli.RelaunchClient, "submit", submit)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: j\nscript: {path: /opt/train.py}\nworking_dir: /data/old\n")
    args = ["submit", str(spec_file), "--working-dir", "/data/runs/exp1"]
    result = CliRunner().invoke(app, args, env={"RELAUNCH_TOKEN": "rlu_anything"})
    assert result.exit_code == 0, result.output
    assert sent == [
        {"name": "j", "script": {"path": "/opt/train.py"}, "working_dir": "/data/runs/exp1"}
    ]


def test_submit_sends_the_device_flag_over_the_spec_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[dict[str, Any]] = []

    def submit(
        self: object, spec: dict[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        sent.append(spec)
        return {"id": 7, "name": spec["name"], "state": "PENDING"}

    monkeypatch.setattr(cli.RelaunchClient, "submit", submit)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: j\nscript: {path: /opt/train.py}\ndevice: cpu\n")
    args = ["submit", str(spec_file), "--device", "cuda", "--nproc-per-node", "4"]
    result = CliRunner().invoke(app, args, env={"RELAUNCH_TOKEN": "rlu_anything"})
    assert result.exit_code == 0, result.output
    assert sent == [
        {"name": "j", "script": {"path": "/opt/train.py"}, "device": "cuda", "nproc_per_node": 4}
    ]
