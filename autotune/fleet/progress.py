"""The fleet's progress: one row per pair (pending, running, done, failed), live or as events.

On a terminal the table is redrawn in place; into a file or a pipe (CI logs, tests) each change of
state is one line instead, so that the log reads in order. The same table, finished, is the summary.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from typing import Any, TextIO

from autotune.fleet.pairs import Pair
from autotune.fleet.sink import Stored

__all__ = ["STATES", "PairState", "Progress"]

STATES = ("pending", "running", "done", "failed")


@dataclass
class PairState:
    """Where one pair stands, and what it gave."""

    pair: Pair
    state: str = "pending"
    attempt: int = 0
    error: str | None = None
    max_micro_batch: int | None = None
    plan: str | None = None
    stored: Stored | None = None
    seconds: float | None = None
    host: str | None = None
    # What a done pair's result should say besides where it went (an estimate not emulated).
    note: str | None = None

    @property
    def state_text(self) -> str:
        retried = f" (attempt {self.attempt})" if self.attempt > 1 else ""
        return self.state + retried

    @property
    def result(self) -> str:
        """The last column: the error, or where the profile went."""
        if self.state == "failed":
            return self.error or "failed"
        note = f"; {self.note}" if self.note else ""
        if self.stored is None:
            return self.note or ""
        if self.stored.profile_id is not None:
            return f"profile {self.stored.profile_id}{note}"
        if self.stored.upload_error is not None:
            return f"NOT uploaded ({self.stored.upload_error}); kept in {self.stored.path}{note}"
        return f"written to {self.stored.path}{note}"

    @property
    def ok(self) -> bool:
        """Done, and stored wherever it was asked to go."""
        return self.state == "done" and (self.stored is None or self.stored.upload_error is None)

    def as_json(self) -> dict[str, Any]:
        stored = self.stored
        return {
            "index": self.pair.index,
            "task": self.pair.spec,
            "on": self.pair.on,
            "budget_bytes": self.pair.budget_bytes,
            "state": self.state,
            "attempts": self.attempt,
            "error": self.error,
            "max_micro_batch": self.max_micro_batch,
            "plan": self.plan,
            "profile_id": stored.profile_id if stored else None,
            "path": str(stored.path) if stored and stored.path else None,
            "upload_error": stored.upload_error if stored else None,
            "seconds": self.seconds,
            "host": self.host,
            "note": self.note,
        }


class Progress:
    """The rows of a fleet run and their rendering.

    Args:
        pairs: the run's pairs, in order.
        stream: where progress goes (stderr).
        live: redraw a table in place (default: when ``stream`` is a terminal); else one line per change.
    """

    def __init__(self, pairs: list[Pair], stream: TextIO, *, live: bool | None = None) -> None:
        self.rows = {pair.index: PairState(pair) for pair in pairs}
        self.stream = stream
        self.live = stream.isatty() if live is None else live
        self.started_at = time.monotonic()
        self._drawn_lines = 0

    def started(self, index: int, attempt: int) -> None:
        """The pair's task started (again, when ``attempt`` > 1: its earlier worker died)."""
        row = self.rows[index]
        if row.state in ("done", "failed") or attempt <= row.attempt:
            return
        row.state, row.attempt = "running", attempt
        self._event(row)

    def done(self, index: int, *, attempt: int, max_micro_batch: int, plan: str | None, stored: Stored,
             seconds: float, host: str, note: str | None = None) -> None:  # fmt: skip
        row = self.rows[index]
        row.state, row.attempt, row.max_micro_batch, row.plan = "done", max(attempt, row.attempt), max_micro_batch, plan
        row.stored, row.seconds, row.host, row.note = stored, seconds, host, note
        self._event(row)

    def failed(self, index: int, error: str, *, attempt: int | None = None, seconds: float | None = None,
               host: str | None = None) -> None:  # fmt: skip
        row = self.rows[index]
        row.state, row.error, row.seconds, row.host = "failed", error, seconds, host
        row.attempt = max(attempt or 0, row.attempt)
        self._event(row)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATES, 0)
        for row in self.rows.values():
            counts[row.state] += 1
        return counts

    def headline(self) -> str:
        counts = self.counts()
        elapsed = time.monotonic() - self.started_at
        states = ", ".join(f"{counts[state]} {state}" for state in STATES)
        pairs = f"{len(self.rows)} pair" + ("" if len(self.rows) == 1 else "s")
        return f"fleet: {pairs}: {states} ({elapsed:.1f}s)"

    def table(self) -> str:
        """The rows as an aligned table (the live view and the summary)."""
        header = ["#", "task", "on", "budget", "state", "m_max", "plan", "seconds", "result"]
        lines = [header]
        for row in self.rows.values():
            lines.append(
                [
                    str(row.pair.index),
                    row.pair.spec,
                    row.pair.on,
                    row.pair.budget_label,
                    row.state_text,
                    "" if row.max_micro_batch is None else str(row.max_micro_batch),
                    row.plan or "",
                    "" if row.seconds is None else f"{row.seconds:.1f}",
                    row.result,
                ]
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
        return "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(line[:-1], widths, strict=True)) + "  " + line[-1]
            for line in lines
        ).rstrip()

    def refresh(self) -> None:
        """Redraw the live table in place (a no-op when not live). Lines are cut to the terminal's
        width, so that none wraps and the cursor goes back up exactly over what was drawn."""
        if not self.live:
            return
        width = shutil.get_terminal_size().columns
        lines = [line[:width] for line in f"{self.headline()}\n{self.table()}".splitlines()]
        up = f"\x1b[{self._drawn_lines}F\x1b[J" if self._drawn_lines else ""
        self.stream.write(up + "\n".join(lines) + "\n")
        self.stream.flush()
        self._drawn_lines = len(lines)

    def close(self) -> None:
        """Erase the live table, so that the summary printed next takes its place on the terminal."""
        if self.live and self._drawn_lines:
            self.stream.write(f"\x1b[{self._drawn_lines}F\x1b[J")
            self.stream.flush()
            self._drawn_lines = 0

    def _event(self, row: PairState) -> None:
        if self.live:
            return
        detail = f" ({row.result})" if row.state in ("done", "failed") and row.result else ""
        attempt = f" (attempt {row.attempt})" if row.state == "running" and row.attempt > 1 else ""
        counts = self.counts()
        finished = f"{counts['done'] + counts['failed']}/{len(self.rows)}"
        print(
            f"fleet: [{finished}] #{row.pair.index} {row.pair.label}: {row.state}{attempt}{detail}",
            file=self.stream,
            flush=True,
        )

    def summary(self) -> str:
        """The finished table, under a headline with the counts."""
        return f"{self.headline()}\n{self.table()}"
