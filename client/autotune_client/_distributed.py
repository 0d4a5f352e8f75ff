"""One decision per job: under a process group, rank 0 decides the plan and every rank gets it.

A torchrun job of 8 ranks that called ``suggest`` on each would ask the store 8 times, or worse,
probe 8 times at once on devices that its own ranks share and get 8 answers that need not agree
(every rank must run the same micro-batch and the same accumulation steps, or DDP hangs). So rank 0
decides and the others receive its Suggestion by ``broadcast_object_list``:

- on a gloo group of their own (CPU objects, whatever the job's backend: no CUDA memory is used
  before the job has placed its model), created and destroyed by every rank around the call;
- the others wait at most the client's timeout plus :data:`DECISION_SLACK_SECONDS` (rank 0
  fingerprints the model first); when rank 0 has to probe locally, it first says so, and the wait
  for the probe is bounded by torch's default process-group timeout instead, since a probe takes
  as long as its trials do;
- an error on rank 0 reaches the others as one line, and rank 0 raises its own.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from autotune.core.schemas import Suggestion
from autotune_client.errors import AutotuneClientError

__all__ = ["DECISION_SLACK_SECONDS", "in_process_group", "local_probe_starting", "one_decision"]

DECISION_SLACK_SECONDS = 30.0
"""Added to the client's timeout for the other ranks' wait: rank 0 fingerprints the model (and
copies it for a probe) before it asks the store, and that takes seconds on a large model."""

# Set on rank 0 while it decides: the local probe calls it before its first trial.
_PROBE_STARTING: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "autotune_probe_starting", default=None
)


def in_process_group() -> bool:
    """Whether this process is one rank of an initialized torch.distributed group of several."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def local_probe_starting() -> None:
    """Called by the local probe before it starts: lets the waiting ranks extend their wait."""
    announce = _PROBE_STARTING.get()
    if announce is not None:
        announce()


def _send(message: tuple[Any, ...], group: Any) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([message], src=0, group=group)


def _receive(group: Any, waited: str) -> tuple[Any, ...]:
    import torch.distributed as dist

    box: list[Any] = [None]
    try:
        dist.broadcast_object_list(box, src=0, group=group)
    except RuntimeError as exc:  # gloo's timeout, or rank 0 gone
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise AutotuneClientError(f"rank {dist.get_rank()} got no plan from rank 0 within {waited}: {reason}") from None
    return tuple(box[0])


def one_decision(decide: Callable[[], Suggestion], *, wait_seconds: float) -> Suggestion:
    """Rank 0 runs ``decide()`` and every rank returns its Suggestion.

    Args:
        decide: what rank 0 runs (``suggest`` with ``distributed=False``).
        wait_seconds: how long the other ranks wait for rank 0's answer from the store.

    Raises:
        AutotuneClientError: on the other ranks, when rank 0 failed (its reason, one line) or
            sent nothing in time. Rank 0 raises what ``decide`` raised.
    """
    import torch.distributed as dist

    short = dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_seconds))
    long = dist.new_group(backend="gloo")
    try:
        if dist.get_rank() == 0:
            return _decide(decide, short, long)
        message = _receive(short, f"{wait_seconds:g} s")
        if message[0] == "probing":
            message = _receive(long, "the process group's timeout (rank 0 was probing)")
        if message[0] == "error":
            raise AutotuneClientError(f"rank 0 could not decide the plan: {message[1]}")
        return Suggestion.model_validate_json(message[1])
    finally:
        dist.destroy_process_group(short)
        dist.destroy_process_group(long)


def _decide(decide: Callable[[], Suggestion], short: Any, long: Any) -> Suggestion:
    probing = False

    def announce() -> None:
        nonlocal probing
        if not probing:
            _send(("probing",), short)
            probing = True

    message: tuple[Any, ...] = ("error", "rank 0 was interrupted")
    token = _PROBE_STARTING.set(announce)
    try:
        suggestion = decide()
        message = ("answer", suggestion.model_dump_json())
        return suggestion
    except Exception as exc:
        message = ("error", (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        raise
    finally:
        _PROBE_STARTING.reset(token)
        _send(message, long if probing else short)
