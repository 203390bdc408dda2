"""Engines, sessions and schema upgrades. Nothing here runs at import time."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, InvalidatePoolError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from service.errors import StaleState

logger = logging.getLogger(__name__)
T = TypeVar("T")

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# Held (pg_advisory_xact_lock) while migrating: controllers that start together
# migrate one after the other, and the later ones find the schema at head.
MIGRATION_LOCK_KEY = 0x72656C61756E6368  # "relaunch"
SQLITE_BUSY_TIMEOUT_MS = 10_000
# Connections an engine may hold at once unless told: the pool keeps this many open at most.
DEFAULT_CONNECTIONS = 30
# A pooled PostgreSQL connection idle longer than this is pinged before it is lent.
PING_AFTER_IDLE_S = 1.0


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # Let SQLAlchemy, not the driver, say when a transaction begins (see _sqlite_begin).
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _sqlite_begin(conn: Any) -> None:
    """Take SQLite's write lock when a transaction begins, not at its first write.

    The driver would otherwise run a transaction's reads outside it and begin
    only at the first write, so two read-check-write transactions (take the
    lease, place a job on free nodes) could both pass their check. With
    ``BEGIN IMMEDIATE`` they run one after the other, as PostgreSQL's row locks
    make them; a waiting writer waits up to the busy timeout.
    """
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def serialize_sqlite(engine: Engine) -> None:
    """WAL, a busy timeout, foreign keys, and one writing transaction at a time."""
    event.listen(engine, "connect", _sqlite_pragmas)
    event.listen(engine, "begin", _sqlite_begin)


def _sqlite_begin_read(conn: Any) -> None:
    conn.exec_driver_sql("BEGIN")


# Others may pass through the data dir (to the snapshot root beneath it, where each job's
# user owns its own directory) but never list it; every file the controller keeps there is 0600.
DATA_DIR_MODE = 0o711


def make_private_dir(path: Path) -> None:
    """Make ``path`` a directory only its owner can list or write (``DATA_DIR_MODE``); one
    that exists with a wider mode is tightened, with a warning. Its missing parents get the
    default mode."""
    path.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
    _tighten(path, DATA_DIR_MODE)


def _tighten(path: Path, mode: int) -> None:
    now = stat.S_IMODE(path.stat().st_mode)
    if now & ~mode:
        logger.warning("%s could be read by other users (mode %o); made it %o", path, now, mode)
        path.chmod(now & mode)


def make_sqlite_parent(url: str) -> None:
    """Make the SQLite file ``url`` names, readable and writable by its owner only (0600),
    in a directory made ``DATA_DIR_MODE`` if missing (an existing directory is left as it is).

    SQLite gives its WAL and shared-memory files the database file's mode; an existing
    database or one of those files with a wider mode is tightened, with a warning."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return
    if parsed.database == ":memory:" or parsed.database.startswith("file:"):
        return
    path = Path(parsed.database)
    if not path.parent.exists():
        path.parent.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for each in (path, *(path.with_name(path.name + s) for s in ("-wal", "-shm", "-journal"))):
        if each.exists():
            _tighten(each, 0o600)


def _pool_size(connections: int) -> dict[str, int]:
    """Pool arguments that let ``connections`` be held at once, no more, each opened when
    first needed and then kept open: a pool that closed what it had beyond a few idle
    ones opened a new PostgreSQL connection (a server process, authentication, a TLS or
    TCP handshake) for most requests once more than those few ran at once."""
    if connections < 1:
        raise ValueError(f"an engine needs at least one connection, not {connections}")
    return {"pool_size": connections, "max_overflow": 0}


def in_memory(url: str) -> bool:
    """Whether ``url`` names a SQLite database in the memory of the process that opens it
    (SQLAlchemy's own test for one)."""
    parsed = make_url(normalize_url(url))
    if parsed.get_backend_name() != "sqlite":
        return False
    return parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory"


def _sqlite_engine(url: str, connections: int) -> Engine:
    """An engine on the SQLite file ``url`` names (made if missing), with its pragmas;
    the caller says how its transactions begin."""
    make_sqlite_parent(url)
    # An in-memory database lives in one connection (SQLAlchemy's SingletonThreadPool),
    # which takes no pool size.
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        **({} if in_memory(url) else _pool_size(connections)),
    )
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def make_read_engine(url: str, engine: Engine, connections: int = DEFAULT_CONNECTIONS) -> Engine:
    """An engine for transactions that only read, of at most ``connections`` connections.

    On SQLite they begin as plain (deferred) transactions: in WAL mode they read
    a consistent snapshot while one writer writes, instead of queueing behind
    every writer for the write lock. On other databases reads and writes
    already run side by side, so this is ``engine`` itself.
    """
    url = normalize_url(url)
    if make_url(url).get_backend_name() != "sqlite":
        return engine
    read = _sqlite_engine(url, connections)
    event.listen(read, "begin", _sqlite_begin_read)
    return read


