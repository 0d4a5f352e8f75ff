"""What runs on the fleet's workers: one probe (or card estimate) per Ray task, and the board the tasks
report to.

The worker loads the task from its spec, as ``autotune probe`` does (a ProbeTask is usually full of
lambdas that cannot be pickled, so the spec travels, not the task), inside the working directory
that Ray shipped to it. Ray itself is imported only here, under Ray, to reach the board.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.fleet.pairs import EstimateOptions

__all__ = ["Board", "Outcome", "estimate_pair", "one_line", "probe_pair"]


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


def _report_start(board: Any, index: int) -> Callable[[], int]:
    """Tell the board that pair ``index`` started, and return how to read its attempt number later.

    The call is sent now, so the board knows even if this worker is killed, but its answer is read
    only after the work: a task blocked in ``ray.get`` gives its CPU back to Ray, which would start a
    pending pair beside it (a node running more probes than it has CPUs).
    """
    if board is None:
        return lambda: 1
    try:
        import ray

        reply = board.started.remote(index)
    except Exception:  # the board only feeds the progress table: never fail a probe over it
        return lambda: 1

    def attempt() -> int:
        try:
            return int(ray.get(reply, timeout=60))
        except Exception:
            return 1

    return attempt


def _outcome(index: int, board: Any, work: Callable[[], str]) -> Outcome:
    """Run ``work`` (it returns the profile JSON) as pair ``index``'s attempt, timed.

    Work that raises becomes an Outcome with its one-line error (a bad task is an answer, not a reason
    to retry); a worker that dies is Ray's to retry.
    """
    started = time.perf_counter()
    attempt = _report_start(board, index)
    try:
        text = work()
    except Exception as exc:
        return Outcome(index, attempt(), None, one_line(exc), time.perf_counter() - started, socket.gethostname())
    return Outcome(index, attempt(), text, None, time.perf_counter() - started, socket.gethostname())


def _json_array(profiles: list[Any]) -> str:
    return "[" + ",".join(profile.model_dump_json() for profile in profiles) + "]"


def probe_pair(index: int, spec: str, config: Any, board: Any = None) -> Outcome:
    """Probe the task at ``spec`` with ``config`` (a ProbeConfig); the body of a probe pair's Ray task."""

    def work() -> str:
        from autotune.orchestrate.probe import probe
        from autotune.tasks.load import load_task

        task = load_task(spec)
        if config.seq_lens:  # one run over the lengths: a JSON array of their profiles
            from autotune.orchestrate.lengths import probe_lengths

            run = probe_lengths(
                task, config, config.seq_lens, max_seq_len=config.max_seq_len, target_tokens=config.target_tokens
            )
            return _json_array(run.profiles)
        return str(probe(task, config).model_dump_json())

    return _outcome(index, board, work)


def estimate_pair(
    index: int,
    spec: str,
    config: Any,
    options: EstimateOptions,
    board: Any = None,
    cuda_python: str | None = None,
) -> Outcome:
    """Estimate the task at ``spec`` for the card of ``config`` (an EstimateConfig with ``gpu`` set) as
    ``autotune estimate TASK --gpu NAME`` does; the body of an estimate pair's Ray task (a JSON array of
    profiles, one per length, or one profile).

    ``cuda_python``: the driver's Python with a CUDA build of torch, taken where this node has no
    ``AUTOTUNE_CUDA_PYTHON`` of its own and has that path (one image on every node, or one machine):
    the checkout this worker runs in is Ray's copy of the working directory, without ``.venv-cuda``.
    """

    def work() -> str:
        from autotune.tasks.load import load_task

        _use_cuda_python(cuda_python)
        task = load_task(spec)
        routing, factor = _moe_routing(task, options.moe_load_factor)
        with routing:
            profiles = _estimate(task, config, options.seq_lens)
        if factor is not None:  # as autotune estimate writes it: the routing the fake trials assumed
            profiles = [profile.model_copy(update={"moe_load_factor": factor}) for profile in profiles]
        return _json_array(profiles) if options.seq_lens else str(profiles[0].model_dump_json())

    return _outcome(index, board, work)


def _use_cuda_python(driver_python: str | None) -> None:
    from autotune.emulation.runner import CUDA_PYTHON_VARIABLE

    # A fresh worker process per pair (max_calls=1): setting the variable here touches no other pair.
    if driver_python and not os.environ.get(CUDA_PYTHON_VARIABLE) and Path(driver_python).is_file():
        os.environ[CUDA_PYTHON_VARIABLE] = driver_python


def _moe_routing(task: Any, asked: float | None) -> tuple[Any, float | None]:
    """The routing of autotune estimate (autotune/orchestrate/routing.py): by ``asked``, else balanced, for a
    mixture of experts; none for a dense model."""
    from autotune.orchestrate.routing import moe_routing_for

    return moe_routing_for(task, asked)


def _estimate(task: Any, config: Any, seq_lens: tuple[int, ...]) -> list[Any]:
    """The card estimate, at each length in one emulated child where there are lengths: the paths of
    ``autotune estimate --gpu`` (autotune/cli/estimate.py), falling back as it does to CPU semantics,
    saying why, where the card cannot be emulated here."""
    from autotune.core.errors import TaskError
    from autotune.orchestrate.estimate import estimate

    if not seq_lens:
        if task.sequence_aware and task.seq_len is None:
            raise TaskError(
                f"task {task.name!r} is sequence-aware (its batch takes seq_len=): give the lengths with --seq-len"
            )
        return [estimate(task, config)]
    from autotune.orchestrate.estimate import estimate_for_card_at_lengths
    from autotune.orchestrate.lengths import check_lengths

    return estimate_for_card_at_lengths(task, config, check_lengths(task, seq_lens))
