"""The /suggest cache: lookups per (fingerprint, device), and finished answers per query, for a TTL.

At the start of a sweep hundreds of jobs ask the same question within seconds; a cached answer costs
no thread-pool hop and no database query (``autotune_server.api.suggest``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from autotune.core.schemas import SuggestQuery
from autotune_server.candidates import Lookup

__all__ = ["LookupCache"]


class LookupCache:
    """Lookups per (fingerprint, device), and finished answers per full query, for ``ttl_seconds``.

    Cleared by any write in this process; other worker processes' uploads become visible within the
    TTL. That is the trade for the start of a sweep, when hundreds of jobs ask the same question
    within seconds, while a profile is uploaded once and then read many times.
    """

    def __init__(self, ttl_seconds: float, max_entries: int = 10_000) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_entries = max_entries
        self._lookups: dict[tuple[str, str], tuple[float, Lookup]] = {}
        self._answers: dict[SuggestQuery, tuple[float, bytes]] = {}
        # Lookups being read right now, so that concurrent misses share one query (event loop only).
        self.inflight: dict[tuple[str, str], asyncio.Future[Lookup]] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> Lookup | None:
        """The cached lookup, if fresh."""
        entry = self._lookups.get(key)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, key: tuple[str, str], value: Lookup) -> None:
        """Remember a lookup (no-op with a TTL of 0)."""
        self._store(self._lookups, key, value)

    def get_answer(self, key: SuggestQuery) -> bytes | None:
        """The cached JSON of a suggestion for exactly this query, if fresh."""
        entry = self._answers.get(key)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put_answer(self, key: SuggestQuery, body: bytes) -> None:
        """Remember a suggestion's JSON (no-op with a TTL of 0)."""
        self._store(self._answers, key, body)

    def _store(self, table: dict[Any, tuple[float, Any]], key: Any, value: Any) -> None:
        if self.ttl_seconds <= 0:
            return
        with self._lock:
            if len(table) >= self.max_entries:
                table.clear()  # crude but bounded; a sweep touches few keys
            table[key] = (time.monotonic() + self.ttl_seconds, value)

    def clear(self) -> None:
        """Forget everything (after any write in this process)."""
        with self._lock:
            self._lookups.clear()
            self._answers.clear()
