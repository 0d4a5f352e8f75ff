"""The model's shape as the composition table's mesh rows read it (``autotune.core.compositions.ModelShape``), from
a task without a trial: its model built on ``meta`` (shapes, no memory, no weights' initialisation spent).

What is read, and where the run-time check that it comes before reads the same:

- heads and key/value heads: the config's ``num_attention_heads`` / ``n_head`` and ``num_key_value_heads`` (its text
  config's, for a model with several), as ``autotune.measure.tensor_parallel`` checks them when it applies a plan;
- blocks: the children of the one list a pipeline cuts (``autotune.measure.pipeline``'s rule, the task's
  ``shard_classes`` first);
- whether torch's context parallelism runs it: an hf: causal LM with SDPA attention
  (``autotune.measure.context_parallel.check_cp_model``);
- the plan names its family has module names for (``autotune.tasks.tp_plan``).

A model whose factory cannot run on ``meta`` reads as a shape with nothing known: the rows wait, and the run-time
checks say what is wrong as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from autotune.core.compositions import ModelShape
from autotune.core.errors import TaskError
from autotune.measure.pipeline.cutting import _blocks_of  # the one rule of what a pipeline cuts between
from autotune.measure.trial import build_on_meta
from autotune.tasks.task import ProbeTask
from autotune.tasks.tp_plan import TORCHTITAN_FAMILIES

__all__ = ["model_shape"]

# The config attributes that count heads, as the families spell them (autotune/measure/tensor_parallel.py).
_HEADS = ("num_attention_heads", "n_head")
_KV_HEADS = ("num_key_value_heads",)


def model_shape(task: ProbeTask) -> ModelShape:
    """The shape of task's model (one meta build per model factory and block classes: a config's variants of one
    task, its precision or policy, share it)."""
    return _shape(task.model, task.shard_classes, task.name)


@functools.lru_cache(maxsize=32)
def _shape(
    factory: Callable[[], nn.Module], shard_classes: tuple[type[nn.Module], ...] | None, name: str
) -> ModelShape:
    task = ProbeTask(name=name, model=factory, batch=lambda m: None, shard_classes=shard_classes)
    try:
        model = build_on_meta(task)
    except TaskError:  # a factory that returns no module: its own trial says so
        model = None
    if model is None:
        return ModelShape(name=name)
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = _count(text, _HEADS)
    family = getattr(config, "model_type", None) if config is not None else None
    attention = getattr(config, "_attn_implementation", None)
    return ModelShape(
        name=name,
        heads=heads,
        kv_heads=_count(text, _KV_HEADS),
        blocks=_blocks(model, task),
        family=str(family) if family else None,
        causal_lm_sdpa=config is not None and type(model).__name__.endswith("ForCausalLM") and attention == "sdpa",
        tp_plans=("torchtitan",) if family in TORCHTITAN_FAMILIES else (),
        experts=_experts(model),
    )


def _experts(model: nn.Module) -> int | None:
    """The routed experts --ep shards (autotune/measure/experts.py), None where the model has none."""
    from autotune.measure.experts import expert_modules

    found = expert_modules(model)
    experts: int | None = getattr(found[0], "num_experts", None) if found else None
    return experts


def _count(config: Any, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _blocks(model: nn.Module, task: ProbeTask) -> int | None:
    try:
        _, blocks = _blocks_of(model, task)
    except TaskError:  # not one list of blocks: the pipeline's own line says so
        return None
    return len(blocks)
