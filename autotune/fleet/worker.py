"""What runs on the fleet's workers: one probe per Ray task, and the board the tasks report to.

The worker loads the task from its spec, as ``autotune probe`` does (a ProbeTask is usually full of
lambdas that cannot be pickled, so the spec travels, not the task), inside the working directory
that Ray shipped to it. Ray itself is imported only here, under Ray, to reach the board.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Board", "Outcome", "one_line", "probe_pair"]


def one_line(exc: BaseException) -> str:
    """``TypeName: first line of the message``: what the table and the summary show of an error."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class Board:
    """Which pairs have started, and how often: the driver's view of "running" (a Ray actor).

    A pair that starts twice had its first worker die under it and was retried by Ray.
    """

    def __init__(self) -> None:
        self._attempts: dict[int, int] = {}

    def started(self, index: int) -> int:
        """Record a start of pair ``index``; returns its attempt number (1 for the first)."""
        self._attempts[index] = self._attempts.get(index, 0) + 1
        return self._attempts[index]

    def attempts(self) -> dict[int, int]:
        """Pair index -> how many times it started."""
        return dict(self._attempts)


@dataclass(frozen=True)
class Outcome:
    """What one pair's Ray task returns: a profile (as JSON; a JSON array of them for a run over
    sequence lengths) or a one-line error, never both."""

    index: int
    attempt: int
    profile_json: str | None
    error: str | None
    seconds: float
    host: str


def _report_start(board: Any, index: int) -> int:
    if board is None:
        return 1
    try:
        import ray

        return int(ray.get(board.started.remote(index), timeout=60))
    except Exception:  # the board only feeds the progress table: never fail a probe over it
        return 1


def probe_pair(index: int, spec: str, config: Any, board: Any = None) -> Outcome:
    """Probe the task at ``spec`` with ``config`` (a ProbeConfig); the body of a pair's Ray task.

    A probe that raises becomes an Outcome with its one-line error (a bad task is an answer, not a
    reason to retry); a worker that dies is Ray's to retry.
    """
    started = time.perf_counter()
    attempt = _report_start(board, index)
    try:
        from autotune.orchestrate.probe import probe
        from autotune.tasks.load import load_task

        task = load_task(spec)
        if config.seq_lens:  # one run over the lengths: a JSON array of their profiles
            from autotune.orchestrate.lengths import probe_lengths

            run = probe_lengths(
                task, config, config.seq_lens, max_seq_len=config.max_seq_len, target_tokens=config.target_tokens
            )
            text = "[" + ",".join(profile.model_dump_json() for profile in run.profiles) + "]"
        else:
            text = probe(task, config).model_dump_json()
    except Exception as exc:
        return Outcome(index, attempt, None, one_line(exc), time.perf_counter() - started, socket.gethostname())
    return Outcome(index, attempt, text, None, time.perf_counter() - started, socket.gethostname())
