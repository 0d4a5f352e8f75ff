"""The outage's log and memory on a clock the test moves: one line per kind of failure per interval,
one when the database is back; remembered lookups within their age; what counts as an outage."""

from __future__ import annotations

import logging
import sqlite3

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from autotune_server.outage import OutageMonitor, RememberedLookups, classify

LOGGER = "autotune_server.outage"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _refused(kind_exc: OperationalError, monitor: OutageMonitor, count: int, clock: Clock, step: float) -> None:
    failure = classify(kind_exc)
    assert failure is not None
    for _ in range(count):
        monitor.failed(failure, kind_exc)
        clock.now += step


def _sqlite_error(message: str, name: str) -> OperationalError:
    orig = sqlite3.OperationalError(message)
    orig.sqlite_errorname = name  # type: ignore[attr-defined]
    return OperationalError("INSERT ...", {}, orig)


class _PgError(Exception):
    def __init__(self, message: str, sqlstate: str | None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


REFUSED = OperationalError("SELECT 1", {}, _PgError("connection failed: Connection refused", None))


def test_one_line_when_it_starts_one_per_interval_one_when_back(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = Clock()
    monitor = OutageMonitor(log_interval_seconds=10, clock=clock)
    _refused(REFUSED, monitor, 250, clock, 0.1)  # 25 s of 10 requests a second
    clock.now += 0.9
    monitor.succeeded(wrote=False)
    monitor.succeeded(wrote=False)  # already back: no second line
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 4, lines
    assert lines[0] == (
        "database unavailable (unreachable: _PgError: connection failed: Connection refused): "
        "answering 503 until it is back"
    )
    assert lines[1].startswith("database still unavailable (unreachable) since ")
    assert "(10 s): 100 requests refused in the last 10 s, 101 in all, 0 answered from memory" in lines[1]
    assert "(20 s): 100 requests refused in the last 10 s, 201 in all" in lines[2]
    assert lines[3] == (
        "database back after 25.9 s: 250 requests refused while it was down (unreachable: 250), 0 answered from memory"
    )
    assert not any(r.exc_info for r in caplog.records)
    assert not monitor.down


def test_each_kind_of_failure_has_its_own_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = Clock()
    monitor = OutageMonitor(log_interval_seconds=10, clock=clock)
    locked = _sqlite_error("database is locked", "SQLITE_BUSY")
    _refused(locked, monitor, 3, clock, 0.1)
    _refused(_sqlite_error("database or disk is full", "SQLITE_FULL"), monitor, 2, clock, 0.1)
    assert monitor.kinds() == ["full", "locked"]
    clock.now += 1
    # A read that worked says nothing about a lock or a full disk: only a write ends them.
    monitor.succeeded(wrote=False)
    assert monitor.kinds() == ["full", "locked"]
    monitor.succeeded(wrote=True)
    assert monitor.kinds() == []
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert [line.split(" (")[0] for line in lines] == [
        "database unavailable",
        "database unavailable",
        "database back after 1.5 s: 5 requests refused while it was down",
    ]
    assert "(locked: 3, full: 2)" in lines[2]
    assert "answering 507" in lines[1]


def test_answers_from_memory_are_counted_apart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    monitor = OutageMonitor(settle_seconds=0)
    failure = classify(REFUSED)
    assert failure is not None
    monitor.failed(failure, REFUSED, refused=False)
    monitor.failed(failure, REFUSED)
    monitor.succeeded(wrote=False)
    assert caplog.records[-1].getMessage().endswith("(unreachable: 1), 1 answered from memory")


def test_a_database_that_flaps_while_it_stops_is_one_outage(caplog: pytest.LogCaptureFixture) -> None:
    # Shutting down, PostgreSQL refuses new connections while older ones still answer for a moment.
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = Clock()
    monitor = OutageMonitor(log_interval_seconds=10, settle_seconds=1, clock=clock)
    for _ in range(5):
        _refused(REFUSED, monitor, 2, clock, 0.1)
        monitor.succeeded(wrote=True)  # within a second of the last failure: not over
        clock.now += 0.1
    assert monitor.kinds() == ["unreachable"]
    clock.now += 1
    monitor.succeeded(wrote=False)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2, lines
    assert lines[1].startswith("database back after 2.5 s: 10 requests refused")


@pytest.mark.parametrize(
    ("exc", "kind", "status"),
    [
        (REFUSED, "unreachable", 503),
        (OperationalError("x", {}, _PgError("connection timeout expired", None)), "timeout", 503),
        (OperationalError("x", {}, _PgError("terminating connection", "57P01")), "unreachable", 503),
        (OperationalError("x", {}, _PgError("the database system is starting up", "57P03")), "unreachable", 503),
        (OperationalError("x", {}, _PgError("server closed the connection", "08006")), "unreachable", 503),
        (OperationalError("x", {}, _PgError("canceling statement due to statement timeout", "57014")), "timeout", 503),
        (OperationalError("x", {}, _PgError("could not extend file: No space left on device", "53100")), "full", 507),
        (OperationalError("x", {}, _PgError("sorry, too many clients already", "53300")), "overloaded", 503),
        (ProgrammingError("x", {}, _PgError("read-only transaction", "25006")), "read_only", 503),
        (_sqlite_error("database is locked", "SQLITE_BUSY"), "locked", 503),
        (_sqlite_error("attempt to write a readonly database", "SQLITE_READONLY"), "read_only", 503),
        (_sqlite_error("database or disk is full", "SQLITE_FULL"), "full", 507),
        (_sqlite_error("unable to open database file", "SQLITE_CANTOPEN"), "unreachable", 503),
        (_sqlite_error("disk I/O error", "SQLITE_IOERR_WRITE"), "io", 503),
        (PoolTimeoutError("QueuePool limit of size 10 overflow 20 reached"), "timeout", 503),
    ],
)
def test_outages_are_classified(exc: Exception, kind: str, status: int) -> None:
    failure = classify(exc)
    assert failure is not None
    assert (failure.kind, failure.status_code) == (kind, status)


@pytest.mark.parametrize(
    "exc",
    [
        _sqlite_error("no such table: profiles", "SQLITE_ERROR"),
        ProgrammingError("x", {}, _PgError('relation "profiles" does not exist', "42P01")),
        IntegrityError("x", {}, _PgError("duplicate key", "23505")),
        OperationalError("x", {}, _PgError("deadlock detected", "40P01")),
        ValueError("not a database error"),
    ],
)
def test_real_errors_are_not_outages(exc: Exception) -> None:
    assert classify(exc) is None


def test_remembered_lookups_keep_their_age_bound_and_size() -> None:
    clock = Clock()
    memory: RememberedLookups[str, int] = RememberedLookups(max_age_seconds=60, max_entries=2, clock=clock)
    memory.remember("a", 1)
    clock.now += 30
    assert memory.recall("a") == (1, 30)
    clock.now += 31
    assert memory.recall("a") is None
    memory.remember("a", 1)
    memory.remember("b", 2)
    memory.remember("c", 3)  # the oldest goes
    assert memory.recall("a") is None and memory.recall("c") == (3, 0)
    memory.clear()
    assert memory.recall("b") is None
    off: RememberedLookups[str, int] = RememberedLookups(max_age_seconds=0)
    off.remember("x", 1)
    assert off.recall("x") is None
