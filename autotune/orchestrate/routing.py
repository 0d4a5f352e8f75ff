"""The routing a mixture of experts' fake trials assume (``--moe-load-factor``): what `autotune probe`,
`autotune estimate` and the fleet's estimate pairs share, on the floor below both (the fleet imports no CLI
module: docs/design.md, "The floors and the map")."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

from autotune.core.errors import TaskError

__all__ = ["moe_routing_for"]


def moe_routing_for(task: Any, asked: float | None) -> tuple[AbstractContextManager[Any], float | None]:
    """The routing the fake trials of task run under (a context) and what its profiles say (None: dense):
    ``asked``, else balanced (1.0), for a mixture of experts; none for a dense model.

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
    factor = 1.0 if asked is None else asked
    if factor > experts / top_k:
        raise TaskError(
            f"--moe-load-factor {factor:g}: with {experts} experts and top-{top_k} routing the busiest expert "
            f"gets at most {experts / top_k:g} x a fair share (every token)"
        )
    return moe_routing(factor), factor
