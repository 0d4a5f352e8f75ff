"""When the database goes away: what kind of failure it is, what the log says, what /suggest remembers.

Three pieces, each small:

- :func:`classify` reads a database exception and says whether it is an outage (the store cannot be
  reached or cannot take a write right now: 503, or 507 for a full disk) or a real error (a bug or
  a schema problem: 500 with its traceback in the log). Nothing but the class of failure leaves the
  server; the exception's text can hold a URL.
- :class:`OutageMonitor` turns thousands of refused requests into a few log lines: one when a kind
  of failure starts, one per interval while it lasts (since when, how many refused), one when the
  database is back. No tracebacks for an outage.
- :class:`RememberedLookups` keeps what /suggest last read from the database per setup, so that a
  job asking during a short outage still gets the answer it would have got a moment before, marked
  as remembered (a warning in the body, ``Age`` and ``X-Autotune-Stale`` headers), within a bounded age.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Generic, TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

__all__ = [
    "DATABASE_ERRORS",
    "LOG_INTERVAL_SECONDS",
    "RETRY_AFTER_SECONDS",
    "SETTLE_SECONDS",
    "STALE_HEADER",
    "Failure",
    "OutageMonitor",
    "RememberedLookups",
    "classify",
]

log = logging.getLogger("autotune_server.outage")

RETRY_AFTER_SECONDS = 2
"""What a 503 asks a client to wait: short, since most outages are a restart or a failover."""

LOG_INTERVAL_SECONDS = 10.0
"""While the database is down, one log line per kind of failure per this many seconds."""

SETTLE_SECONDS = 1.0
"""An outage is over when the database answers this long after its last failure: a database that is
shutting down or starting answers some requests and refuses others, and that is one outage, not a
pair of lines per flap."""

STALE_HEADER = "X-Autotune-Stale"
"""Response header of a /suggest answer given from memory while the database is unavailable."""

DATABASE_ERRORS: tuple[type[Exception], ...] = (DBAPIError, PoolTimeoutError)
"""The exception classes whose handler asks :func:`classify` (everything the database layer raises
about the database itself; DataError and IntegrityError are subclasses with their own handlers)."""


@dataclass(frozen=True)
class Failure:
    """One kind of outage and how it is answered."""

    kind: str
    status_code: int
    code: str
    message: str


_UNREACHABLE = Failure("unreachable", 503, "database_unavailable", "the database is not reachable")
_TIMEOUT = Failure("timeout", 503, "database_unavailable", "the database did not answer in time")
_LOCKED = Failure(
    "locked", 503, "database_unavailable", "the database is locked by another writer past the busy timeout"
)
_READ_ONLY = Failure(
    "read_only", 503, "database_unavailable", "the database is read-only: nothing can be stored right now"
)
_FULL = Failure("full", 507, "database_full", "the database's disk is full: nothing more can be stored")
_IO = Failure("io", 503, "database_unavailable", "the database reported an I/O error")
_OVERLOADED = Failure(
    "overloaded", 503, "database_unavailable", "the database refuses new work (too many connections or no memory)"
)

# PostgreSQL SQLSTATEs that mean "not now" rather than "wrong" (class 08 is every connection exception).
_SQLSTATES = {
    "57P01": _UNREACHABLE,  # admin_shutdown: the server is stopping
    "57P02": _UNREACHABLE,  # crash_shutdown
    "57P03": _UNREACHABLE,  # cannot_connect_now: starting up or in recovery
    "57014": _TIMEOUT,  # query_canceled (statement_timeout)
    "55P03": _LOCKED,  # lock_not_available (lock_timeout)
    "25006": _READ_ONLY,  # read_only_sql_transaction: a standby after a failover
    "53100": _FULL,  # disk_full
    "53200": _OVERLOADED,  # out_of_memory
    "53300": _OVERLOADED,  # too_many_connections
    "58030": _IO,  # io_error
}

# SQLite result codes by name (sqlite3 exceptions carry sqlite_errorname since Python 3.11);
# extended codes (SQLITE_BUSY_SNAPSHOT, SQLITE_READONLY_DBMOVED, SQLITE_IOERR_WRITE...) share a prefix.
_SQLITE_PREFIXES = (
    ("SQLITE_BUSY", _LOCKED),
    ("SQLITE_LOCKED", _LOCKED),
    ("SQLITE_READONLY", _READ_ONLY),
    ("SQLITE_FULL", _FULL),
    ("SQLITE_CANTOPEN", _UNREACHABLE),
    ("SQLITE_IOERR", _IO),
)


def classify(exc: BaseException) -> Failure | None:
    """The outage an exception of the database layer means, or None for a real error.

    Args:
        exc: anything a route or the database layer raised.

    Returns:
        A :class:`Failure` (kind, status, error code, a sentence for the client) for connection
        failures, timeouts, locks past the busy timeout, read-only and full databases; None for
        everything else (a missing table, a constraint, a bug), which stays a 500 with a traceback.

    >>> classify(ValueError("x")) is None
    True
    """
    if isinstance(exc, PoolTimeoutError):
        return _TIMEOUT  # every pooled connection busy, or connecting hangs: the same answer
    if not isinstance(exc, DBAPIError):
        return None
    orig = exc.orig
    if isinstance(orig, sqlite3.Error):
        name = getattr(orig, "sqlite_errorname", "") or ""
        for prefix, failure in _SQLITE_PREFIXES:
            if name.startswith(prefix):
                return failure
        return None
    sqlstate = getattr(orig, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        return _UNREACHABLE if sqlstate.startswith("08") else _SQLSTATES.get(sqlstate)
    if exc.connection_invalidated:
        return _UNREACHABLE
    if isinstance(exc, (OperationalError, InterfaceError)):
        # psycopg's client-side failures carry no SQLSTATE: a refused or timed-out connect, a
        # connection the server closed. Those are the outage itself.
        return _TIMEOUT if "timeout" in str(orig).lower() else _UNREACHABLE
    return None


def describe(exc: BaseException) -> str:
    """A one-line cause for the log: the driver's class and first line, never SQL or parameters."""
    orig = getattr(exc, "orig", None) or exc
    first = (str(orig).strip().splitlines() or [""])[0]
    text = f"{type(orig).__name__}: {first}" if first else type(orig).__name__
    return text[:240]


