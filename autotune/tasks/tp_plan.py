"""The tensor-parallel plan a job applies, read off the task and the model (no torch.distributed needed): the
fingerprint tags it (another plan is another setup: transformers 5.25 changed Mixtral's under the same config),
and ``autotune.measure.tensor_parallel`` applies it.

Plans by name (``--tp-plan``, a task's ``tp_plan="torchtitan"``):

    hf          transformers' own (``from_pretrained(tp_plan="auto")``): the model's ``_tp_plan``; activations
                between blocks replicated on every tp rank, the LM head's logits gathered whole.
    torchtitan  the plan torchtitan applies to its Llama (torchtitan/models/llama3/infra/parallelize.py,
                ``apply_tp``), written for the module names of the hf: family: sequence parallel on the norms
                and between the blocks (the residual stream sharded along the sequence), each attention and
                MLP block's input gathered along the sequence and its output reduce-scattered back, the
                embedding vocabulary-parallel with its output sharded on the sequence, and the LM head
                column-wise with its logits kept sharded by vocabulary through the loss (loss parallel).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.core.errors import TaskError

__all__ = [
    "TORCHTITAN_FAMILIES",
    "TP_PLAN_NAMES",
    "sequence_multiple",
    "torchtitan_plan",
    "tp_plan_label",
    "tp_plan_of",
    "tp_plan_refusal",
]

TP_PLAN_NAMES = ("hf", "torchtitan")
# The families whose module names torchtitan's plan is written for (config.model_type): Llama's layout (q/k/v/o,
# gate/up/down, input_layernorm/post_attention_layernorm, norm, lm_head), and Mixtral's with its experts.
_LLAMA_LAYOUT = ("llama", "mistral", "qwen2", "qwen3")
_MOE_LAYOUT = ("mixtral",)
# GPT-2's layout: transformers' Conv1D layers (weights stored (in, out)), q/k/v packed in one (c_attn), learned
# position embeddings beside the token embeddings, and the LM head tied to the token embedding.
_GPT2_LAYOUT = ("gpt2",)
# Every family torchtitan's plan has module names for (the composition table's --tp-plan row reads it).
TORCHTITAN_FAMILIES = (*_LLAMA_LAYOUT, *_MOE_LAYOUT, *_GPT2_LAYOUT)

# The styles that shard the sequence over the tp ranks (sequence parallel): every length a multiple of tp.
_SEQUENCE_STYLES = (
    "sequence_parallel",
    "embedding_rowwise_sequence",
    "gather_sequence",
    "gather_scatter_sequence",
    "rowwise_sequence",
    "conv1d_rowwise_sequence",
    "gather_sequence_split_heads",
)


def sequence_multiple(task: Any, tp: int) -> int:
    """What every sequence length of the job is a multiple of under tp: tp where its plan shards the sequence
    (torchtitan's, or a task's own with sequence-parallel styles), else 1. Read off the task alone (no model)."""
    plan = getattr(task, "tp_plan", None)
    if tp < 2 or not plan:
        return 1
    if plan == "torchtitan":
        return tp
    if isinstance(plan, Mapping) and any(
        value in _SEQUENCE_STYLES if isinstance(value, str) else _style_name(value) == "SequenceParallel"
        for value in plan.values()
    ):
        return tp
    return 1


def tp_plan_refusal(plan: str | None, *, tp: int, cp: int = 1, seq_lens: Sequence[int] = ()) -> str | None:
    """Why a job cannot take the plan named (one line), or None: the flags alone, before any task loads (the CLI's
    input checks and ``ProbeConfig.validate`` ask it both)."""
    if plan is None:
        return None
    if tp < 2:
        return f"--tp-plan {plan} is the plan of tensor parallelism: give --tp N (N > 1) with it"
    if plan != "torchtitan":
        return None
    for length in seq_lens:  # sequence parallel shards every length over the tp ranks
        if length % tp:
            return (
                f"--tp-plan torchtitan shards the sequence over the {tp} tp ranks (sequence parallel): "
                f"--seq-len {length} is not a multiple of --tp {tp}"
            )
    if cp > 1:
        return (
            "--tp-plan torchtitan with --cp is not measured yet: context parallel and sequence parallel both shard "
            "the sequence; use --tp-plan hf"
        )
    return None


def torchtitan_plan(model: Any) -> dict[str, str]:
    """torchtitan's tensor-parallel plan (sequence parallel, loss parallel) for the module names of ``model``'s
    family, in the style names of autotune/measure/tensor_parallel.py.

    Raises:
        TaskError: a family it has no module names for (one line naming it and the ones it has).
    """
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in TORCHTITAN_FAMILIES:
        known = ", ".join(TORCHTITAN_FAMILIES)
        what = f"model type {family!r}" if family else f"{type(model).__name__} (no hf: config)"
        raise TaskError(f"--tp-plan torchtitan: no module names of {what} are known to it ({known})")
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    if family in _GPT2_LAYOUT:
        return _gpt2_plan(base)
    block = f"{base}layers.*."
    plan = {
        f"{base}embed_tokens": "embedding_rowwise_sequence",
        f"{block}input_layernorm": "sequence_parallel",
        f"{block}self_attn": "gather_sequence",
        f"{block}self_attn.q_proj": "colwise",
        f"{block}self_attn.k_proj": "colwise",
        f"{block}self_attn.v_proj": "colwise",
        f"{block}self_attn.o_proj": "rowwise_sequence",
        f"{block}post_attention_layernorm": "sequence_parallel",
        f"{base}norm": "sequence_parallel",
        "lm_head": "colwise_loss_parallel",
    }
    if family in _MOE_LAYOUT:
        # The experts as transformers shards them (moe_tp_experts), the block's output all-reduced there and
        # scattered back onto the sequence: torchtitan reduce-scatters a partial sum instead (the same output).
        plan[f"{block}mlp"] = "gather_scatter_sequence"
        plan[f"{block}mlp.experts"] = "moe_tp_experts"
        plan[f"{block}mlp.experts.gate_up_proj"] = "packed_colwise"
        plan[f"{block}mlp.experts.down_proj"] = "rowwise"
    else:
        plan[f"{block}mlp"] = "gather_sequence"
        plan[f"{block}mlp.gate_proj"] = "colwise"
        plan[f"{block}mlp.up_proj"] = "colwise"
        plan[f"{block}mlp.down_proj"] = "rowwise_sequence"
    return plan


def _gpt2_plan(base: str) -> dict[str, str]:
    """torchtitan's plan on GPT-2's module names: the same sequence- and loss-parallel layout, with the Conv1D styles
    (a Conv1D's weight is (in, out): column-wise shards its dim 1, row-wise its dim 0), the packed q/k/v sharded
    column-wise by heads (each rank's q, k and v of its heads: the attention's split taken per rank), and the
    position embedding vocabulary-parallel over the positions as the token embedding is over the vocabulary (the
    two outputs meet sharded on the sequence). The LM head stays tied to the token embedding: both shard the
    vocabulary (dim 0) and hold one weight."""
    block = f"{base}h.*."
    return {
        f"{base}wte": "embedding_rowwise_sequence",
        f"{base}wpe": "embedding_rowwise_sequence",
        f"{block}ln_1": "sequence_parallel",
        f"{block}attn": "gather_sequence_split_heads",
        f"{block}attn.c_attn": "conv1d_packed_colwise",
        f"{block}attn.c_proj": "conv1d_rowwise_sequence",
        f"{block}ln_2": "sequence_parallel",
        f"{block}mlp": "gather_sequence",
        f"{block}mlp.c_fc": "conv1d_colwise",
        f"{block}mlp.c_proj": "conv1d_rowwise_sequence",
        f"{base}ln_f": "sequence_parallel",
        "lm_head": "colwise_loss_parallel",
    }


def tp_plan_of(model: Any, task: Any) -> Mapping[str, Any] | None:
    """The plan the job applies: the task's ``tp_plan`` (a plan, or a plan's name: ``torchtitan`` resolved for
    the model's family, ``hf`` the model's own), else the model's own (transformers' ``_tp_plan`` of the
    instance, which holds the config's ``base_model_tp_plan`` under the base model's prefix), else None.

    Raises:
        TaskError: a name it does not know, or torchtitan's plan for a family it has no names for.
    """
    given = getattr(task, "tp_plan", None)
    if isinstance(given, str):
        if given == "torchtitan":
            return torchtitan_plan(model)
        if given != "hf":
            raise TaskError(f"--tp-plan {given!r}: not a plan's name; use one of {', '.join(TP_PLAN_NAMES)}")
    elif given:
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
