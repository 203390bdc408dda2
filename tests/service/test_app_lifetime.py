"""An app the tests made is freed with the test: the suite makes hundreds of them in one
process, and every full collection of the garbage collector scans what they leave."""

from __future__ import annotations

import gc
import weakref

from service.api.app import create_app
from service.settings import ControllerSettings
from tests.helpers import FakeClock, forget_classified_callables
from tests.service.helpers import Cluster


def test_an_app_that_answered_is_freed_once_fastapis_caches_are_dropped(
    settings: ControllerSettings, clock: FakeClock
) -> None:
    app = create_app(settings, clock=clock, run_background=False)
    with Cluster(app) as api:
        assert api.get("/healthz").status_code == 200
    gone = weakref.ref(app)
    del app, api
    gc.collect()
    kept = gone() is not None  # by FastAPI's caches of the callables it classified
    forget_classified_callables()
    gc.collect()
    assert gone() is None, "something other than FastAPI's caches keeps the app"
    print(f"kept until the caches were dropped: {kept}")
