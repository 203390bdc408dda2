from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.reconciler import Reconciler
from service.settings import ControllerSettings
from tests.conftest import FakeClock


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> ControllerSettings:
    return ControllerSettings(
        data_dir=tmp_path / "data",
        database_url=db_url,
        store_port=29999,
        node_timeout_s=10,
    )


@pytest.fixture
def api(settings: ControllerSettings, clock: FakeClock) -> Iterator[TestClient]:
    """The real app with its real database, without the background loops."""
    app = create_app(settings, clock=clock, run_background=False)
    with TestClient(app) as client:
        yield client


@pytest.fixture
def reconciler(api: TestClient, settings: ControllerSettings, clock: FakeClock) -> Reconciler:
    return Reconciler(api.app.state.session_factory, settings, clock)  # type: ignore[attr-defined]
