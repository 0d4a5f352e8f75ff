"""Activation checkpointing as a memory policy of the task: which blocks recompute their forward.

A policy trades compute for memory. ``none`` keeps every activation for the backward; ``full``
wraps every block (the blocks ``--strategy fsdp`` shards: the task's ``shard_classes``, else the
children of every ``nn.ModuleList``) in non-reentrant ``torch.utils.checkpoint``, so a block keeps
only its input and recomputes the rest in the backward; ``every-2`` wraps every other block (the
first, the third, ...), half the saving for half the recomputation.

The policy is applied in one place, where a trial builds its model (``autotune.measure.trial.build_model``),
before any strategy wraps it (FSDP2 shards the checkpointed blocks, as torchtitan does). It replaces
the block's ``forward`` on the instance, so that module names, parameters and the fingerprint stay
those of the task's model; FakeTensorMode traces it like any other op (the recomputation runs in the
fake backward), so the fake pre-search sees the policy's memory byte for byte on the CPU.

    >>> POLICIES
    ('none', 'every-2', 'full')
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.core.errors import TaskError
from autotune.core.schemas import ACTIVATION_CHECKPOINTING

__all__ = ["POLICIES", "apply_policy", "blocks", "check_model", "check_policy", "wrapped_blocks"]

POLICIES = ACTIVATION_CHECKPOINTING

# What a checkpointed block's instance carries, so a policy is never applied twice to one block.
_MARK = "_autotune_checkpointed"


def check_policy(policy: str) -> str:
    """The policy name, or a one-line TaskError naming the ones there are."""
    if policy not in POLICIES:
        raise TaskError(f"activation checkpointing must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def blocks(model: nn.Module, shard_classes: tuple[type[nn.Module], ...] | None) -> list[nn.Module]:
    """The blocks a policy wraps: the same modules ``--strategy fsdp`` shards one by one."""
    from autotune.measure.strategies import shard_units

    return shard_units(model, shard_classes)


def wrapped_blocks(policy: str, count: int) -> list[int]:
    """The indices of the blocks ``policy`` checkpoints out of ``count``.

    >>> wrapped_blocks("every-2", 5), wrapped_blocks("full", 3), wrapped_blocks("none", 3)
    ([0, 2, 4], [0, 1, 2], [])
    """
    check_policy(policy)
    if policy == "none":
        return []
    step = 2 if policy == "every-2" else 1
    return list(range(0, count, step))


def _checkpointed(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with keyword arguments, with inputs that need no grad, and under
        # FakeTensorMode; the reentrant variant is deprecated for all three reasons.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_policy(
    model: nn.Module, policy: str, shard_classes: tuple[type[nn.Module], ...] | None, *, task_name: str = "task"
) -> int:
    """Checkpoint the blocks of ``model`` that ``policy`` names, in place.

    Returns:
        How many blocks were wrapped (0 for ``none``).

    Raises:
        TaskError: an unknown policy; a policy other than ``none`` on a model with no block to wrap
            (one line naming ``shard_classes``).
    """
    check_policy(policy)
    if policy == "none":
        return 0
    units = blocks(model, shard_classes)
    if not units:
        raise TaskError(
            f"--ac {policy} found no block to checkpoint in {type(model).__name__} of task {task_name!r}: "
            "it has no nn.ModuleList; name the block classes in the task (ProbeTask(shard_classes=(Block,)))"
        )
    chosen = [units[i] for i in wrapped_blocks(policy, len(units))]
    for unit in chosen:
        if not getattr(unit, _MARK, False):
            unit.forward = _checkpointed(unit.forward)  # type: ignore[method-assign]
            setattr(unit, _MARK, True)
    return len(chosen)


def check_model(task: Any, policy: str) -> int:
    """How many blocks ``policy`` wraps in the task's model, built on the meta device (no memory):
    the check a command makes before its first probe, so that a policy that cannot apply stores
    nothing.

    Raises:
        TaskError: an unknown policy, or no block to wrap (one line naming ``shard_classes``).
    """
    import torch

    check_policy(policy)
    try:
        with torch.device("meta"):
            model = task.model()
    except Exception:  # a factory that cannot run on meta: the trial will say what it says
        return 0
    return apply_policy(model, policy, task.shard_classes, task_name=task.name)
