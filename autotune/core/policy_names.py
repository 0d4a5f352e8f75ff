"""The names of the memory policies (activation checkpointing) as the CLI, a task and the wire spell them:
their grammar, their one canonical spelling, and their order by recomputation.

Torch-free, so that the server validates and matches a name with this alone; the policy a name stands for
(which blocks it wraps, and how) is ``autotune.measure.policies``.

- ``none``: every activation is kept for the backward.
- ``every-K``, K from 2 to 9999: the first block and every K-th after it (blocks 0, K, 2K, ...) recompute
  their forward; ``every-1`` would be ``full``.
- ``full``: every block recomputes its forward.
- ``op``: op-level selective checkpointing on every block, torchtitan's rule (``selective_ac_option = "op"``):
  the outputs of the listed ops are saved, those of every second matmul among them recomputed, every other
  op recomputed. ``op`` alone is torchtitan's list (:data:`TORCHTITAN_SAVED_OPS`); ``op:OP/OP/...`` names
  the ops instead (``op:mm/addmm``). An op is ``name`` (an ``aten`` op, its default overload),
  ``namespace.name`` or ``namespace.name.overload``.
- ``budget:R``, R a ratio from 0 to 1 (at most 4 decimals), for compiled jobs only (``--compile``,
  docs/compile.md): no block is wrapped; ``torch._functorch.config.activation_memory_budget`` is R while
  the model compiles (0 recomputes every activation it can, 1 is the partitioner's default min-cut).

The canonical spelling is what a profile stores and ``/suggest`` matches by equality: K without leading
zeros, and for ``op:`` the ops sorted, without repeats, ``aten.`` and ``.default`` dropped, torchtitan's
list written ``op``.

    >>> canonical_policy("op:aten.mm.default/addmm/mm")
    'op:addmm/mm'
    >>> parse_policy("every-4").every, parse_policy("full").every
    (4, 1)
    >>> canonical_policy("budget:0.50"), canonical_policy("budget:1.0")
    ('budget:0.5', 'budget:1')
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "MATMUL_OPS",
    "MAX_EVERY",
    "MAX_POLICY_NAME_LENGTH",
    "POLICY_NAMES",
    "POLICY_PATTERN",
    "TORCHTITAN_SAVED_OPS",
    "PolicyName",
    "canonical_policy",
    "canonical_wire_policy",
    "parse_policy",
    "recomputation_key",
]

# The named policies, in the order of the menus (``every-K`` and ``op:OPS`` are valid beyond these).
POLICY_NAMES = ("none", "every-2", "full", "op")
MAX_EVERY = 9999
MAX_POLICY_NAME_LENGTH = 256
# torchtitan's ``_save_list`` (torchtitan/models/llama3/infra/parallelize.py, later
# torchtitan/distributed/activation_checkpoint.py): matmuls, the fused attention kernels, FSDP's
# reduce-scatter, and ``max`` (the amax of float8 scaling), plus the CPU's flash kernel, which torchtitan (GPU
# only) never meets: on the CPU, scaled_dot_product_attention runs it where a GPU runs the flash one.
TORCHTITAN_SAVED_OPS = (
    "mm",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.reduce_scatter_tensor",
    "max",
)
# The matmuls whose outputs alternate (saved, recomputed, saved, ...) when the list saves them. torchtitan
# counts ``mm`` only; a Linear with a bias runs ``addmm``, counted with it when a list names it.
MATMUL_OPS = ("mm", "addmm")

_SEGMENT = r"[A-Za-z_][A-Za-z0-9_]*"
_OP = rf"{_SEGMENT}(?:\.{_SEGMENT}){{0,2}}"
# What the server checks (torch-free, as a pydantic pattern); parse_policy says why a name fails.
_BUDGET = r"(?:0(?:\.[0-9]{1,4})?|1(?:\.0{1,4})?)"
POLICY_PATTERN = rf"^(?:none|full|every-(?:[2-9]|[1-9][0-9]{{1,3}})|op(?::{_OP}(?:/{_OP})*)?|budget:{_BUDGET})$"
# budget:R (compiled jobs) is left out of the line: its own refusal says what R is.
_RULE = "none, every-K (K from 2 to 9999), full, op, or op:OP/OP/... (op names, e.g. op:mm/addmm)"


@dataclass(frozen=True)
class PolicyName:
    """A parsed policy name: its kind, K for every-K (1 for full), the saved ops for op (canonical)."""

    kind: Literal["none", "every", "full", "op", "budget"]
    every: int = 0
    ops: tuple[str, ...] = ()
    budget: float = 1.0

    @property
    def name(self) -> str:
        """The canonical spelling."""
        if self.kind == "every":
            return f"every-{self.every}"
        if self.kind == "budget":
            return f"budget:{self.budget:.4f}".rstrip("0").rstrip(".")
        if self.kind == "op" and self.ops != _canonical_ops(TORCHTITAN_SAVED_OPS):
            return "op:" + "/".join(self.ops)
        return self.kind


def _canonical_op(op: str) -> str:
    parts = op.split(".")
    if len(parts) == 3 and parts[2] == "default":
        parts = parts[:2]
    if len(parts) == 2 and parts[0] == "aten":
        parts = parts[1:]
    return ".".join(parts)


def _canonical_ops(ops: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return tuple(sorted({_canonical_op(op) for op in ops}))


def _parse_every(text: str) -> PolicyName:
    k = text.removeprefix("every-")
    if not k.isascii() or not k.isdigit():
        raise ValueError(f"{text!r}: K of every-K must be a whole number from 2 to {MAX_EVERY}")
    if k != str(int(k)):
        raise ValueError(f"{text!r}: write K without leading zeros (every-{int(k)})")
    if int(k) == 1:
        raise ValueError("'every-1' checkpoints every block: that is full (every-K needs K >= 2)")
    if not 2 <= int(k) <= MAX_EVERY:
        raise ValueError(f"{text!r}: K of every-K must be from 2 to {MAX_EVERY}")
    return PolicyName("every", int(k))


def _parse_ops(text: str) -> PolicyName:
    listed = text.removeprefix("op:")
    if not listed:
        raise ValueError(f"{text!r}: name the ops after the colon (op:mm/addmm), or write op for torchtitan's list")
    ops = listed.split("/")
    for op in ops:
        if not re.fullmatch(_OP, op):
            raise ValueError(
                f"{text!r}: {op!r} is not an op name (an aten op such as mm, or namespace.op[.overload]; "
                "ops separated by /)"
            )
    return PolicyName("op", ops=_canonical_ops(ops))


def _parse_budget(text: str) -> PolicyName:
    ratio = text.removeprefix("budget:")
    if not re.fullmatch(_BUDGET, ratio):
        raise ValueError(
            f"{text!r}: R of budget:R is the compiler's activation memory budget, a ratio from 0 to 1 with at most "
            "4 decimals (budget:0.5)"
        )
    return PolicyName("budget", budget=float(ratio))


def parse_policy(text: str) -> PolicyName:
    """The policy ``text`` names.

    Raises:
        ValueError: one line saying what is wrong with the name and what the names are.

    >>> parse_policy("op").name, parse_policy("op:mm/max").ops
    ('op', ('max', 'mm'))
    """
    if len(text) > MAX_POLICY_NAME_LENGTH:
        raise ValueError(f"a policy name is at most {MAX_POLICY_NAME_LENGTH} characters, got {len(text)}")
    if text == "none":
        return PolicyName("none")
    if text == "full":
        return PolicyName("full", every=1)
    if text == "op":
        return PolicyName("op", ops=_canonical_ops(TORCHTITAN_SAVED_OPS))
    if text.startswith("every-"):
        return _parse_every(text)
    if text.startswith("op:"):
        return _parse_ops(text)
    if text.startswith("budget:"):
        return _parse_budget(text)
    raise ValueError(f"unknown policy {text!r}: choose from {_RULE}")


def canonical_policy(text: str) -> str:
    """The canonical spelling of the policy ``text`` names (ValueError: not a policy name)."""
    return parse_policy(text).name


def canonical_wire_policy(value: object) -> object:
    """A wire value's canonical spelling when it is a string (pydantic's check of it before the pattern);
    anything else is left for pydantic to refuse as not a string."""
    return canonical_policy(value) if isinstance(value, str) else value


def recomputation_key(name: str) -> tuple[float, int]:
    """Sorts policies by how much of the forward they recompute: none, every-K (larger K first), op, full;
    a name that is not a policy last. op recomputes about half (every second matmul and the cheap ops) and
    sorts after every-2.

    >>> sorted(["full", "op", "every-2", "none", "every-4"], key=recomputation_key)
    ['none', 'every-4', 'every-2', 'op', 'full']
    """
    try:
        policy = parse_policy(name)
    except ValueError:
        return (2.0, 0)
    if policy.kind == "budget":  # R = 1 keeps what the min-cut keeps, R = 0 recomputes all it can
        return (1.0 - policy.budget, 2)
    share = {"none": 0.0, "full": 1.0, "op": 0.5}.get(policy.kind, 1.0 / max(policy.every, 1))
    return (share, ("none", "every", "op", "full").index(policy.kind))
