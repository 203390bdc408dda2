"""Typed dependencies shared by the routers: the transaction, settings, clock and caller."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Path, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import State

from service import auth
from service.api.answers import AnswerCache
from service.api.lane import Lane
from service.db import transaction
from service.errors import Forbidden, Unauthenticated
from service.heartbeats import Answers, Liveness, OneStatement, Pace
from service.metrics import ControllerMetrics
from service.models import Node, Role, User
from service.secrets import Keyring
from service.settings import ControllerSettings


def get_session(request: Request) -> Iterator[Session]:
    """One transaction per request: committed if the route returns, rolled back if it raises."""
    factory: sessionmaker[Session] = request.app.state.session_factory
    with factory() as session, session.begin():
        yield session


def get_read_session(request: Request) -> Iterator[Session]:
    """A transaction that only reads: on SQLite it does not wait for the write lock."""
    factory: sessionmaker[Session] = request.app.state.read_session_factory
    with factory() as session, session.begin():
        yield session


async def get_read_factory(request: Request) -> sessionmaker[Session]:
    factory: sessionmaker[Session] = request.app.state.read_session_factory
    return factory


async def get_settings(request: Request) -> ControllerSettings:
    settings: ControllerSettings = request.app.state.settings
    return settings


async def get_keyring(request: Request) -> Keyring:
    """The keys of jobs' env values, loaded and checked against the database at start."""
    keyring: Keyring = request.app.state.keyring
    return keyring


async def get_now(request: Request) -> datetime:
    clock: Callable[[], datetime] = request.app.state.clock
    return clock()


async def get_metrics(request: Request) -> ControllerMetrics:
    metrics: ControllerMetrics = request.app.state.metrics
    return metrics


async def get_credentials(request: Request) -> auth.CredentialCache:
    """The users of recently checked tokens (``auth.CredentialCache``)."""
    cache: auth.CredentialCache = request.app.state.credentials
    return cache


async def get_answers(request: Request) -> AnswerCache:
    """The bodies of recent job reads, each with what it was built from."""
    cache: AnswerCache = request.app.state.answers
    return cache


def heartbeat_lane(state: State) -> Lane | None:
    """The threads that answer only heartbeats (``heartbeat_threads``; None: the API's
    own), made on first use, on the app's event loop."""
    lane: Lane | None = getattr(state, "heartbeat_lane", None)
    settings: ControllerSettings = state.settings
    if lane is None and settings.heartbeat_threads > 0:
        lane = state.heartbeat_lane = Lane(
            settings.heartbeat_threads, settings.heartbeat_wait_max_s
        )
    return lane


@dataclass(frozen=True)
class FleetCall:
    """What the node agents' routes called at the fleet's rate (heartbeat, report) use
    of the app, taken in one dependency: FastAPI's resolution of each dependency cost
    about as much CPU as a heartbeat's own statement (a heartbeat's dozen took a fifth
    of its process's time under a steady stream of heartbeats, ``py-spy``)."""

    factory: sessionmaker[Session]
    read_factory: sessionmaker[Session]
    settings: ControllerSettings
    keyring: Keyring
    metrics: ControllerMetrics
    now: datetime  # when the request was taken up
    answers: Answers  # the heartbeat answers this controller has rendered
    one_statement: OneStatement | None  # a heartbeat's record and read in one statement
    pace: Pace  # the heartbeat interval this controller tells nodes
    liveness: Liveness  # what this controller notes of the heartbeats it sheds
    lane: Lane | None  # the heartbeats' own threads (``heartbeat_lane``)


async def get_fleet_call(request: Request) -> FleetCall:
    state = request.app.state
    return FleetCall(
        factory=state.session_factory,
        read_factory=state.read_session_factory,
        settings=state.settings,
        keyring=state.keyring,
        metrics=state.metrics,
        now=state.clock(),
        answers=state.heartbeat_answers,
        one_statement=state.heartbeat_one_statement,
        pace=state.heartbeat_pace,
        liveness=state.heartbeat_liveness,
        lane=heartbeat_lane(state),
    )


async def get_wake(request: Request) -> Callable[[float], bool]:
    """Start the reconciler's next pass now, and wait up to the seconds given for it to
    end (``Reconciler.wake``); does nothing where no reconciler runs (False)."""
    wake: Callable[[float], bool] = getattr(request.app.state, "wake_reconciler", no_reconciler)
    return wake


def no_reconciler(wait_s: float) -> bool:
    return False


async def get_session_factory(request: Request) -> sessionmaker[Session]:
    factory: sessionmaker[Session] = request.app.state.session_factory
    return factory


