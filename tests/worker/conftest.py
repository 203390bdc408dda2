"""Helpers for the worker tests: a clean environment for worker subprocesses."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


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
