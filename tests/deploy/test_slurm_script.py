"""deploy/slurm/relaunch-agents.sbatch is a shell script that bash and shellcheck accept;
tests/deploy/test_slurm.py runs it on Slurm."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "relaunch-agents.sbatch"


def test_bash_parses_the_script() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_shellcheck_finds_nothing_in_the_script() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (make slurm installs it)")
    done = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
