"""The FastAPI application. Boot is explicit: database, migrations, reconciler."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request, status
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from contract.protocol import ReportRefused
from service import auth
from service.api import enrolment, health, jobs, metrics, nodes, rendezvous, users
from service.api.answers import AnswerCache
from service.api.body_limit import BodyLimit
from service.api.conditional import ConditionalGet
from service.api.deps import no_reconciler
from service.api_processes import ApiProcesses, ControllerLink
from service.db import (
    database_busy,
    in_memory,
    make_engine,
    make_private_dir,
    make_read_engine,
    make_session_factory,
    upgrade_to_head,
    wait_for_database,
)
from service.errors import (
    Conflict,
    Fenced,
    Forbidden,
    IdempotencyMismatch,
    NotFound,
    StaleState,
    TooLarge,
    Unauthenticated,
)
from service.gc_pauses import collect_young_after, freeze_what_started
from service.heartbeats import Answers, Liveness, OneStatement, Pace, count_alive
from service.metrics import ControllerMetrics, RequestMetrics
from service.reconciler import Reconciler, utcnow
from service.reconciler_process import ReconcilerProcess
from service.schemas import Problem
from service.secrets import Keyring, SecretsKeyError, load_keyring, uses_default_key_file
from service.secrets_db import check_database
from service.settings import ControllerSettings
from service.states import InvalidTransition

logger = logging.getLogger(__name__)
API_PREFIX = "/api/v1"
# The web dashboard: static files that call the API with the user's token. They hold no
# data of their own, so they are served without a credential; every answer they show needs one.
DASHBOARD_DIR = Path(__file__).resolve().parents[1] / "dashboard"
# Swagger UI's files for /docs are served from here, not from a CDN, so the docs work on a
# machine without internet; like /docs and /openapi.json they need no credential. There is no
# /redoc: ReDoc's page always fetches a logo from the internet.
DOCS_ASSETS = "/docs/assets"
# What any API route may answer besides its success, each with a Problem body.
REFUSALS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "No token, or an unknown or revoked one"},
    403: {"model": Problem, "description": "The token may not do this"},
    404: {"model": Problem, "description": "No such thing, or another user's job"},
    409: {"model": Problem, "description": "The current state does not allow it"},
    413: {"model": Problem, "description": "The body is over RELAUNCH_MAX_BODY_BYTES"},
}


def reconciler_in_child(
    settings: ControllerSettings, clock: Callable[[], datetime], run_background: bool
) -> bool:
    """Whether the reconciler runs in a child process (``service.reconciler_process``):
    as set, unless the app's clock is not the wall clock (a test's, which a child could
    not share) or the database lives in this process's memory."""
    return (
        settings.reconciler_process
        and run_background
        and clock is utcnow
        and not in_memory(settings.db_url)
    )


