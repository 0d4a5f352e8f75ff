"""The CUDA kernels' own temporaries for the ops of a fake trial: each op's arguments read into the shapes
the rules of autotune/core/kernel_temporaries.py take.

A fake trial on a CUDA device (an emulated card's, or the pre-search on a real one) sees each op's
outputs only; ``op_temporaries`` says what the real CUDA kernel behind the op also takes from the caching
allocator and gives back before it returns, so that the fake meter can put those steps into the
allocation trace right after the op's outputs. Ops without a rule have no temporaries.
"""

from __future__ import annotations

import math
import os
import sys
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
    """What the rules read of the device: compute capability and streaming multiprocessors; and of the
    process: the bound on each cuDNN convolution's workspace, and whether its environment set it."""

    capability: tuple[int, int]
    sm_count: int
    # cuDNN's CUDNN_CONV_WSCAP_DBG in bytes, None where the job sets none (then the stated bound alone).
    conv_workspace_cap_bytes: int | None = None


def kernel_facts(device: torch.device) -> KernelFacts:
    """The facts of a CUDA device as this process's torch reports them (the emulated card's, under the
    emulation), with cuDNN's workspace cap from this process's environment (the job's, in the child)."""
    props = torch.cuda.get_device_properties(device)
    return KernelFacts(
        capability=(int(props.major), int(props.minor)),
        sm_count=int(props.multi_processor_count),
        conv_workspace_cap_bytes=rules.conv_workspace_cap_bytes(os.environ),
    )


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


_CUDNN_BACKENDS = ("Cudnn", "CudnnTranspose")


def _on_cudnn(inputs: Any, weight: Any, args: tuple[Any, ...], bias_sizes: Any) -> bool:
    """Whether the real op would run on cuDNN: the backend ATen's own selection picks for these tensors and
    options (``torch._C._select_conv_backend``, which reads shapes, dtypes and the cuDNN flags only)."""
    stride, padding, dilation, transposed, output_padding, groups = args
    try:
        backend = torch._C._select_conv_backend(
            inputs, weight, None, stride, padding, dilation, transposed, output_padding, groups, bias_sizes
        )
    except (RuntimeError, TypeError):  # a case ATen's selection refuses: the op itself will say so
        return False
    return backend.name in _CUDNN_BACKENDS


def _conv_workspace(
    cudnn_calls: int, inputs: Any, weight: Any, y_spatial: Any, groups: Any, facts: KernelFacts
) -> list[Step]:
    # The "x" side of cuDNN's call has weight.shape[1] * groups channels (a transposed convolution's weight is
    # (C_in, C_out / groups, k...): its x side is its output); the column matrix spans the y side's positions.
    bound = rules.convolution_workspace_bound(
        int(inputs.shape[0]),
        int(weight.shape[1]) * int(groups),
        [int(k) for k in weight.shape[2:]],
        [int(n) for n in y_spatial],
        itemsize=inputs.element_size(),
    )
    return rules.convolution_workspace(cudnn_calls, bound_bytes=bound, cap_bytes=facts.conv_workspace_cap_bytes)


