"""Activation checkpointing as a memory policy of the task: which blocks recompute their forward, and how.

A policy trades compute for memory. Each is an object that says which blocks it wraps and how it wraps
one; :func:`apply_policy` applies it, in one place, where a trial builds its model
(``autotune.measure.trial.build_model``), before any strategy wraps the model (FSDP2 shards the
checkpointed blocks, as torchtitan does). The blocks are those ``--strategy fsdp`` shards: the task's
``shard_classes``, else the children of every ``nn.ModuleList``.

- :class:`NoCheckpointing` (``none``): every activation is kept for the backward.
- :class:`BlockCheckpointing` (``every-K``, ``full``): the first block and every K-th after it (blocks 0,
  K, 2K, ...; ``full`` is K = 1) run in non-reentrant ``torch.utils.checkpoint``: such a block keeps only its
  inputs and recomputes the rest in the backward. ``every-2`` wraps the first, the third, ... (torchtitan's
  ``selective_ac_option = "2"`` wraps the second, the fourth, ...: the same count for an even number of
  blocks).
- :class:`OpCheckpointing` (``op``, ``op:OP/OP/...``): every block in checkpoint with
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``, torchtitan's op-level rule: the outputs of
  the listed ops are saved, except those of every second matmul among them (mm, addmm), and every other op
  is recomputed. The list is data: ``op`` is torchtitan's (``autotune.core.policy_names``), a task may name
  its own (``activation_checkpointing="op:mm/addmm"``: a Linear with a bias runs addmm, not mm).

The wrapper replaces the block's ``forward`` on the instance, so that module names, parameters and the
fingerprint stay those of the task's model; FakeTensorMode traces it like any other op (the recomputation
runs in the fake backward), so the fake pre-search sees the policy's memory byte for byte on the CPU.

    >>> [policy_for(name).name for name in ("none", "every-3", "full", "op:aten.mm")]
    ['none', 'every-3', 'full', 'op:mm']
    >>> policy_for("every-3").wrapped_blocks(7)
    [0, 3, 6]
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autotune.core.errors import TaskError
from autotune.core.policy_names import MATMUL_OPS, PolicyName, parse_policy
from autotune.core.schemas import ACTIVATION_CHECKPOINTING

__all__ = [
    "POLICIES",
    "BlockCheckpointing",
    "CompilerBudget",
    "MemoryPolicy",
    "NoCheckpointing",
    "OpCheckpointing",
    "apply_policy",
    "blocks",
    "check_model",
    "check_policy",
    "policy_for",
    "resolve_op",
    "wrapped_blocks",
]

# The named policies (every-K for any K >= 2 and op:OP/OP/... are policies too).
POLICIES = ACTIVATION_CHECKPOINTING

# What a checkpointed block's instance carries, so a policy is never applied twice to one block.
_MARK = "_autotune_checkpointed"

Forward = Callable[..., Any]


class MemoryPolicy(ABC):
    """Which blocks a policy wraps and how it wraps one."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The canonical name (what the profile records and ``/suggest`` matches)."""

    @abstractmethod
    def wrapped_blocks(self, count: int) -> list[int]:
        """The indices of the blocks wrapped, out of ``count``."""

    @abstractmethod
    def wrap(self, forward: Forward) -> Forward:
        """``forward`` as the policy runs it."""


@dataclass(frozen=True)
class NoCheckpointing(MemoryPolicy):
    """``none``: every activation kept for the backward."""

    @property
    def name(self) -> str:
        return "none"

    def wrapped_blocks(self, count: int) -> list[int]:
        return []

    def wrap(self, forward: Forward) -> Forward:
        return forward


@dataclass(frozen=True)
class CompilerBudget(NoCheckpointing):
    """``budget:R`` (compiled jobs): no block wrapped; the compiler's partitioner recomputes activations
    until what it saves is R of what the min-cut would (``torch._functorch.config.activation_memory_budget``,
    set while the model compiles: autotune.measure.meters.compiled.memory_budget)."""

    budget: float = 1.0

    @property
    def name(self) -> str:
        return PolicyName("budget", budget=self.budget).name


@dataclass(frozen=True)
class BlockCheckpointing(MemoryPolicy):
    """``every-K`` (``every`` = K >= 2) or ``full`` (``every`` = 1): blocks 0, K, 2K, ... recompute their forward."""

    every: int = 1

    @property
    def name(self) -> str:
        return "full" if self.every == 1 else f"every-{self.every}"

    def wrapped_blocks(self, count: int) -> list[int]:
        return list(range(0, count, self.every))

    def wrap(self, forward: Forward) -> Forward:
        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            # Non-reentrant: works with keyword arguments, with inputs that need no grad, and under
            # FakeTensorMode; the reentrant variant is deprecated for all three reasons.
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

        return run


@dataclass(frozen=True)
class OpCheckpointing(MemoryPolicy):
    """``op``: every block checkpointed op by op; the outputs of ``saved_ops`` are kept (those of every
    second matmul among them recomputed), the rest recomputed. ``saved_ops`` are canonical op names
    (``autotune.core.policy_names``), resolved to this torch's operators by :func:`resolve_op`."""

    saved_ops: tuple[str, ...]

    @property
    def name(self) -> str:
        return PolicyName("op", ops=self.saved_ops).name

    def wrapped_blocks(self, count: int) -> list[int]:
        return list(range(count))

    def wrap(self, forward: Forward) -> Forward:
        saved = frozenset(_known_ops(self.saved_ops))
        matmuls = saved & frozenset(_known_ops(MATMUL_OPS))

        def contexts() -> tuple[Any, Any]:
            # One count per checkpointed call (torchtitan makes its ``meta`` per call too), kept apart for
            # the forward and the recomputation, so that the recomputation decides as the forward did.
            seen = {False: 0, True: 0}

            def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
                if func in matmuls:
                    seen[ctx.is_recompute] += 1
                    if seen[ctx.is_recompute] % 2 == 0:
                        return CheckpointPolicy.PREFER_RECOMPUTE
                return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

            return create_selective_checkpoint_contexts(decide)

        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        return run


