"""The tensor-parallel plan a job applies, read off the task and the model (no torch.distributed needed): the
fingerprint tags it (another plan is another setup: transformers 5.25 changed Mixtral's under the same config),
and ``autotune.measure.tensor_parallel`` applies it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["tp_plan_label", "tp_plan_of"]


def tp_plan_of(model: Any, task: Any) -> Mapping[str, Any] | None:
    """The plan the job applies: the task's ``tp_plan``, else the model's own (transformers' ``_tp_plan``
    of the instance, which holds the config's ``base_model_tp_plan`` under the base model's prefix), else
    None."""
    given = getattr(task, "tp_plan", None)
    if given:
        return dict(given)
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and own:
        return dict(own)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, Mapping) and base:
        prefix = getattr(model, "base_model_prefix", "")
        if prefix and hasattr(model, prefix):
            return {f"{prefix}.{key}": value for key, value in base.items()}
        return dict(base)
    return None


def tp_plan_label(plan: Mapping[str, Any] | None) -> str | None:
    """The plan in one canonical text (module pattern -> style name, sorted), as the setup and the fingerprint
    carry it; None for no plan."""
    if not plan:
        return None
    named = {str(k): v if isinstance(v, str) else _style_name(v) for k, v in plan.items()}
    return json.dumps(dict(sorted(named.items())), sort_keys=True, separators=(",", ":"))


def _style_name(style: Any) -> str:
    # The class's qualified name without its module: the same style imported two ways digests the same.
    return (style if isinstance(style, type) else type(style)).__qualname__
