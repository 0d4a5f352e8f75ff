"""GET /suggest: the plan for a job from the newest matching profile, measured or predicted.

Measured: a profile of this fingerprint on this device model; m_max is what the probe measured
(lowered to the largest measured size within a smaller requested budget, and below the smallest
micro-batch at which a job reported an OOM). Predicted: only other device models have profiles and a
budget is given; m_max comes from the stored affine fit at budget x (1 - headroom) and the answer
says plainly that it is a prediction.

The work is split for speed, since /suggest is what hundreds of jobs call at the start of a sweep:
``repository.lookup`` reads the database (two small indexed queries, no ORM objects) and its result is cached
per (fingerprint, device) for a second; ``compute`` is pure arithmetic on that result.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection

from autotune.plan import micro_batch_for_limit, plan
from autotune.schemas import Plan, Suggestion
from autotune_server.errors import BudgetTooSmall, InvalidPlanRequest, NoProfileForSuggestion
from autotune_server.repository import Candidate, Lookup, lookup

__all__ = ["LookupCache", "compute", "suggest"]


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
        self._answers: dict[tuple[object, ...], tuple[float, bytes]] = {}
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

    def get_answer(self, key: tuple[object, ...]) -> bytes | None:
        """The cached JSON of a suggestion for exactly these query parameters, if fresh."""
        entry = self._answers.get(key)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put_answer(self, key: tuple[object, ...], body: bytes) -> None:
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


def _plan(m_max: int, target_batch: int, world_size: int) -> Plan:
    try:
        return plan(m_max, target_batch, world_size)
    except ValueError as exc:
        field = "target_batch" if "target_batch" in str(exc) else "world_size"
        # The first line only: a pydantic error's later lines echo internals, not advice.
        raise InvalidPlanRequest(str(exc).splitlines()[0], field=field) from None


def _measured(
    c: Candidate, *, target_batch: int, world_size: int, budget_bytes: int | None, headroom: float | None
) -> Suggestion:
    warnings: list[str] = []
    m_max = c.max_micro_batch
    used_budget = c.budget_bytes
    if budget_bytes is not None:
        used_budget = budget_bytes
        limit = budget_bytes * (1.0 - (headroom if headroom is not None else c.headroom))
        measured_limit = c.budget_bytes * (1.0 - c.headroom)
        if limit < measured_limit:
            within = [
                m
                for m, peak, fits, oom in c.trials
                if fits and not oom and peak <= limit and m <= c.max_micro_batch
            ]
            if not within:
                raise BudgetTooSmall(
                    f"no measured micro-batch of profile {c.id} peaks within {int(limit)} bytes "
                    f"(budget_bytes {budget_bytes} less headroom); probe with this budget",
                    field="budget_bytes",
                )
            m_max = max(within)
            warnings.append(
                f"budget {budget_bytes} is below the {c.budget_bytes} bytes the profile was measured "
                f"with: micro-batch capped at {m_max}, the largest measured size within it"
            )
        elif limit > measured_limit:
            warnings.append(
                f"profile was measured with a budget of {c.budget_bytes} bytes; a larger budget may "
                "fit a larger micro-batch: probe again with the larger budget to use it"
            )
    if c.oom_at is not None and c.oom_at <= m_max:
        if c.oom_at <= 1:
            raise BudgetTooSmall(
                f"a job reported an out-of-memory error at micro-batch {c.oom_at} with profile {c.id}",
                field="fingerprint",
            )
        m_max = c.oom_at - 1
        warnings.append(f"a job reported an out-of-memory error at micro-batch {c.oom_at}: capped at {m_max}")
    chosen = _plan(m_max, target_batch, world_size)
    if chosen.note:
        warnings.append(chosen.note)
    peak = next((p for m, p, fits, oom in c.trials if m == chosen.micro_batch and fits and not oom), None)
    return Suggestion(
        micro_batch=chosen.micro_batch,
        accumulation_steps=chosen.accumulation_steps,
        world_size=chosen.world_size,
        effective_batch=chosen.effective_batch,
        target_batch=chosen.target_batch,
        exact=chosen.exact,
        source="measured",
        profile_id=c.id,
        fingerprint=c.fingerprint,
        device_name=c.device_name,
        max_micro_batch=m_max,
        peak_bytes=peak,
        budget_bytes=used_budget,
        warnings=warnings,
    )


def _predicted(
    c: Candidate,
    *,
    device_name: str,
    target_batch: int,
    world_size: int,
    budget_bytes: int,
    headroom: float | None,
) -> Suggestion:
    fit = c.fit
    assert fit is not None  # the caller picks a candidate with a fit
    limit = budget_bytes * (1.0 - (headroom if headroom is not None else c.headroom))
    m_max = micro_batch_for_limit(fit, limit, c.micro_batch_cap)
    if c.multiple_of > 1:
        m_max -= m_max % c.multiple_of
    if m_max < 1:
        raise BudgetTooSmall(
            f"by the fit measured on {c.device_name} (profile {c.id}), not even one sample "
            f"fits within {int(limit)} bytes (budget_bytes {budget_bytes} less headroom)",
            field="budget_bytes",
        )
    chosen = _plan(m_max, target_batch, world_size)
    warnings = [
        f"predicted from the memory fit measured on {c.device_name} (profile {c.id}), not measured "
        f"on {device_name}: probe on {device_name} to be sure"
    ]
    if chosen.note:
        warnings.append(chosen.note)
    peak = max(0, round(fit.fixed_bytes + fit.bytes_per_sample * chosen.micro_batch))
    return Suggestion(
        micro_batch=chosen.micro_batch,
        accumulation_steps=chosen.accumulation_steps,
        world_size=chosen.world_size,
        effective_batch=chosen.effective_batch,
        target_batch=chosen.target_batch,
        exact=chosen.exact,
        source="predicted",
        profile_id=c.id,
        fingerprint=c.fingerprint,
        device_name=device_name,
        max_micro_batch=m_max,
        peak_bytes=peak,
        budget_bytes=budget_bytes,
        warnings=warnings,
    )


def compute(
    found: Lookup,
    *,
    fingerprint: str,
    device_name: str,
    target_batch: int,
    world_size: int = 1,
    budget_bytes: int | None = None,
    headroom: float | None = None,
    server_url: str | Callable[[], str] = "URL",
) -> Suggestion:
    """The plan for a job from what ``lookup`` found (pure).

    Args:
        found: the lookup for (fingerprint, device_name).
        target_batch: effective batch T; world_size: data-parallel replicas D.
        budget_bytes, headroom: the job's memory budget; needed for a prediction from another device.
        server_url: this server's URL (or a function giving it, only called for the 404), quoted in
            the how-to-probe advice of the 404.

    Raises:
        NoProfileForSuggestion: nothing to measure or predict from (404).
        InvalidPlanRequest: the plan arithmetic refused (e.g. target_batch < world_size) (422).
        BudgetTooSmall: not even one sample fits the given budget (422).
    """
    if found.measured is not None:
        return _measured(
            found.measured,
            target_batch=target_batch,
            world_size=world_size,
            budget_bytes=budget_bytes,
            headroom=headroom,
        )
    with_fit = [c for c in found.elsewhere if c.fit is not None]
    if budget_bytes is not None and with_fit:
        return _predicted(
            with_fit[0],
            device_name=device_name,
            target_batch=target_batch,
            world_size=world_size,
            budget_bytes=budget_bytes,
            headroom=headroom,
        )
    if callable(server_url):
        server_url = server_url()
    other_devices = sorted({c.device_name for c in found.elsewhere})
    if other_devices and budget_bytes is None:
        message = (
            f"no profile of fingerprint {fingerprint} on {device_name!r}; profiles exist on "
            f"{', '.join(repr(d) for d in other_devices)}: pass budget_bytes for a prediction from "
            f"their memory fit, or probe on {device_name!r}"
        )
    else:
        message = (
            f"no profile of fingerprint {fingerprint} on {device_name!r}"
            + (" and none elsewhere with a memory fit" if other_devices else "")
            + f": probe it on that device with `autotune probe TASK --server {server_url}`"
        )
    raise NoProfileForSuggestion(
        message,
        field="fingerprint",
        details={
            "looked_for": {
                "fingerprint": fingerprint,
                "device_name": device_name,
                "budget_bytes": budget_bytes,
            },
            "devices_with_profiles": other_devices,
            "how_to_probe": f"AUTOTUNE_TOKEN=... autotune probe TASK --server {server_url}",
        },
    )


def suggest(conn: Connection, **kwargs: object) -> Suggestion:
    """``compute(lookup(conn, fingerprint, device_name), **kwargs)``, uncached (for scripts and tests)."""
    found = lookup(conn, str(kwargs["fingerprint"]), str(kwargs["device_name"]))
    return compute(found, **kwargs)  # type: ignore[arg-type]
