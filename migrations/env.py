"""Alembic environment: the URL comes from the config the controller builds."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool, text

from service.db import MIGRATION_LOCK_KEY, serialize_sqlite
from service.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url is not None
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