def resolve_op(op: str) -> Any:
    """This torch's operator overload for a canonical op name: ``mm`` is ``torch.ops.aten.mm.default``,
    ``ns.op`` is ``torch.ops.ns.op.default``, ``ns.op.overload`` that overload.

    Raises:
        TaskError: no such operator in this torch (one line naming it).
    """
    parts = op.split(".")
    if len(parts) == 1:
        parts = ["aten", *parts]
    if len(parts) == 2:
        parts = [*parts, "default"]
    namespace, name, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        raise TaskError(
            f"unknown op {op!r}: this torch ({torch.__version__}) has no torch.ops.{namespace}.{name}.{overload}"
        ) from None


def _known_ops(ops: tuple[str, ...]) -> list[Any]:
    # torchtitan's list names kernels a torch build may lack (policy_for refuses an unknown op of a list
    # the user wrote); an op this torch does not have is an op no block can run.
    known = []
    for op in ops:
        try:
            known.append(resolve_op(op))
        except TaskError:
            continue
    return known


def policy_for(name: str) -> MemoryPolicy:
    """The policy a name stands for (``autotune.core.policy_names``' grammar).

    Raises:
        TaskError: not a policy name, or an op this torch does not have (one line).
    """
    try:
        parsed = parse_policy(name)
    except ValueError as exc:
        raise TaskError(str(exc)) from None
    if parsed.kind == "none":
        return NoCheckpointing()
    if parsed.kind == "budget":
        return CompilerBudget(parsed.budget)
    if parsed.kind == "op":
        for op in parsed.ops if parsed.name != "op" else ():
            try:
                resolve_op(op)
            except TaskError as exc:
                raise TaskError(f"{name!r}: {exc}") from None
        return OpCheckpointing(parsed.ops)
    return BlockCheckpointing(parsed.every)


def check_policy(policy: str) -> str:
    """The policy's canonical name, or a one-line TaskError saying why it is not one."""
    return policy_for(policy).name


def blocks(model: nn.Module, shard_classes: tuple[type[nn.Module], ...] | None) -> list[nn.Module]:
    """The blocks a policy wraps: the same modules ``--strategy fsdp`` shards one by one."""
    from autotune.measure.strategies import shard_units

    return shard_units(model, shard_classes)


def wrapped_blocks(policy: str, count: int) -> list[int]:
    """The indices of the blocks ``policy`` checkpoints out of ``count``.

    >>> wrapped_blocks("every-2", 5), wrapped_blocks("full", 3), wrapped_blocks("none", 3)
    ([0, 2, 4], [0, 1, 2], [])
    """
    return policy_for(policy).wrapped_blocks(count)


def apply_policy(
    model: nn.Module,
    policy: str | MemoryPolicy,
    shard_classes: tuple[type[nn.Module], ...] | None,
    *,
    task_name: str = "task",
) -> int:
    """Checkpoint the blocks of ``model`` that ``policy`` names, in place, as it says.

    Returns:
        How many blocks were wrapped (0 for ``none``).

    Raises:
        TaskError: an unknown policy; a policy other than ``none`` on a model with no block to wrap
            (one line naming ``shard_classes``).
    """
    chosen_policy = policy_for(policy) if isinstance(policy, str) else policy
    if isinstance(chosen_policy, NoCheckpointing):
        return 0
    units = blocks(model, shard_classes)
    if not units:
        raise TaskError(
            f"--ac {chosen_policy.name} found no block to checkpoint in {type(model).__name__} of task "
            f"{task_name!r}: it has no nn.ModuleList; name the block classes in the task "
            "(ProbeTask(shard_classes=(Block,)))"
        )
    chosen = [units[i] for i in chosen_policy.wrapped_blocks(len(units))]
    for unit in chosen:
        if not getattr(unit, _MARK, False):
            unit.forward = chosen_policy.wrap(unit.forward)  # type: ignore[method-assign]
            setattr(unit, _MARK, True)
    # A checkpointed training step keeps no KV cache: transformers' own checkpointing turns it off
    # (GradientCheckpointingLayer sets use_cache=False), and a cache the forward fills is filled again
    # by the recompute, so selective checkpointing finds other tensors than it saved and fails.
    config: Any = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    return len(chosen)


def check_model(task: Any, policy: str) -> int:
    """How many blocks ``policy`` wraps in the task's model, built on the meta device (no memory):
    the check a command makes before its first probe, so that a policy that cannot apply stores
    nothing.

    Raises:
        TaskError: an unknown policy, or no block to wrap (one line naming ``shard_classes``).
    """
    chosen = policy_for(policy)
    try:
        with torch.device("meta"):
            model = task.model()
    except Exception:  # a factory that cannot run on meta: the trial will say what it says
        return 0
    return apply_policy(model, chosen, task.shard_classes, task_name=task.name)
