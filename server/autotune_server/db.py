"""Engines and sessions. Nothing here runs at import: the app factory calls these in its lifespan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

__all__ = ["ensure_sqlite_parent", "is_sqlite", "make_engine", "make_sessionmaker"]


def is_sqlite(url: str | URL) -> bool:
    """Whether a database URL points at SQLite."""
    return make_url(url).get_backend_name() == "sqlite"


def ensure_sqlite_parent(url: str | URL) -> None:
    """Create the folder of a SQLite file (the default ./var/autotune.db must work out of the box)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def make_engine(
    url: str,
    *,
    busy_timeout_seconds: float = 30.0,
    pool_size: int = 10,
    max_overflow: int = 20,
) -> Engine:
    """An engine configured for several writers.

    SQLite: WAL journal (readers never block the writer), a busy timeout (a writer waits for another
    process's lock instead of failing), foreign keys on (cascading deletes). PostgreSQL: a pool sized
    for the worker threads, with pre-ping so a restarted database does not fail the first request.
    """
    if is_sqlite(url):
        ensure_sqlite_parent(url)
        engine = create_engine(
            url,
            connect_args={"timeout": busy_timeout_seconds, "check_same_thread": False},
            pool_size=pool_size,
            max_overflow=max_overflow,
        )
        busy_ms = int(busy_timeout_seconds * 1000)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
                cursor.execute("PRAGMA foreign_keys=ON")
                # NORMAL is durable across application crashes in WAL mode; FULL only adds power-loss safety.
                cursor.execute("PRAGMA synchronous=NORMAL")
            finally:
                cursor.close()

        return engine
    return create_engine(url, pool_size=pool_size, max_overflow=max_overflow, pool_pre_ping=True)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (routes serialize them after writing)."""
    return sessionmaker(bind=engine, expire_on_commit=False)
