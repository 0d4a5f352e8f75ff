"""Engines and sessions. Nothing here runs at import: the app factory calls these in its lifespan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

__all__ = [
    "COMMITTED",
    "CONNECT_TIMEOUT_SECONDS",
    "POOL_TIMEOUT_SECONDS",
    "POSTGRES_TCP_OPTIONS",
    "ensure_sqlite_parent",
    "is_sqlite",
    "make_engine",
    "make_sessionmaker",
]

COMMITTED = "autotune_committed"
"""Key in ``Session.info`` set once the session has committed."""

CONNECT_TIMEOUT_SECONDS = 5
"""PostgreSQL: a connect that hangs (a host gone from the network) fails after this, as a 503,
instead of holding a worker thread for the operating system's TCP timeout."""

POSTGRES_TCP_OPTIONS = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}
"""libpq settings for a database host that vanishes without closing its connections (a network
partition, a host power loss): idle pooled connections are found dead by keepalives within about a
minute, and a query whose packets go unacknowledged fails after 10 s instead of Linux's ~15 minutes
of retransmissions. Each is left as the URL says when the URL sets it."""

POOL_TIMEOUT_SECONDS = 10.0
"""How long a request waits for a pooled connection before it is answered 503 (the client's whole
call is bounded by 10 s by default: waiting longer helps no one)."""


def is_sqlite(url: str | URL) -> bool:
    """Whether a database URL points at SQLite."""
    return make_url(url).get_backend_name() == "sqlite"


def ensure_sqlite_parent(url: str | URL) -> None:
    """Create the folder of a SQLite file (the default ./var/autotune.db must work out of the box)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return
    database = parsed.database
    if database.startswith("file:"):
        # A URI filename (?uri=true): the path is after "file:" and before the query, as SQLite reads it;
        # taken as a plain path it would create a folder called "file:" in the working directory.
        database = database.removeprefix("file:").split("?", 1)[0]
        if database in ("", ":memory:"):
            return
    Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def make_engine(
    url: str,
    *,
    busy_timeout_seconds: float = 30.0,
    pool_size: int = 10,
    max_overflow: int = 20,
) -> Engine:
    """An engine configured for several writers, and for a database that goes away.

    SQLite: WAL journal (readers never block the writer), a busy timeout (a writer waits for another
    process's lock instead of failing), foreign keys on (cascading deletes). PostgreSQL: a pool sized
    for the worker threads, with pre-ping so a restarted database does not fail the first request,
    and bounded waits (connect, pool) so that an unreachable database is a prompt 503.
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
    parsed = make_url(url)
    connect_args: dict[str, Any] = {}
    if parsed.get_backend_name() == "postgresql":
        defaults = {"connect_timeout": CONNECT_TIMEOUT_SECONDS, **POSTGRES_TCP_OPTIONS}
        connect_args = {key: value for key, value in defaults.items() if key not in parsed.query}
    return create_engine(
        url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_pre_ping=True,
        pool_timeout=POOL_TIMEOUT_SECONDS,
        connect_args=connect_args,
    )


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (routes serialize them after writing).

    A commit marks ``session.info[COMMITTED]``: the outage monitor counts a committed write as proof
    that a write-side failure (a lock, a read-only or full database) is over.
    """
    made = sessionmaker(bind=engine, expire_on_commit=False)

    @event.listens_for(made, "after_commit")
    def _mark_committed(session: Session) -> None:
        session.info[COMMITTED] = True

    return made
