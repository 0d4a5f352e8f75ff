"""The routing a mixture of experts' fake trials assume (``--moe-load-factor``): what `autotune probe`,
`autotune estimate` and the fleet's estimate pairs share, on the floor below both (the fleet imports no CLI
module: docs/design.md, "The floors and the map")."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

from autotune.core.errors import TaskError

__all__ = ["moe_routing_for"]


def moe_routing_for(task: Any, asked: float | None, ep: int = 1) -> tuple[AbstractContextManager[Any], float | None]:
    """The routing the fake trials of task run under (a context) and what its profiles say (None: dense):
    ``asked``, else for a mixture of experts balanced (1.0) without expert parallelism and under ``ep`` > 1 the
    worst case a dropless job allows, every token picking expert 0 (experts / top_k: the busiest expert takes every
    token of the rank, and rank 0, which holds it, receives each rank's: autotune/measure/experts.py). Without ep
    the spread changes no buffer (transformers' grouped experts run every pick as one row); under ep it sizes the
    all-to-all's receive buffer, which a step that fits on average outgrows early in training; a job's capacity
    factor (--moe-capacity-factor) then bounds what each expert takes. None for a dense model.

    Raises:
        TaskError: a load factor asked of a dense model, or above experts / top_k (every token on one expert).
    """
    from autotune.measure.meters.fake import experts_of, moe_routing
    from autotune.measure.trial import build_on_meta

    meta = build_on_meta(task) if asked is not None or task.model is not None else None
    found = experts_of(meta) if meta is not None else None
    del meta
    if found is None:
        if asked is not None:
            raise TaskError(f"--moe-load-factor {asked:g}: {task.name} is a dense model (no experts to route)")
        return contextlib.nullcontext(), None
    experts, top_k = found
    factor = (experts / top_k if ep > 1 else 1.0) if asked is None else asked
    if factor > experts / top_k:
        raise TaskError(
            f"--moe-load-factor {factor:g}: with {experts} experts and top-{top_k} routing the busiest expert "
            f"gets at most {experts / top_k:g} x a fair share (every token)"
        )
    return moe_routing(factor), factor
