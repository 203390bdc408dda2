"""Log labels: the job's own attempt number, node names, global ranks."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from contract.labels import label_from_environ, log_label
from contract.protocol import ATTEMPT_ID_ENV, ATTEMPT_NUMBER_ENV, JOB_ID_ENV, NODE_NAME_ENV
from worker.runtime.env import DistEnv, Launcher
from worker.tasks.cli import configure_logging

AGENT_ENV = {
    JOB_ID_ENV: "3",
    ATTEMPT_ID_ENV: "17",  # the controller's id: never shown as the attempt
    ATTEMPT_NUMBER_ENV: "2",
    NODE_NAME_ENV: "node-a",
}


def test_a_label_names_each_part_and_leaves_out_the_unknown() -> None:
    assert (
        log_label(job=3, attempt=2, node="node-a", rank=5, local_rank=1)
        == "job 3 attempt 2 node node-a rank 5 local rank 1"
    )
    assert log_label(job=3, rank=0) == "job 3 rank 0"
    assert log_label() == ""


def test_a_worker_is_labelled_by_the_jobs_attempt_number_and_its_global_rank() -> None:
    assert label_from_environ(AGENT_ENV, rank=5) == "job 3 attempt 2 rank 5"


def test_the_launcher_is_labelled_by_its_node_name() -> None:
    assert label_from_environ(AGENT_ENV, node=True) == "job 3 attempt 2 node node-a"


def test_without_the_agent_only_the_rank_is_known() -> None:
    assert label_from_environ({ATTEMPT_ID_ENV: "17"}, rank=0) == "rank 0"


def test_worker_log_lines_carry_the_label(capsys: pytest.CaptureFixture[str]) -> None:
    env = DistEnv(
        rank=5, local_rank=1, world_size=8, local_world_size=2, launcher=Launcher.TORCHRUN
    )
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging(env, environ=AGENT_ENV)
        logging.getLogger("worker.test").info("step 10")
        err = capsys.readouterr().err
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    assert "[job 3 attempt 2 rank 5] worker.test: step 10" in err


def test_labels_import_no_torch(subprocess_env: dict[str, str]) -> None:
    code = (
        "import sys\n"
        "import contract.labels\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
