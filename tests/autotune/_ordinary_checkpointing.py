"""Memory policies written out the ordinary way, as torchtitan applies them, sharing no code with the project's
policies (the truths of test_policy_truth.py and of the 2-process runs in _fsdp_mp_truth.py): the blocks in torch's
``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``), op-level with
``create_selective_checkpoint_contexts`` and torchtitan's rule written out here.

Module-level and keyed by the policy's name, so that a spawned rank is handed the name and builds the same model."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten
# torchtitan's save list (its llama parallelize's ``_save_list``), with the CPU's flash-attention kernel, the
# one scaled_dot_product_attention runs here.
TORCHTITAN_SAVE = {
    aten.mm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_attention_math.default,
    aten._scaled_dot_product_fused_attention_overrideable.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    aten.max.default,
}
MATMULS = {aten.mm.default, aten.addmm.default}


def torchtitan_contexts(save: set[Any], alternate: set[Any]) -> Any:
    """torchtitan's op-level rule: save the listed ops' outputs but every second matmul's; recompute the rest."""
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in alternate:
            meta[mode] += 1
        to_save = func in save and not (func in alternate and meta[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_blocks(model: nn.Module, wrapped: set[int], context_fn: Callable[[], Any] | None = None) -> nn.Module:
    """``model.blocks`` at the indices ``wrapped`` in torch's checkpoint_wrapper (non-reentrant
    torch.utils.checkpoint), as torchtitan applies activation checkpointing before FSDP2 shards the wrapped blocks."""
    options = {} if context_fn is None else {"context_fn": context_fn}
    for index in wrapped:
        model.blocks[index] = checkpoint_wrapper(  # type: ignore[index]
            model.blocks[index],  # type: ignore[index]
            checkpoint_impl=CheckpointImpl.NO_REENTRANT,
            **options,
        )
    return model


def every_k(k: int, n_blocks: int) -> set[int]:
    """The blocks every-K wraps: the first and every K-th after it."""
    return set(range(0, n_blocks, k))


def checkpointed(model: nn.Module, policy: str) -> nn.Module:
    """``model`` (with a ``blocks`` ModuleList) under the policy named as the project names it: every-K, full,
    op (torchtitan's list) or op:addmm/mm (every other matmul of a block)."""
    n_blocks = len(model.blocks)  # type: ignore[arg-type]
    if policy.startswith("every-"):
        return checkpoint_blocks(model, every_k(int(policy.removeprefix("every-")), n_blocks))
    every_block = set(range(n_blocks))
    if policy == "full":
        return checkpoint_blocks(model, every_block)
    if policy == "op":
        return checkpoint_blocks(model, every_block, partial(torchtitan_contexts, TORCHTITAN_SAVE, {aten.mm.default}))
    if policy == "op:addmm/mm":
        return checkpoint_blocks(model, every_block, partial(torchtitan_contexts, MATMULS, MATMULS))
    raise ValueError(f"no ordinary form of policy {policy!r} here")
