"""Alembic environment: synchronous, against the URL the caller configured."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool, text

from autotune_server.models import Base

config = context.config
target_metadata = Base.metadata

# Any fixed number: the advisory lock that serializes concurrent upgrades on PostgreSQL.
_PG_MIGRATION_LOCK = 0x6175746F  # "auto"


def _url() -> str:
    # Code (autotune_server.migrate) first, then `alembic -x url=...`, the service's variable, the ini.
    url = (
        config.attributes.get("database_url")
        or context.get_x_argument(as_dictionary=True).get("url")
        or os.environ.get("AUTOTUNE_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise RuntimeError("no database URL: set sqlalchemy.url or use autotune_server.migrate")
    return str(url)


def run_migrations_offline() -> None:
    """Emit SQL to stdout instead of running it (``alembic upgrade head --sql``)."""
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run the migrations on a live connection."""
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        if context.get_context().dialect.name == "postgresql":
            # Several server processes may start at once; the second waits, then finds nothing to do.
            context.get_context().connection.execute(  # type: ignore[union-attr]
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK}
            )
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
