"""Fixtures of the controller tests: settings on each database, the app, the reconciler."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.models import Role
from service.reconciler import Reconciler
from service.settings import ControllerSettings
from tests.helpers import FakeClock
from tests.service.helpers import ENROLMENT_TOKEN, Cluster

# Controllers on PostgreSQL must be given their key; on SQLite each makes its own.
PG_SECRETS_KEY = Fernet.generate_key().decode()


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> ControllerSettings:
    return ControllerSettings(
        data_dir=tmp_path / "data",
        database_url=db_url,
        secrets_keys=None if db_url.startswith("sqlite") else PG_SECRETS_KEY,
        node_timeout_s=10,
        enrolment_token=ENROLMENT_TOKEN,
    )


@pytest.fixture
def api(settings: ControllerSettings, clock: FakeClock) -> Iterator[Cluster]:
    """The real app with its real database, without the background loops."""
    app = create_app(settings, clock=clock, run_background=False)
    with Cluster(app) as client:
        client.node_tokens = {}
        client.name_tokens = {}
        client.user_token = client.add_user("root", Role.ADMIN)
        yield client


@pytest.fixture
def reconciler(api: TestClient, settings: ControllerSettings, clock: FakeClock) -> Reconciler:
    return Reconciler(api.app.state.session_factory, settings, clock)  # type: ignore[attr-defined]
