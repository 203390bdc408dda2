"""Alembic environment.

The controller sets ``sqlalchemy.url`` itself when it migrates at start. Run by hand
(``alembic upgrade head`` in a checkout, or ``relaunch db upgrade``), the URL comes from
the controller's own settings: ``DATABASE_URL`` / ``RELAUNCH_DATABASE_URL``, else the
SQLite file in ``RELAUNCH_DATA_DIR``, so an operator migrates the database the
controller will open.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool, text

from service.db import MIGRATION_LOCK_KEY, make_sqlite_parent, normalize_url, serialize_sqlite
from service.models import Base
from service.settings import ControllerSettings

config = context.config
target_metadata = Base.metadata


def database_url() -> str:
    """The URL the controller gave, else the one its settings name."""
    return config.get_main_option("sqlalchemy.url") or normalize_url(ControllerSettings().db_url)


def run_migrations_offline() -> None:
    context.configure(
        url=database_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = database_url()
    make_sqlite_parent(url)
    connectable = create_engine(url, poolclass=pool.NullPool)
    if connectable.dialect.name == "sqlite":
        serialize_sqlite(connectable)  # BEGIN IMMEDIATE: one migrating process at a time
    with connectable.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
            transactional_ddl=True,  # all revisions or none, on SQLite too
        )
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":
                connection.execute(
                    text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
                )
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
