"""The database gate: a request's session lives in one thread call, a bounded number at once, and a
full or slow queue is answered busy at once (``autotune_server.gate``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import pytest
from pydantic import ValidationError
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from autotune_server import Settings
from autotune_server.db import make_engine, make_sessionmaker
from autotune_server.errors import ServerBusy
from autotune_server.gate import BUSY_RETRY_AFTER_SECONDS, DatabaseGate


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    """A SQLite engine with a pool of exactly one connection and no overflow."""
    made = make_engine(f"sqlite:///{tmp_path / 'gate.db'}", pool_size=1, max_overflow=0)
    yield made
    made.dispose()


def _select_one(session: Session) -> int:
    return int(session.execute(text("SELECT 1")).scalar_one())


def test_a_crowd_on_one_connection_never_waits_for_the_pool(engine: Engine) -> None:
    # One slot for one connection: 100 concurrent requests queue for the slot, none ever waits for
    # the pool (whose timeout would raise), and each session is closed before its result is used.
    gate = DatabaseGate(make_sessionmaker(engine), slots=1, queue_limit=1000, queue_seconds=30)
    results: list[int] = []

    def work(session: Session) -> int:
        value = _select_one(session)
        time.sleep(0.001)
        return value

    async def crowd() -> None:
        async def one() -> None:
            results.append(await gate.run(work))
            assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]  # released before we resume

        async with anyio.create_task_group() as group:
            for _ in range(100):
                group.start_soon(one)

    anyio.run(crowd)
    assert results == [1] * 100
    assert gate.shed == 0 and gate.busy == 0 and gate.waiting == 0


def _with_the_slot_held(gate: DatabaseGate, body: Callable[[threading.Event], Awaitable[None]]) -> None:
    """Run ``body(release)`` while one request holds the only slot, until ``release`` is set (at the
    latest when ``body`` returns)."""
    release = threading.Event()

    def hold(session: Session) -> int:
        release.wait(10)
        return _select_one(session)

    async def main() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(gate.run, hold)
            while gate.busy == 0:
                await anyio.sleep(0.001)
            try:
                await body(release)
            finally:
                release.set()

    anyio.run(main)


def test_a_full_queue_answers_busy_at_once_with_retry_after(engine: Engine) -> None:
    gate = DatabaseGate(make_sessionmaker(engine), slots=1, queue_limit=2, queue_seconds=30)
    answers: list[int] = []

    async def body(release: threading.Event) -> None:
        async with anyio.create_task_group() as waiters:
            for _ in range(2):
                waiters.start_soon(_append, answers, gate)
            while gate.waiting < 2:
                await anyio.sleep(0.001)
            started = time.monotonic()
            with pytest.raises(ServerBusy) as info:
                await gate.run(_select_one)
            assert time.monotonic() - started < 1.0  # refused on arrival, not after a wait
            assert info.value.status_code == 503 and info.value.code == "server_busy"
            assert info.value.headers == {"Retry-After": str(BUSY_RETRY_AFTER_SECONDS)}
            assert "busy" in info.value.message and "2 requests waiting" in info.value.message
            release.set()

    _with_the_slot_held(gate, body)
    assert answers == [1, 1]  # the two that were queued got through once the slot came free
    assert gate.shed == 1


async def _append(answers: list[int], gate: DatabaseGate, shed: bool = True) -> None:
    answers.append(await gate.run(_select_one, shed=shed))


def test_a_wait_past_queue_seconds_is_busy_and_leaves_no_slot_taken(engine: Engine) -> None:
    gate = DatabaseGate(make_sessionmaker(engine), slots=1, queue_limit=100, queue_seconds=0.2)

    async def body(release: threading.Event) -> None:
        started = time.monotonic()
        with pytest.raises(ServerBusy):
            await gate.run(_select_one)
        assert 0.2 <= time.monotonic() - started < 2.0
        assert gate.waiting == 0 and gate.busy == 1  # only the holder's slot

    _with_the_slot_held(gate, body)
    assert anyio.run(gate.run, _select_one) == 1  # the cancelled wait took no token with it
    assert gate.busy == 0


def test_an_expected_wait_over_the_bound_is_busy_on_arrival(engine: Engine) -> None:
    gate = DatabaseGate(make_sessionmaker(engine), slots=1, queue_limit=100, queue_seconds=5)

    async def body(release: threading.Event) -> None:
        async with anyio.create_task_group() as waiters:
            waiters.start_soon(_append, [], gate)
            while gate.waiting < 1:
                await anyio.sleep(0.001)
            gate.hold_seconds = 10.0  # as if recent requests held their slot 10 s each
            assert gate.expected_wait_seconds() == pytest.approx(10.0)
            started = time.monotonic()
            with pytest.raises(ServerBusy) as info:
                await gate.run(_select_one)
            assert time.monotonic() - started < 1.0
            assert info.value.details == {"waiting": 1, "slots": 1, "expected_wait_seconds": 10.0}
            release.set()

    _with_the_slot_held(gate, body)


def test_metrics_never_shed(engine: Engine) -> None:
    gate = DatabaseGate(make_sessionmaker(engine), slots=1, queue_limit=0, queue_seconds=0.05)

    async def body(release: threading.Event) -> None:
        with pytest.raises(ServerBusy):
            await gate.run(_select_one)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(_append, seen, gate, False)
                while gate.waiting < 1:
                    await anyio.sleep(0.001)
                await anyio.sleep(0.1)  # twice queue_seconds: still waiting, not refused
                assert gate.waiting == 1 and not seen
                release.set()

    seen: list[int] = []
    _with_the_slot_held(gate, body)
    assert seen == [1]


def test_settings_refuse_more_slots_than_connections() -> None:
    assert Settings(db_pool_size=4, db_max_overflow=2).database_slots == 6
    assert Settings(db_pool_size=4, db_max_overflow=2, db_slots=3).database_slots == 3
    with pytest.raises(ValidationError, match="db_slots .7. must be at most db_pool_size . db_max_overflow .6."):
        Settings(db_pool_size=4, db_max_overflow=2, db_slots=7)
