"""The only way a request reaches the database: one call in one thread, a bounded number at once.

    found = await request.app.state.gate.run(lambda session: repository.get_profile(session, 1).id)

The deadlock this prevents (issue 31): sync routes ran in the shared thread pool (40 threads) and
held their pooled connection (10 + 20 overflow) from the first query until FastAPI had validated the
response model, which for a sync route is one more hop through that same thread pool. At 80
concurrent requests the 40 threads were waiting for a connection while the 30 connections were held
by requests waiting for a thread; nothing moved until the pool's 30 s timeout answered 503
``database_unavailable`` about a healthy database. Sizing the pool to the threads would not have
been enough: a request waiting for its serialization hop holds a connection and no thread.

Here a request's whole use of the database is :meth:`DatabaseGate.run`: a session is opened in a
thread, ``work(session)`` runs (queries, and the conversion of rows to wire models while they are
loaded), the session is closed (its connection back in the pool) and only then does the thread
return; serialization comes after. So a connection is only ever held by a thread that needs nothing
but the database to finish. The gate's threads have their own limiter with ``slots`` tokens, at most
the pool's connections (``Settings`` checks it), so no thread ever waits for a connection and a pool
timeout can only mean the database itself is slow or gone, which is what ``database_unavailable`` says.

Requests beyond the slots wait on the event loop (a coroutine each, no thread, no connection). A
request is answered 503 ``server_busy`` with ``Retry-After`` when ``queue_limit`` requests already
wait, when the wait it would face (those waiting x the recent time a request holds a slot / slots,
Little's law) is over ``queue_seconds``, or when it has waited ``queue_seconds`` all the same. So the
load is shed at once, while the client has time to retry, rather than after it waited in vain; and
nothing was processed, so a retry of any method is safe (the client retries it within its timeout).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread
from sqlalchemy.orm import Session, sessionmaker

from autotune_server.db import COMMITTED
from autotune_server.errors import DomainError, ServerBusy
from autotune_server.outage import OutageMonitor

__all__ = ["BUSY_RETRY_AFTER_SECONDS", "HOLD_SMOOTHING", "DatabaseGate"]

T = TypeVar("T")

BUSY_RETRY_AFTER_SECONDS = 1
"""What a busy 503 asks a client to wait: a saturated server drains its queue in about a second or
two (the client lengthens it by a random fraction, so that the shed crowd does not return at once)."""

HOLD_SMOOTHING = 0.05
"""Weight of the newest request in the running mean of how long a request holds a slot (about the
last 20 requests count)."""


class DatabaseGate:
    """At most ``slots`` requests use the database at once, each in a thread; the rest queue, boundedly.

    Args:
        sessions: makes the request's session (connections are taken lazily, at the first query).
        slots: requests that may hold a session at once; at most the pool's connections.
        queue_limit: requests that may wait for a slot; past it, a new one is answered busy at once.
        queue_seconds: how long one request may wait for a slot before it is answered busy.
        outage: told when the database answered (how the log learns an outage is over).
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        slots: int,
        queue_limit: int,
        queue_seconds: float,
        outage: OutageMonitor | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self._sessions = sessions
        self.slots = slots
        self.queue_limit = queue_limit
        self.queue_seconds = queue_seconds
        self._outage = outage
        # Two limiters with the same size: waiting for ``_admission`` is bounded in time, and a task
        # holding one of its tokens then always finds a free ``_threads`` token at once.
        self._admission = anyio.CapacityLimiter(slots)
        self._threads = anyio.CapacityLimiter(slots)
        self.shed = 0
        self.hold_seconds = 0.0

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return self._admission.statistics().tasks_waiting

    @property
    def busy(self) -> int:
        """Slots in use now."""
        return int(self._admission.borrowed_tokens)

    def expected_wait_seconds(self) -> float:
        """How long a request arriving now would wait for a slot, from the recent holding times."""
        return self.waiting * self.hold_seconds / self.slots

    async def run(self, work: Callable[[Session], T], *, shed: bool = True) -> T:
        """``work(session)`` in a thread of the gate, the session closed before this returns.

        Args:
            work: the request's database work; it returns plain values or wire models, never rows
                that would need the closed session. Raising rolls the session back.
            shed: False waits for a slot however long the queue (for /metrics, which must not fail
                on load); True answers busy past the queue's bounds.

        Returns:
            What ``work`` returned.

        Raises:
            ServerBusy: no slot is free and the queue is full or its expected wait is over
                ``queue_seconds``, or the wait for a slot passed ``queue_seconds`` (503).
            Whatever ``work`` raises (database errors become 503/507/500 in the error handlers).
        """
        if shed and self._admission.available_tokens < 1 and self._queue_full():
            self._shed()
        if shed:
            with anyio.move_on_after(self.queue_seconds) as waited:
                await self._admission.acquire()
            if waited.cancelled_caught:  # no token was taken: a cancelled acquire leaves none
                self._shed()
        else:
            await self._admission.acquire()
        started = time.monotonic()
        try:
            return await anyio.to_thread.run_sync(self._in_session, work, limiter=self._threads)
        finally:
            self._admission.release()
            # On the event loop, one request at a time: no lock needed.
            self.hold_seconds += HOLD_SMOOTHING * (time.monotonic() - started - self.hold_seconds)

    def _queue_full(self) -> bool:
        return self.waiting >= self.queue_limit or self.expected_wait_seconds() > self.queue_seconds

    def _shed(self) -> None:
        self.shed += 1
        expected = self.expected_wait_seconds()
        raise ServerBusy(
            f"the server is busy ({self.waiting} requests waiting for its {self.slots} database slots, about "
            f"{expected:.1f} s of queue): nothing was done; try again in {BUSY_RETRY_AFTER_SECONDS} s",
            details={"waiting": self.waiting, "slots": self.slots, "expected_wait_seconds": round(expected, 3)},
            headers={"Retry-After": str(BUSY_RETRY_AFTER_SECONDS)},
        )

    def _in_session(self, work: Callable[[Session], T]) -> T:
        with self._sessions() as session:
            try:
                result = work(session)
            except DomainError:
                # A 404 or 422 found by asking the database is an answer from it all the same.
                self._answered(session)
                raise
            self._answered(session)
            return result

    def _answered(self, session: Session) -> None:
        if self._outage is not None:
            self._outage.succeeded(wrote=bool(session.info.get(COMMITTED)))
