"""Helpers for the worker tests: a clean environment for worker subprocesses."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """The current environment without launcher or relaunch variables, repo on PYTHONPATH."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("RELAUNCH_", "TORCHELASTIC_"))
        and key not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
        and key not in {"MASTER_ADDR", "MASTER_PORT"}
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def read_events() -> Callable[[Path], list[dict[str, Any]]]:
    """Parse an events file written through RELAUNCH_EVENTS_FILE."""

    def read(path: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    return read


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undo a task CLI's logging.basicConfig(force=True) after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)