def create_app(
    settings: ControllerSettings,
    *,
    clock: Callable[[], datetime] = utcnow,
    run_background: bool = True,
    keyring: Keyring | None = None,
    listener: socket.socket | None = None,
    controller: ControllerLink | None = None,
) -> FastAPI:
    """Build the app. With ``run_background`` the lifespan also runs the reconciler;
    tests of the API alone turn that off. The keys of jobs' env values are ``keyring``,
    else loaded from ``settings`` at start; either way checked against the database
    before the app serves. With ``listener``, the socket it serves on (bound to share its
    port), the lifespan starts ``settings.api_processes - 1`` API helper processes on the
    same port (``service.api_processes``); ``controller`` makes this app such a helper,
    which neither migrates nor runs a reconciler, and passes wakes and ``/metrics`` to
    the controller."""
    engine = make_engine(
        settings.db_url, settings.database_connections, settings.database_ping_after_idle_s
    )
    factory = make_session_factory(engine)
    read_engine = make_read_engine(settings.db_url, engine, settings.database_connections)
    read_factory = make_session_factory(read_engine)
    heartbeat_engine = _heartbeat_engine(settings, engine)
    helper = controller is not None
    run_background = run_background and not helper
    in_child = reconciler_in_child(settings, clock, run_background)
    controller_metrics = ControllerMetrics(
        None if helper else read_factory,
        reconciler_here=not (in_child or helper),
        exposed_by=controller.exposition if controller is not None else None,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The sync routes run on this loop's default thread limiter; the pools were sized
        # from the same setting, so no route thread waits for a connection.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        _make_data_dir(settings)
        wait_for_database(engine, settings.database_wait_s)
        if not helper:  # a helper starts once the controller has done this
            upgrade_to_head(settings.db_url)
        app.state.keyring = _open_keyring(settings, factory, keyring)
        if not helper:
            first_token = auth.bootstrap_admin(factory, clock())
            if first_token is not None:
                announce_first_admin(first_token)
        if settings.snapshots_are_local:
            Path(settings.snapshots).mkdir(parents=True, exist_ok=True)
        reconciler: Reconciler | ReconcilerProcess
        if in_child:
            reconciler = ReconcilerProcess(settings, controller_metrics.relayed)
        else:
            reconciler = Reconciler(factory, settings, clock, controller_metrics.reconciler)
        app.state.reconciler = reconciler
        if run_background:
            reconciler.start()
            app.state.wake_reconciler = reconciler.wake
        helpers: ApiProcesses | None = None
        if listener is not None and settings.api_processes > 1:
            helpers = ApiProcesses(
                settings,
                listener,
                settings.api_processes - 1,
                getattr(app.state, "wake_reconciler", no_reconciler),
                controller_metrics,
            )
            helpers.start()
        pushing: asyncio.Task[None] | None = None
        if controller is not None:
            app.state.wake_reconciler = controller.wake
            pushing = asyncio.create_task(controller.push(controller_metrics.shares))
        # A server's own processes, not an app a test runs in its process.
        serving = run_background or helper
        frozen = settings.gc_freeze and serving
        if frozen:
            freeze_what_started()
        thresholds = collect_young_after(settings.gc_young_threshold) if serving else None
        logger.info("controller ready on %s:%s", settings.host, settings.port)
        try:
            with controller_metrics.gc_pauses.installed():
                yield
        finally:
            if pushing is not None:
                pushing.cancel()
            if helpers is not None:
                helpers.stop()
            if frozen:
                gc.unfreeze()
            if thresholds is not None:
                gc.set_threshold(*thresholds)
            reconciler.stop()
            engine.dispose()
            read_engine.dispose()
            if heartbeat_engine is not None and heartbeat_engine is not engine:
                heartbeat_engine.dispose()

    app = FastAPIOffline(
        static_url=DOCS_ASSETS,
        redoc_url=None,
        title="relaunch",
        version="0.1.0",
        description="Fault-tolerant, elastic training service for PyTorch",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.session_factory = factory
    app.state.read_session_factory = read_factory
    app.state.clock = clock
    app.state.credentials = auth.CredentialCache(settings.credential_cache_s)
    app.state.answers = AnswerCache()
    app.state.engine = engine
    app.state.metrics = controller_metrics
    app.state.heartbeat_answers = Answers()
    app.state.heartbeat_liveness = Liveness()
    app.state.heartbeat_one_statement = (
        OneStatement(heartbeat_engine) if heartbeat_engine is not None else None
    )
    app.state.heartbeat_pace = Pace(settings, functools.partial(count_alive, read_factory))
    app.include_router(health.router)
    app.include_router(metrics.router)
    for router in (
        jobs.router,
        nodes.router,
        users.router,
        enrolment.router,
        rendezvous.router,
        rendezvous.workers,
    ):
        app.include_router(router, prefix=API_PREFIX, responses=REFUSALS)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ConditionalGet, prefix=API_PREFIX)
    # Outermost, so that it times what the other layers add and sees their refusals.
    app.add_middleware(
        RequestMetrics,
        metrics=controller_metrics,
        api_prefix=API_PREFIX,
        heartbeat_route=f"{API_PREFIX}/nodes/{{node_id}}/heartbeat",
    )
    app.mount("/dashboard", StaticFiles(directory=DASHBOARD_DIR, html=True), name="dashboard")

    @app.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    _map_errors(app)
    return app


def _heartbeat_engine(settings: ControllerSettings, engine: Engine) -> Engine | None:
    """The engine of a heartbeat's one statement (``heartbeats.OneStatement``): None where
    there is none (turned off, or SQLite); ``engine`` itself where its commits wait for
    the disk (``heartbeat_synchronous_commit``) or heartbeats share the API's threads
    (``heartbeat_threads`` 0, a pool as large as the API's would be needed), else a pool
    of its own whose commits do not wait, of a connection for each heartbeat thread."""
    if not settings.heartbeat_one_statement or not OneStatement.serves(engine):
        return None
    if settings.heartbeat_synchronous_commit or settings.heartbeat_threads == 0:
        return engine
    return make_engine(
        settings.db_url,
        settings.heartbeat_threads,
        settings.database_ping_after_idle_s,
        synchronous_commit=False,
    )


def _make_data_dir(settings: ControllerSettings) -> None:
    """The data dir, when this controller keeps anything there (the SQLite file, its own
    key file, snapshots), is its owner's only (0700); a wider one is tightened."""
    snapshots = Path(settings.snapshots)
    if (
        settings.database_is_sqlite
        or uses_default_key_file(settings)
        or (settings.snapshots_are_local and snapshots.is_relative_to(settings.data_dir))
    ):
        make_private_dir(settings.data_dir)


def _open_keyring(
    settings: ControllerSettings, factory: sessionmaker[Session], keyring: Keyring | None
) -> Keyring:
    """The keys of jobs' env values, checked against what the database holds; the
    controller does not start without them (``SecretsKeyError`` names the setting)."""
    try:
        keyring = keyring or load_keyring(settings)
        check_database(factory, keyring)
    except SecretsKeyError as exc:
        logger.error("cannot start: %s", exc)
        raise
    return keyring


FIRST_ADMIN_BANNER = "relaunch: first start; the admin's API token (shown this once):"


def announce_first_admin(token: str) -> None:
    """Print the first admin's token on stderr, not through logging, so it is not
    copied to wherever logs are shipped. Only its hash is kept."""
    print(f"{FIRST_ADMIN_BANNER}\n{token}", file=sys.stderr, flush=True)


def _map_errors(app: FastAPI) -> None:
    """The one place where domain errors become HTTP answers."""

    @app.exception_handler(NotFound)
    async def not_found(_: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_404_NOT_FOUND, content={"detail": str(exc)})

    @app.exception_handler(Unauthenticated)
    async def unauthenticated(_: Request, exc: Unauthenticated) -> JSONResponse:
        return JSONResponse(
            status_code=status.HTTP_401_UNAUTHORIZED,
            content={"detail": str(exc)},
            headers={"WWW-Authenticate": "Bearer"},
        )

    @app.exception_handler(Forbidden)
    async def forbidden(_: Request, exc: Forbidden) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_403_FORBIDDEN, content={"detail": str(exc)})

    @app.exception_handler(TooLarge)
    async def too_large(_: Request, exc: TooLarge) -> JSONResponse:
        return JSONResponse(
            status_code=status.HTTP_413_CONTENT_TOO_LARGE, content={"detail": str(exc)}
        )

    @app.exception_handler(IdempotencyMismatch)
    async def mismatch(_: Request, exc: IdempotencyMismatch) -> JSONResponse:
        # Shaped as a validation error of the header, like every other 422.
        error = {"loc": ["header", "Idempotency-Key"], "msg": str(exc), "type": "value_error"}
        return JSONResponse(
            status_code=status.HTTP_422_UNPROCESSABLE_CONTENT, content={"detail": [error]}
        )

    @app.exception_handler(Conflict)
    async def conflict(_: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_409_CONFLICT, content={"detail": str(exc)})

    @app.exception_handler(Fenced)
    async def fenced(_: Request, exc: Fenced) -> JSONResponse:
        body = ReportRefused(detail=str(exc), reason=exc.reason)
        return JSONResponse(status_code=status.HTTP_409_CONFLICT, content=body.model_dump())

    @app.exception_handler(StaleState)
    async def stale(_: Request, exc: StaleState) -> JSONResponse:
        # A concurrent writer kept winning; nothing was changed. Not a 409: node
        # agents read 409 on a report as "fenced" and would stop the attempt.
        return JSONResponse(
            status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
            content={"detail": f"{exc}; nothing was changed, retry"},
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(SecretsKeyError)
    async def secrets_key(_: Request, exc: SecretsKeyError) -> JSONResponse:
        # Checked at start; met here only if a row went unchecked there. The message
        # names the setting, never a key or a value.
        logger.error("%s", exc)
        return JSONResponse(
            status_code=status.HTTP_500_INTERNAL_SERVER_ERROR, content={"detail": str(exc)}
        )

    @app.exception_handler(SQLAlchemyError)
    async def database_error(_: Request, exc: SQLAlchemyError) -> JSONResponse:
        # Busy (SQLite's write lock or every pooled connection stayed taken past its
        # timeout: nothing was committed), or the connection closed under the statement
        # (a server restart: if that was the COMMIT, its outcome is unknown). Agents retry
        # a 503 after Retry-After.
        if not database_busy(exc):
            raise exc
        logger.warning("database busy, answered 503: %s", exc)
        return JSONResponse(
            status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
            content={"detail": "the database is busy; retry"},
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(InvalidTransition)
    async def invalid(_: Request, exc: InvalidTransition) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_409_CONFLICT, content={"detail": str(exc)})
