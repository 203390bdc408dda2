"""Helpers for the worker tests: a clean environment for worker subprocesses."""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from service.api.app import create_app
from service.models import Role
from service.reconciler import Reconciler
from service.settings import ControllerSettings
from tests.helpers import FakeClock, wait_for
from tests.service.helpers import ENROLMENT_TOKEN, Cluster
from tests.worker.helpers import LiveController


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


@pytest.fixture
def live_controller(tmp_path: Path, clock: FakeClock) -> Iterator[LiveController]:
    settings = ControllerSettings(
        data_dir=tmp_path / "controller",
        database_url=f"sqlite:///{tmp_path / 'relaunch.db'}",
        enrolment_token=ENROLMENT_TOKEN,
    )
    app = create_app(settings, clock=clock, run_background=False)
    with Cluster(app) as api:
        api.node_tokens = {}
        api.user_token = api.add_user("root", Role.ADMIN)
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_for("the controller to listen", lambda: server.started, 20)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield LiveController(
                api,
                f"http://127.0.0.1:{port}",
                Reconciler(app.state.session_factory, settings, clock),
            )
        finally:
            server.should_exit = True
            thread.join(10)
