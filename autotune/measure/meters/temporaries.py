"""The CUDA kernels' own temporaries for the ops of a fake trial: each op's arguments read into the shapes
the rules of autotune/core/kernel_temporaries.py take.

A fake trial on a CUDA device (an emulated card's, or the pre-search on a real one) sees each op's
outputs only; ``op_temporaries`` says what the real CUDA kernel behind the op also takes from the caching
allocator and gives back before it returns, so that the fake meter can put those steps into the
allocation trace right after the op's outputs. Ops without a rule have no temporaries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autotune.core import kernel_temporaries as rules
from autotune.core.kernel_temporaries import Step

__all__ = ["UNMODELLED", "KernelFacts", "kernel_facts", "op_temporaries", "unmodelled"]

aten = torch.ops.aten
# attention_backward.cu: larger batches run in chunks of this many (the temporaries are one chunk's).
EFFICIENT_MAX_BATCH = (1 << 16) - 1


@dataclass(frozen=True)
class KernelFacts:
    """What the rules read of the device: compute capability and streaming multiprocessors."""

    capability: tuple[int, int]
    sm_count: int


def kernel_facts(device: torch.device) -> KernelFacts:
    """The facts of a CUDA device as this process's torch reports them (the emulated card's, under the
    emulation)."""
    props = torch.cuda.get_device_properties(device)
    return KernelFacts(capability=(int(props.major), int(props.minor)), sm_count=int(props.multi_processor_count))


def _deterministic() -> bool:
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def _efficient_backward(args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    # (grad_out, query, key, value, attn_bias, out, logsumexp, ...): (B, nH, M, K) views of BMHK storage
    grad_out, query, key, value = args[0], args[1], args[2], args[3]
    batch, heads, queries, head_dim = query.shape
    return rules.efficient_attention_backward(
        min(int(batch), EFFICIENT_MAX_BATCH),
        int(heads),
        int(queries),
        int(key.shape[2]),
        int(head_dim),
        int(value.shape[3]),
        itemsize=query.element_size(),
        capability=facts.capability,
        grad_out_contiguous=grad_out.transpose(1, 2).is_contiguous(),
        deterministic=_deterministic(),
    )


def _efficient_backward_direct(args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    # aten._efficient_attention_backward itself: (grad_out, query, key, value, ...) in (B, M, nH, K)
    grad_out, query, key, value = args[0], args[1], args[2], args[3]
    batch, queries, heads, head_dim = query.shape
    return rules.efficient_attention_backward(
        int(batch),
        int(heads),
        int(queries),
        int(key.shape[1]),
        int(head_dim),
        int(value.shape[3]),
        itemsize=query.element_size(),
        capability=facts.capability,
        grad_out_contiguous=grad_out.is_contiguous(),
        deterministic=_deterministic(),
    )


def _efficient_forward(args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    query, value = args[0], args[2]
    batch, heads, queries, head_dim = query.shape
    return rules.efficient_attention_forward(
        int(batch),
        int(heads),
        int(queries),
        int(head_dim),
        int(value.shape[3]),
        itemsize=query.element_size(),
        capability=facts.capability,
    )


def _flash_backward(args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    # (grad_out, query, key, value, out, logsumexp, ...): (B, H, S, D)
    query, key = args[1], args[2]
    batch, heads, queries, head_dim = query.shape
    return rules.flash_attention_backward(
        int(batch),
        int(heads),
        int(key.shape[1]),
        int(queries),
        int(key.shape[2]),
        int(head_dim),
        itemsize=query.element_size(),
        sm_count=facts.sm_count,
        deterministic=_deterministic(),
    )


def _cudnn_backward(args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    query = args[1]
    batch, heads, queries, head_dim = query.shape
    return rules.cudnn_attention_backward(int(batch), int(heads), int(queries), int(head_dim))


def _embedding_backward(args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    # (grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
    grad, indices, num_weights = args[0], args[1], args[2]
    scale = bool(args[4]) if len(args) > 4 else False
    return rules.embedding_dense_backward(
        int(indices.numel()),
        int(grad.shape[-1]),
        int(num_weights),
        index_itemsize=indices.element_size(),
        accumulate_itemsize=8 if grad.dtype == torch.float64 else 4,
        scale_grad_by_freq=scale,
    )


def _layer_norm_backward(args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    # (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask)
    inputs, shape, weight, mask = args[1], args[2], args[5], args[7]
    if weight is None:
        return []
    cols = math.prod(int(n) for n in shape)
    rows = int(inputs.numel()) // max(1, cols)
    return rules.layer_norm_backward(
        rows,
        cols,
        weight_itemsize=weight.element_size(),
        sm_count=facts.sm_count,
        weight_grad=bool(mask[1]),
        bias_grad=bool(mask[2]),
    )


_RULES: dict[Any, Callable[[tuple[Any, ...], KernelFacts], list[Step]]] = {
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward,
    aten._efficient_attention_backward.default: _efficient_backward_direct,
    aten._scaled_dot_product_efficient_attention.default: _efficient_forward,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_backward,
    aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_backward,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
}


# Ops whose CUDA kernels take scratch space that no rule gives, and what it is: an estimate that ran one
# says its figure leaves that out.
_CONV_WORKSPACES = "cuDNN convolution workspaces (cuDNN's heuristics choose an algorithm, and its workspace, per shape)"
UNMODELLED: dict[Any, str] = {
    aten.convolution.default: _CONV_WORKSPACES,
    aten.convolution_backward.default: _CONV_WORKSPACES,
}

def unmodelled(func: Any) -> str | None:
    """What func's CUDA kernel takes that no rule here gives, None where nothing (or a rule covers it)."""
    return UNMODELLED.get(func)


def op_temporaries(func: Any, args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    """The steps of func's CUDA kernel beyond its outputs (none for an op without a rule)."""
    rule = _RULES.get(func)
    return rule(args, facts) if rule is not None else []