# scope="function": commit before the response is sent, so a client that got 201
# can read what it created at once (the default scope commits after sending). It still
# commits only after FastAPI has validated the answer on a second worker thread, holding
# a connection (on SQLite, the write lock) while it waits for one: routes called at fleet
# rate (the node agents') take FactoryDep and end their transaction before they return.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[ControllerSettings, Depends(get_settings)]
NowDep = Annotated[datetime, Depends(get_now)]
KeyringDep = Annotated[Keyring, Depends(get_keyring)]
FactoryDep = Annotated[sessionmaker[Session], Depends(get_session_factory)]
ReadSessionDep = Annotated[Session, Depends(get_read_session, scope="function")]
ReadFactoryDep = Annotated[sessionmaker[Session], Depends(get_read_factory)]
MetricsDep = Annotated[ControllerMetrics, Depends(get_metrics)]
CredentialsDep = Annotated[auth.CredentialCache, Depends(get_credentials)]
AnswersDep = Annotated[AnswerCache, Depends(get_answers)]
WakeDep = Annotated[Callable[[float], bool], Depends(get_wake)]
FleetCallDep = Annotated[FleetCall, Depends(get_fleet_call)]

# Ids are 64-bit in the database; a larger number is a client's mistake (422), not a 500.
MAX_ID = 2**63 - 1
IdPath = Annotated[int, Path(ge=1, le=MAX_ID)]
Offset = Annotated[int, Query(ge=0, le=10**9, description="Skip this many items")]
PageLimit = Annotated[int, Query(ge=1, le=1000, description="At most this many items")]

_bearer = HTTPBearer(
    auto_error=False,
    description="A user's API token (rlu_…) for the job and user routes; a node's token "
    "(rln_…) or the enrolment token for the node agent routes",
)
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _token(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None:
        raise Unauthenticated("send a token: 'Authorization: Bearer <token>'")
    return credentials.credentials


# The caller is looked up in a transaction of its own, ended before the route
# runs: a route that opens its own transactions (retry_on_stale) must not wait
# behind one the credential check still holds (SQLite runs one at a time).


def user_from_database(
    factory: sessionmaker[Session], credentials: HTTPAuthorizationCredentials | None
) -> User:
    """The caller, looked up in the database (no cache)."""
    token = _token(credentials)
    with transaction(factory) as session:
        user = auth.user_for_token(session, token)
        if user is not None:
            return user
        if auth.node_for_token(session, token) is not None:
            raise Forbidden("a node's token cannot call user routes; use a user's API token")
    raise Unauthenticated("the token is unknown or revoked")


async def get_user(request: Request, credentials: BearerDep) -> User:
    """The caller, from the credential cache (``RELAUNCH_CREDENTIAL_CACHE_S``) or else
    the database, on a worker thread. Read from the app's state rather than through
    sub-dependencies: every route with a user resolves this, and each dependency costs
    more than the cache."""
    token = _token(credentials)
    cache = await get_credentials(request)
    now = await get_now(request)
    user = cache.user(token, now)
    if user is None:
        factory = await get_read_factory(request)
        since = cache.forgotten
        user = await run_in_threadpool(user_from_database, factory, credentials)
        cache.remember(token, user, now, since)
    return user


def require_admin(user: User) -> User:
    if user.role is not Role.ADMIN:
        raise Forbidden(f"user {user.name!r} is not an admin")
    return user


async def get_admin(user: Annotated[User, Depends(get_user)]) -> User:
    return require_admin(user)


def get_calling_node(factory: ReadFactoryDep, credentials: BearerDep) -> Node:
    """The node whose token the call carries."""
    token = _token(credentials)
    with transaction(factory) as session:
        node = auth.node_for_token(session, token)
        if node is None:
            auth.refuse_as_node(session, token)
    return node


def get_node(node_id: IdPath, factory: ReadFactoryDep, credentials: BearerDep) -> Node:
    """The node whose token the call carries; it must be the node the path names."""
    node = get_calling_node(factory, credentials)
    if node.id != node_id:
        raise Forbidden(f"this token belongs to node {node.id}, not node {node_id}")
    return node


async def presented_token(credentials: BearerDep) -> str:
    """The bearer token as presented, for a route that checks it itself, in its own
    transaction; 401 if none. A coroutine: FastAPI calls a plain-function dependency on a
    worker thread of its own."""
    return _token(credentials)


UserDep = Annotated[User, Depends(get_user)]
AdminDep = Annotated[User, Depends(get_admin)]
NodeDep = Annotated[Node, Depends(get_node)]
CallingNodeDep = Annotated[Node, Depends(get_calling_node)]
# Tokens a route checks itself, each as ``presented_token`` gives it:
# a registering agent's credential, the shared enrolment token or a per-node one
# (``service.enrolment.admit``, with the name it registers: a single-use one is used up there);
EnrolmentDep = Annotated[str, Depends(presented_token)]
# a worker's token, against the job the route names (``service.fence.check_worker``);
WorkerTokenDep = Annotated[str, Depends(presented_token)]
# a node's token, where the route reads what the node may do
# (``service.rendezvous.member_attempt``).
NodeTokenDep = Annotated[str, Depends(presented_token)]
