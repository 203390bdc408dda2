"""The spare launcher (``worker.spare``) as a real process: it loads before any job, takes
one hand-off from a file of root's alone, and becomes the launcher it describes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import wait_for
from worker.spare import Handoff, SpareLauncher, read_handoff

REPO = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path) -> dict[str, str]:
    # As the agent's: the interpreter finds relaunch through its install, not PYTHONPATH
    # (a spare is started with -I).
    return {"PATH": os.environ.get("PATH", ""), "RELAUNCH_NODE_SPARE": "1"}


@pytest.fixture
def spare(tmp_path: Path) -> SpareLauncher:
    home = tmp_path / "spare"
    home.mkdir(mode=0o700)
    started = SpareLauncher.start(_env(tmp_path), home)
    yield started
    started.stop()


def test_a_spare_loads_then_becomes_the_launcher_it_is_handed(
    tmp_path: Path, spare: SpareLauncher
) -> None:
    wait_for("the spare to load", spare.ready, timeout_s=120)
    assert spare.alive()
    assert spare.ready_after_s is not None and spare.ready_after_s > 0
    events = tmp_path / "events.jsonl"
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {
        "PATH": os.environ.get("PATH", ""),
        "RELAUNCH_JOB_ID": "3",
        "RELAUNCH_ATTEMPT_NUMBER": "2",
        "RELAUNCH_NODE_NAME": "node-x",
    }
    handoff = Handoff(
        argv=["--events-file", str(events), "--", "--no-such-torchrun-flag"],
        env=env,
        cwd=str(workdir),
    )
    proc = spare.hand_off(handoff, tmp_path / "launch.json")
    assert proc.wait(60) == 2  # torchrun's parser refused its arguments, as a launcher's would
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    # The launcher's lines carry the attempt it was handed, not the spare's empty label.
    assert "[job 3 attempt 2 node node-x] launcher exit: failed (2)" in err
    exits = [json.loads(line) for line in events.read_text().splitlines()]
    assert exits[-1]["kind"] == "launcher_exit"
    assert exits[-1]["data"]["exitcode"] == 2
    assert not (tmp_path / "launch.json").exists()  # read, then deleted


def test_a_spare_handed_off_while_still_loading_takes_it_once_loaded(
    tmp_path: Path, spare: SpareLauncher
) -> None:
    events = tmp_path / "events.jsonl"
    handoff = Handoff(
        argv=["--events-file", str(events), "--", "--no-such-torchrun-flag"],
        env={"PATH": os.environ.get("PATH", "")},
        cwd=str(tmp_path),
    )
    proc = spare.hand_off(handoff, tmp_path / "launch.json")
    assert proc.wait(120) == 2


def test_a_spare_whose_stdin_closes_ends_without_running_anything(
    tmp_path: Path, spare: SpareLauncher
) -> None:
    wait_for("the spare to load", spare.ready, timeout_s=120)
    assert spare.proc.stdin is not None
    spare.proc.stdin.close()
    assert spare.proc.wait(30) == 0


def test_a_spare_refuses_a_handoff_file_that_is_not_its_users_alone(tmp_path: Path) -> None:
    good = Handoff(argv=["--events-file", "x"], env={}, cwd="/")
    loose = tmp_path / "loose.json"
    loose.write_text(good.model_dump_json())
    loose.chmod(0o644)
    with pytest.raises(ValueError, match="alone"):
        read_handoff(loose)
    target = tmp_path / "target.json"
    target.write_text(good.model_dump_json())
    target.chmod(0o600)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(OSError):
        read_handoff(link)  # O_NOFOLLOW: a link is never followed
    assert read_handoff(target) == good
    assert not target.exists()


def test_a_bad_handoff_ends_the_spare_before_it_runs_anything(
    tmp_path: Path, spare: SpareLauncher
) -> None:
    path = tmp_path / "launch.json"
    assert spare.proc.stdin is not None
    path.write_text("{}")
    path.chmod(0o644)
    spare.proc.stdin.write(str(path).encode() + b"\n")
    spare.proc.stdin.close()
    assert spare.proc.wait(120) == 1
    assert spare.proc.stderr is not None
    assert "bad hand-off" in spare.proc.stderr.read().decode()