@dataclass
class _Down:
    since: float
    since_utc: datetime
    cause: str
    refused: int = 0
    refused_since_line: int = 0
    remembered: int = 0
    line_at: float = 0.0
    last_failure: float = 0.0


# Kinds that any answer from the database disproves; the others (a lock, read-only, full) are about
# writes, and reads go on working through them: only a successful write says they are over.
_CONNECTION_KINDS = frozenset({"unreachable", "timeout", "overloaded", "io"})


class OutageMonitor:
    """Counts refused requests per kind of failure and writes the few log lines an operator needs.

    Thread-safe (routes run in the thread pool). ``failed`` is called by the error handler for each
    request refused for an outage; ``succeeded`` after each request the database answered, and costs
    one attribute read while nothing is down.

    Args:
        log_interval_seconds: while a kind of failure lasts, one line per this many seconds.
        settle_seconds: a success ends the outage only this long after its last failure.
        clock: monotonic seconds (a seam for tests).
    """

    def __init__(
        self,
        *,
        log_interval_seconds: float = LOG_INTERVAL_SECONDS,
        settle_seconds: float = SETTLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log_interval_seconds = log_interval_seconds
        self.settle_seconds = settle_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._down: dict[str, _Down] = {}
        self.down = False

    def failed(self, failure: Failure, exc: BaseException, *, refused: bool = True) -> None:
        """Count one request that met ``failure``; log when it starts and once per interval.

        Args:
            failure: what :func:`classify` said.
            exc: the exception (its class and first line go into the first log line).
            refused: False for a request answered all the same (from memory), counted apart.
        """
        now = self._clock()
        with self._lock:
            state = self._down.get(failure.kind)
            first = state is None
            if state is None:
                state = _Down(since=now, since_utc=datetime.now(timezone.utc), cause=describe(exc), line_at=now)
                self._down[failure.kind] = state
                self.down = True
            state.last_failure = now
            if refused:
                state.refused += 1
                state.refused_since_line += 1
            else:
                state.remembered += 1
            if first:
                log.warning(
                    "database unavailable (%s: %s): answering %d until it is back",
                    failure.kind,
                    state.cause,
                    failure.status_code,
                )
                state.refused_since_line = 0
                return
            if now - state.line_at < self.log_interval_seconds:
                return
            log.warning(
                "database still unavailable (%s) since %s UTC (%.0f s): %d requests refused in the last "
                "%.0f s, %d in all, %d answered from memory",
                failure.kind,
                state.since_utc.strftime("%H:%M:%S"),
                now - state.since,
                state.refused_since_line,
                now - state.line_at,
                state.refused,
                state.remembered,
            )
            state.line_at = now
            state.refused_since_line = 0

    def succeeded(self, *, wrote: bool) -> None:
        """The database answered a request (``wrote``: it committed a write); log once if it was down
        and has not failed for ``settle_seconds``."""
        if not self.down:
            return
        now = self._clock()
        with self._lock:
            over = [
                kind
                for kind, state in self._down.items()
                if (wrote or kind in _CONNECTION_KINDS) and now - state.last_failure >= self.settle_seconds
            ]
            if not over:
                return
            ended = [(kind, self._down.pop(kind)) for kind in over]
            self.down = bool(self._down)
        seconds = max(now - state.since for _, state in ended)
        refused = sum(state.refused for _, state in ended)
        remembered = sum(state.remembered for _, state in ended)
        kinds = ", ".join(f"{kind}: {state.refused}" for kind, state in ended)
        log.warning(
            "database back after %.1f s: %d requests refused while it was down (%s), %d answered from memory",
            seconds,
            refused,
            kinds,
            remembered,
        )

    def since(self) -> datetime | None:
        """When the oldest failure still going on began (UTC), or None while nothing is down."""
        with self._lock:
            return min((state.since_utc for state in self._down.values()), default=None)

    def kinds(self) -> list[str]:
        """The kinds of failure going on now."""
        with self._lock:
            return sorted(self._down)


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class RememberedLookups(Generic[K, V]):
    """The newest value read per key, for ``max_age_seconds``, at most ``max_entries`` keys (LRU).

    /suggest keeps each (fingerprint, device) lookup here after reading it; during an outage it asks
    :meth:`recall` instead of failing. A delete in this process clears it: a deleted profile must not
    answer from memory. Uploads do not (under a fleet's steady uploads nothing would be remembered
    when the database goes): an answer from memory says that profiles stored since are not in it.
    """

    max_age_seconds: float
    max_entries: int = 10_000
    clock: Callable[[], float] = time.monotonic
    _items: OrderedDict[K, tuple[float, V]] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def remember(self, key: K, value: V) -> None:
        """Keep ``value`` as read now (no-op when the age bound is 0)."""
        if self.max_age_seconds <= 0:
            return
        with self._lock:
            self._items[key] = (self._clock_now(), value)
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def recall(self, key: K) -> tuple[V, float] | None:
        """The remembered value and its age in seconds, or None when absent or too old."""
        with self._lock:
            entry = self._items.get(key)
        if entry is None:
            return None
        age = self._clock_now() - entry[0]
        if age > self.max_age_seconds:
            return None
        return entry[1], age

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._items.clear()

    def _clock_now(self) -> float:
        return self.clock()