def normalize_url(url: str) -> str:
    """Let ``postgresql://`` mean the psycopg 3 driver that relaunch installs."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def make_engine(
    url: str,
    connections: int = DEFAULT_CONNECTIONS,
    ping_after_idle_s: float = PING_AFTER_IDLE_S,
    synchronous_commit: bool = True,
) -> Engine:
    """An engine of at most ``connections`` connections; a caller that needs one more
    waits for one to be returned (``TimeoutError`` after 30 s). On PostgreSQL a pooled
    connection idle for more than ``ping_after_idle_s`` (0: any) is pinged before it is
    lent (``ping_idle_connections``), and without ``synchronous_commit`` its commits do
    not wait for the server to flush them to disk (``_commits_without_flush``)."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = _sqlite_engine(url, connections)
        event.listen(engine, "begin", _sqlite_begin)  # one writing transaction at a time
        return engine
    # Last in, first out: the connections a steady load keeps busy are lent again within
    # ``ping_after_idle_s``; the others sit idle, and are pinged when next lent.
    engine = create_engine(url, pool_use_lifo=True, **_pool_size(connections))
    ping_idle_connections(engine, ping_after_idle_s)
    if not synchronous_commit:
        event.listen(engine, "connect", _commits_without_flush)
    return engine


def _commits_without_flush(dbapi_connection: Any, _record: Any) -> None:
    """Set a new PostgreSQL connection's ``synchronous_commit`` off for its session: its
    commits return before the server has flushed them to disk (a crash of the server may
    lose the last of them, never half of one). A statement of its own rather than the
    connection's ``options``, which would replace whatever options the database URL or
    ``PGOPTIONS`` give (a ``search_path``, a ``statement_timeout``)."""
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit = off")
    finally:
        dbapi_connection.autocommit = autocommit


def ping_idle_connections(engine: Engine, after_s: float) -> None:
    """Ping a pooled connection before it is lent if it was idle for more than ``after_s``
    seconds (0: always), and lend another if the ping fails.

    A ping is a round trip to the server. Pinging at every loan (SQLAlchemy's
    ``pool_pre_ping``) added one to every request, and under load a round trip costs
    the server a wake-up and both sides two system calls. A connection lent again
    within ``after_s`` is taken as it is: the server (or a proxy) closed it since only
    if it restarted in that moment, and then the statement fails as a disconnect,
    which invalidates every connection the pool opened before it (SQLAlchemy does
    so), and the API answers that request 503 with Retry-After (``database_busy``).
    A failed ping invalidates them likewise."""

    @event.listens_for(engine, "checkin")
    def _idle_from(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.pop("idle_since", None)
        if idle_since is None:
            return  # opened for this loan (a connection's info is new with it)
        if after_s > 0 and time.monotonic() - idle_since <= after_s:
            return  # lent again soon enough
        try:
            engine.dialect.do_ping(dbapi_conn)  # one round trip
        except engine.dialect.loaded_dbapi.Error as exc:
            if engine.dialect.is_disconnect(exc, dbapi_conn, None) or _closed(dbapi_conn):
                # Every connection the pool opened before this one goes too: the server
                # restarted, or a proxy dropped them all.
                raise InvalidatePoolError(f"a pooled connection was closed: {exc}") from exc
            raise


def _closed(dbapi_conn: Any) -> bool:
    return bool(getattr(dbapi_conn, "closed", False))


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any error."""
    with factory() as session, session.begin():
        yield session


@contextmanager
def transaction_if_asked(factory: sessionmaker[Session]) -> Iterator[Callable[[], Session]]:
    """A function that begins a transaction (``transaction``) at its first call and
    returns it at every call; the transaction, if begun, ends with the ``with``."""
    with ExitStack() as stack:
        begun: list[Session] = []

        def session() -> Session:
            if not begun:
                begun.append(stack.enter_context(transaction(factory)))
            return begun[0]

        yield session


def retry_on_stale(
    factory: sessionmaker[Session], work: Callable[[Session], T], attempts: int = 5
) -> T:
    """Run ``work`` in a transaction; run it again, in a new one, if it lost a
    compare-and-set to a concurrent writer. The last ``StaleState`` propagates."""
    for attempt in range(attempts):
        try:
            with transaction(factory) as session:
                return work(session)
        except StaleState:
            if attempt == attempts - 1:
                raise
            logger.info("lost a compare-and-set; retrying (%d)", attempt + 1)
    raise AssertionError("unreachable")


def database_busy(exc: Exception) -> bool:
    """Whether ``exc`` says the database is busy rather than broken, so that the same
    request may succeed later: SQLite's write lock stayed taken past the busy timeout,
    every pooled connection stayed in use past the pool's timeout, or the connection
    was closed under the statement (a server restart)."""
    if isinstance(exc, PoolTimeout):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True  # the server closed the connection (it restarted): the pool reconnects
    return isinstance(exc, OperationalError) and "database is locked" in str(exc.orig)


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def wait_for_database(engine: Engine, timeout_s: float = 30.0) -> None:
    """Block until the database answers, or raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return
        except OperationalError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"database not reachable: {exc}") from exc
            logger.info("waiting for the database: %s", exc.orig)
            time.sleep(1.0)


def upgrade_to_head(url: str) -> None:
    command.upgrade(alembic_config(url), "head")


def downgrade_to_base(url: str) -> None:
    command.downgrade(alembic_config(url), "base")
