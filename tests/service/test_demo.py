"""What ``relaunch demo`` says about its job, and about the controller when it ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.demo import DEMO_SPEC, ended_text, job_summary
from service.spec import JobSpec


def submitted(spec: dict[str, Any], min_nodes: int, max_nodes: int) -> dict[str, Any]:
    """The parts of the API's answer to a submit that the summary reads."""
    full = JobSpec.model_validate(spec).model_dump(mode="json")
    return {
        "id": 1,
        "name": full["name"],
        "state": "PENDING",
        "spec": full,
        "min_nodes": min_nodes,
        "max_nodes": max_nodes,
    }


def test_the_demo_job_is_one_line_under_its_own_name() -> None:
    line = job_summary(submitted(DEMO_SPEC, 2, 2))
    assert line == (
        f"submitted job 1 {DEMO_SPEC['name']}: task charlm (epochs=4, seed=7, "
        "log_every_steps=1) on 2 nodes, 1 process each, up to 3 restarts, "
        "a snapshot every 5 steps"
    )
    assert "{" not in line and "'" not in line


def test_a_script_job_on_a_range_of_nodes() -> None:
    spec = {
        "name": "mine",
        "script": {"path": "/shared/train.py"},
        "nnodes": "1:4",
        "nproc_per_node": 2,
        "max_restarts": 0,
    }
    assert job_summary(submitted(spec, 1, 4)) == (
        "submitted job 1 mine: script /shared/train.py on 1 to 4 nodes, 2 processes each, "
        "no restarts, a snapshot after each epoch"
    )


def test_a_demo_that_stops_says_its_api_stops_answering(tmp_path: Path) -> None:
    text = ended_text(tmp_path)
    assert "controller and node agents stop now" in text
    assert "no longer answers" in text and "--keep-running" in text and str(tmp_path) in text