def _convolution(args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    # (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    inputs, weight = args[0], args[1]
    stride, padding, dilation, transposed, _, groups = args[3:9]
    if not _on_cudnn(inputs, weight, tuple(args[3:9]), None):
        return []
    if transposed:  # cuDNN runs it as a backward-data call: the transposed convolution's input is the y side
        y_spatial = list(inputs.shape[2:])
    else:
        y_spatial = rules.convolution_output_spatial(
            [int(n) for n in inputs.shape[2:]],
            [int(k) for k in weight.shape[2:]],
            [int(n) for n in stride],
            [int(n) for n in padding],
            [int(n) for n in dilation],
        )
    return _conv_workspace(1, inputs, weight, y_spatial, groups, facts)


def _convolution_backward(args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    # (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
    #  output_mask): cuDNN runs grad_input's and grad_weight's convolutions, each its own workspace
    grad_output, inputs, weight, mask = args[0], args[1], args[2], args[10]
    transposed, groups = args[7], args[9]
    if not _on_cudnn(inputs, weight, tuple(args[4:10]), args[3]):
        return []
    calls = int(bool(mask[0])) + int(bool(mask[1]))
    y_spatial = inputs.shape[2:] if transposed else grad_output.shape[2:]
    return _conv_workspace(calls, inputs, weight, y_spatial, groups, facts)


# bitsandbytes' CUDA backend (backends/cuda/ops.py, 0.50): past this many rows of the input (tokens), gemm_4bit
# takes its unfused path; at or below it, bitsandbytes' own per-architecture heuristic chooses.
BNB_GEMM_4BIT_CUSTOM_MAX_ROWS = 1536


def _gemm_4bit(args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    # (A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset)
    inputs, shape, blocksize = args[0], args[2], int(args[4])
    cols = int(inputs.shape[-1])
    rows, out_features = int(inputs.numel()) // max(1, cols), int(shape[0])
    if rows <= BNB_GEMM_4BIT_CUSTOM_MAX_ROWS and cols % blocksize == 0:
        # bitsandbytes' heuristic where this process loaded its CUDA backend (the emulated card's properties
        # under the emulation); without it the temporary is counted, a bound.
        backend = sys.modules.get("bitsandbytes.backends.cuda.ops")
        choose = getattr(backend, "_gemm_4bit_use_custom_fn", None)
        try:
            device = inputs.device.index or 0
            fused = choose is not None and bool(choose(device, inputs.dtype, rows, out_features, cols))
        except Exception:  # another bitsandbytes' signature: count it
            fused = False
        if fused:
            return []
    nested = args[7] if len(args) > 7 else None
    return rules.dequantized_4bit_weight(
        out_features,
        cols,
        itemsize=inputs.element_size(),
        absmax_blocks=0 if nested is None else int(nested.numel()),
    )


_RULES: dict[Any, Callable[[tuple[Any, ...], KernelFacts], list[Step]]] = {
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward,
    aten._efficient_attention_backward.default: _efficient_backward_direct,
    aten._scaled_dot_product_efficient_attention.default: _efficient_forward,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_backward,
    aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_backward,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten.convolution.default: _convolution,
    aten.convolution_backward.default: _convolution_backward,
}


# Ops whose CUDA kernels take scratch space that no rule gives, and what it is, or whose rule states a bound
# rather than a size: an estimate that ran one says so, in the sentence given here for the op.
UNMODELLED: dict[Any, str] = {}
_BOUNDED = (aten.convolution.default, aten.convolution_backward.default)


def _conv_workspace_sentence(facts: KernelFacts | None) -> str:
    cap = facts.conv_workspace_cap_bytes if facts is not None else rules.conv_workspace_cap_bytes(os.environ)
    variable = rules.CONV_WORKSPACE_CAP_VARIABLE
    capped = f", capped at {cap // 2**20} MiB by the job's {variable}" if cap is not None else ""
    return (
        "cuDNN convolution workspaces are a stated bound, not cuDNN's choice: each cuDNN call gets "
        f"{rules.CONV_WORKSPACE_COLUMN_MATRICES} column matrices of its GEMM lowering (N x C_in x kernel x output "
        f"positions){capped} (docs/cuda-estimates.md)"
    )


def unmodelled(func: Any, facts: KernelFacts | None = None) -> str | None:
    """What an estimate that ran func must say of its kernel's temporaries, as one sentence: what no rule
    gives, or the bound a rule states instead of a size; None where nothing (a rule gives the size)."""
    if func in _BOUNDED:
        return _conv_workspace_sentence(facts)
    return UNMODELLED.get(func)


# Ops of libraries that register them only when imported, by name (``OpOverload.name()``).
_NAMED_RULES: dict[str, Callable[[tuple[Any, ...], KernelFacts], list[Step]]] = {
    "bitsandbytes::gemm_4bit": _gemm_4bit,
}


def op_temporaries(func: Any, args: tuple[Any, ...], facts: KernelFacts) -> list[Step]:
    """The steps of func's CUDA kernel beyond its outputs (none for an op without a rule)."""
    rule = _RULES.get(func) or (_NAMED_RULES.get(func.name()) if hasattr(func, "name") else None)
    return rule(args, facts) if rule is not None else []
