"""How one update's samples split into micro-batches: integers in, (size, count) pairs out.

The floor below ``autotune.core.schemas`` and ``autotune.core.plan``: no pydantic, no torch, no other module
of autotune. ``autotune.core.plan.plan`` wraps :func:`split` into a ``Plan``; ``Suggestion.equal_plan``
(in ``autotune.core.schemas``) calls it for the best equal plan. Both used to import each other.

    >>> split(26, 256)
    ([(26, 6), (25, 4)], '')
    >>> split(26, 256, policy="divisor")
    ([(16, 16)], '')
    >>> micro_batches_text(*split(26, 256)[:1])
    '6×26 + 4×25 = 256 (10 steps)'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "DEFAULT_PLAN_POLICY",
    "EXACT_SEARCH_FACTOR",
    "LINEAR_SCAN",
    "MAX_ACCUMULATION_STEPS",
    "MAX_TARGET_BATCH",
    "PLAN_POLICIES",
    "Pairs",
    "PlanPolicy",
    "UnevenPlanWarning",
    "micro_batches_text",
    "split",
]

PLAN_POLICIES = ("balanced", "divisor")
PlanPolicy = Literal["balanced", "divisor"]
DEFAULT_PLAN_POLICY: PlanPolicy = "balanced"
# (size, count) pairs per replica and per update, largest size first.
Pairs = list[tuple[int, int]]


class UnevenPlanWarning(UserWarning):
    """A tool that runs only equal micro-batches was given the best equal plan instead of a balanced one."""


# An exact plan is searched among A in [A_min, EXACT_SEARCH_FACTOR x A_min]: beyond that the
# micro-batch falls under half of what fits, and a slightly different T is the better trade.
EXACT_SEARCH_FACTOR = 2
# Bounds that keep the arithmetic cheap on any input the API accepts (a /suggest request runs it).
MAX_ACCUMULATION_STEPS = 2**24
MAX_TARGET_BATCH = 2**40
LINEAR_SCAN = 65_536


def _require_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def split(
    max_micro_batch: int,
    target_batch: int,
    world_size: int = 1,
    *,
    max_accumulation_steps: int | None = None,
    multiple_of: int = 1,
    policy: PlanPolicy = DEFAULT_PLAN_POLICY,
) -> tuple[Pairs, str]:
    """The micro-batches of one update as (size, count) pairs, and the note on any deviation.

    The rules (balanced, divisor) are ``autotune.core.plan.plan``'s, which documents them; this is the
    same arithmetic without the ``Plan`` around it. Raises ValueError as ``plan`` does.
    """
    if policy not in PLAN_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(PLAN_POLICIES)}, got {policy!r}")
    m_max = _require_positive_int("max_micro_batch", max_micro_batch)
    target = _require_positive_int("target_batch", target_batch)
    world = _require_positive_int("world_size", world_size)
    unit = _require_positive_int("multiple_of", multiple_of)
    if target > MAX_TARGET_BATCH:
        raise ValueError(f"target_batch {target} is larger than {MAX_TARGET_BATCH}")
    if target < world:
        raise ValueError(
            f"target_batch {target} is smaller than world_size {world}: "
            "every replica needs at least one sample per update"
        )
    units_max = m_max // unit  # the search runs over k, with m = k x multiple_of
    if units_max == 0:
        raise ValueError(f"max_micro_batch {m_max} is smaller than multiple_of {unit}")
    a_min = math.ceil(target / (world * unit * units_max))
    if a_min > MAX_ACCUMULATION_STEPS:
        raise ValueError(
            f"target_batch {target} would need {a_min} accumulation steps of micro-batch {unit * units_max} "
            f"on {world} replicas, more than {MAX_ACCUMULATION_STEPS}"
        )
    if policy == "balanced":
        return _balanced(m_max, target, world, unit, a_min)
    a_max = min(EXACT_SEARCH_FACTOR * a_min, MAX_ACCUMULATION_STEPS)
    if max_accumulation_steps is not None:
        cap = _require_positive_int("max_accumulation_steps", max_accumulation_steps)
        a_max = max(a_min, min(a_max, cap))

    if target % (world * unit) == 0:
        steps = _smallest_divisor_in(target // (world * unit), a_min, a_max)
        if steps is not None:
            return [(target // (world * steps), steps)], ""

    # Nearest reachable effective batch: smallest |deviation|, then fewest steps, then larger m.
    # Fewest steps first also bounds the work: only the first LINEAR_SCAN values of A are tried.
    best: tuple[int, int, int] | None = None
    for steps in range(a_min, min(a_max, a_min + LINEAR_SCAN) + 1):
        ideal = target / (world * unit * steps)
        for units in {math.floor(ideal), math.ceil(ideal)}:
            # A rounded-up plan may not pass the largest effective batch a Plan can carry.
            if 1 <= units <= units_max and units * unit * steps * world <= MAX_TARGET_BATCH:
                micro = units * unit
                key = (abs(micro * steps * world - target), steps, -micro)
                if best is None or key < best:
                    best = key
    if best is None:  # only at the edge of MAX_TARGET_BATCH with huge world sizes
        raise ValueError(
            f"target_batch {target} cannot be reached with micro-batch <= {m_max} on {world} replicas "
            f"without passing {MAX_TARGET_BATCH} samples per update"
        )
    steps, micro = best[1], -best[2]
    effective = micro * steps * world
    deviation = effective - target
    what = f"micro-batch <= {m_max}" + (f" in multiples of {unit}" if unit > 1 else "")
    note = (
        f"target batch {target} is not reachable exactly with {what}, "
        f"world size {world} and {a_min}..{a_max} accumulation steps; nearest is "
        f"{micro} x {steps} x {world} = {effective} ({deviation:+d}, {100 * deviation / target:+.1f}%)"
    )
    return [(micro, steps)], note


def _balanced(m_max: int, target: int, world: int, unit: int, a_min: int) -> tuple[Pairs, str]:
    """A_min micro-batches per replica, sizes within one unit of each other (see ``plan``)."""
    units_max = m_max // unit
    per_unit = world * unit  # the effective batch moves in steps of this
    if target % per_unit == 0:
        units = target // per_unit
    else:
        # Nearest reachable effective batch: smallest |deviation|, then fewest steps, then the
        # larger micro-batch (today's rule for the divisor policy, over uneven splits).
        below, above = target // per_unit, target // per_unit + 1
        choices = [k for k in (below, above) if k >= 1 and k * per_unit <= MAX_TARGET_BATCH]
        if not choices:  # only at the edge of MAX_TARGET_BATCH with huge world sizes
            raise ValueError(
                f"target_batch {target} cannot be reached with micro-batch <= {m_max} on {world} replicas "
                f"without passing {MAX_TARGET_BATCH} samples per update"
            )
        units = min(choices, key=lambda k: (abs(k * per_unit - target), -(-k // units_max), -k))
    steps = -(-units // units_max)
    low, extra = divmod(units, steps)  # `extra` micro-batches of low + 1 units, the rest of low
    pairs = [(unit * (low + 1), extra), (unit * low, steps - extra)]
    micro_batches = [(size, count) for size, count in pairs if count > 0 and size > 0]
    effective = units * per_unit
    note = ""
    if effective != target:
        deviation = effective - target
        what = f"micro-batch <= {m_max}" + (f" in multiples of {unit}" if unit > 1 else "")
        note = (
            f"target batch {target} is not reachable exactly with {what} and world size {world}: "
            f"nearest is {micro_batches_text(micro_batches, world)} "
            f"({deviation:+d}, {100 * deviation / target:+.1f}%)"
        )
    return micro_batches, note


def micro_batches_text(micro_batches: Sequence[tuple[int, int]], world_size: int = 1) -> str:
    """A plan's micro-batches as a person reads them: ``6×26 + 4×25 = 256 (10 steps)``.

    count×size per pair; with world_size > 1 the per-replica sum is multiplied out:
    ``(6×26 + 4×25) × 2 = 512 (10 steps)``.

    >>> micro_batches_text([(26, 6), (25, 4)])
    '6×26 + 4×25 = 256 (10 steps)'
    """
    terms = " + ".join(f"{count}×{size}" for size, count in micro_batches)
    per_replica = sum(size * count for size, count in micro_batches)
    steps = sum(count for _, count in micro_batches)
    if world_size > 1:
        terms = f"({terms}) × {world_size}" if len(micro_batches) > 1 else f"{terms} × {world_size}"
    unit = "step" if steps == 1 else "steps"
    return f"{terms} = {per_replica * world_size} ({steps} {unit})"


def _smallest_divisor_in(number: int, low: int, high: int) -> int | None:
    """The smallest divisor of number in [low, high], or None."""
    if high - low <= LINEAR_SCAN:
        return next((d for d in range(low, high + 1) if number % d == 0), None)
    # A wide range: walk the divisor pairs (d, number // d) up to sqrt(number) instead.
    found = None
    for small in range(1, math.isqrt(number) + 1):
        if number % small == 0:
            for divisor in (small, number // small):
                if low <= divisor <= high and (found is None or divisor < found):
                    found = divisor
    return found
