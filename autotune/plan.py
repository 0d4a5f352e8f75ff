"""Pure arithmetic of a plan: the micro-batches of an update on D replicas sum to T, and the
affine memory fit.

No torch here: the server imports this module to answer /suggest.

Two policies. ``balanced`` (the default): the fewest steps, A = ceil(T / (D x m_max)), with sizes
that differ by at most one and sum to T / D, so T is exact whenever D divides it (m_max = 26,
T = 256: 6 x 26 + 4 x 25 in 10 steps). Exact because the accumulator divides a group's summed loss
by the whole group's count, whatever the sizes. ``divisor``: equal micro-batches, exact T where some
A in [A_min, 2 x A_min] divides it (16 x 16 for the same case), for the tools that run only equal
micro-batches (transformers' Trainer, Lightning, DeepSpeed).

    >>> p = plan(max_micro_batch=26, target_batch=256)
    >>> (p.micro_batch, p.accumulation_steps, p.micro_batches, p.exact)
    (26, 10, [(26, 6), (25, 4)], True)
    >>> p = plan(max_micro_batch=26, target_batch=256, policy="divisor")
    >>> (p.micro_batch, p.accumulation_steps, p.exact)
    (16, 16, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from autotune.schemas import Fit, MicroBatchCount, Plan

__all__ = [
    "DEFAULT_PLAN_POLICY",
    "EXACT_SEARCH_FACTOR",
    "MAX_ACCUMULATION_STEPS",
    "MAX_TARGET_BATCH",
    "PLAN_POLICIES",
    "PlanPolicy",
    "UnevenPlanWarning",
    "fit_affine",
    "micro_batch_for_limit",
    "nonnegative_fit",
    "micro_batches_text",
    "plan",
]

PLAN_POLICIES = ("balanced", "divisor")
PlanPolicy = Literal["balanced", "divisor"]
DEFAULT_PLAN_POLICY: PlanPolicy = "balanced"


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


def plan(
    max_micro_batch: int,
    target_batch: int,
    world_size: int = 1,
    *,
    max_accumulation_steps: int | None = None,
    multiple_of: int = 1,
    policy: PlanPolicy = DEFAULT_PLAN_POLICY,
) -> Plan:
    """Choose the micro-batches of one update so that their sum x world_size == target_batch.

    ``balanced``: A = A_min = ceil(T / (D x m_max)) micro-batches whose sizes differ by at most
    one (one multiple_of) and sum to T / D; exact whenever D x multiple_of divides T, and then no
    exact plan has fewer steps. Otherwise the nearest reachable effective batch (a multiple of
    D x multiple_of), split the same way, with the deviation stated in ``note``.

    ``divisor``: equal micro-batches m x A; exact when some A in [A_min, 2 x A_min] divides the
    per-replica batch; otherwise the nearest effective batch in that range, with the deviation
    stated in ``note``.

    Under both, no micro-batch exceeds max_micro_batch and each is a multiple of multiple_of.

    Args:
        max_micro_batch: the largest micro-batch that fits (m_max).
        target_batch: the effective batch T the recipe asks for.
        world_size: data-parallel replicas D (tensor/pipeline ranks are not replicas).
        max_accumulation_steps: optional cap on A for the divisor policy's exact search.
        multiple_of: every micro-batch must be a multiple of this (kernels, BatchNorm1d, ...).
        policy: ``"balanced"`` (default) or ``"divisor"``.

    Returns:
        A Plan: ``micro_batches`` as (size, count) pairs, ``micro_batch`` the largest size,
        ``exact`` whether the effective batch equals T.

    Raises:
        ValueError: non-positive or non-integer input, an unknown policy, T < D, max_micro_batch <
            multiple_of, or a target that would need more than MAX_ACCUMULATION_STEPS steps.
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
            return _make(target // (world * steps), steps, world, target, m_max, "")

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
    return _make(micro, steps, world, target, m_max, note)


def _balanced(m_max: int, target: int, world: int, unit: int, a_min: int) -> Plan:
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
    micro_batches: list[MicroBatchCount] = [(size, count) for size, count in pairs if count > 0 and size > 0]
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
    return _make_plan(micro_batches, world, target, m_max, note)


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


def _make(micro: int, steps: int, world: int, target: int, m_max: int, note: str) -> Plan:
    """An equal plan: steps micro-batches of micro on each replica."""
    return _make_plan([(micro, steps)], world, target, m_max, note)


def _make_plan(
    micro_batches: Sequence[tuple[int, int]], world: int, target: int, m_max: int, note: str
) -> Plan:
    """The Plan of (size, count) micro-batches per replica, largest first; micro_batch is the largest."""
    effective = sum(size * count for size, count in micro_batches) * world
    return Plan(
        micro_batch=micro_batches[0][0],
        accumulation_steps=sum(count for _, count in micro_batches),
        world_size=world,
        effective_batch=effective,
        target_batch=target,
        exact=effective == target,
        max_micro_batch=m_max,
        note=note,
        micro_batches=list(micro_batches),
    )


def fit_affine(points: Sequence[tuple[int, int]]) -> Fit | None:
    """Least-squares line peak_bytes = fixed + per_sample x m through (m, peak_bytes) points.

    Returns None with fewer than two distinct m. A negative slope (noise) is clamped to 0.
    """
    distinct = {m for m, _ in points}
    if len(distinct) < 2:
        return None
    n = len(points)
    mean_m = sum(m for m, _ in points) / n
    mean_p = sum(p for _, p in points) / n
    var = sum((m - mean_m) ** 2 for m, _ in points)
    cov = sum((m - mean_m) * (p - mean_p) for m, p in points)
    slope = max(0.0, cov / var)
    return Fit(fixed_bytes=mean_p - slope * mean_m, bytes_per_sample=slope)


def nonnegative_fit(fit: Fit | None) -> Fit | None:
    """The fit as a profile keeps it: memory at m = 0 is the weights, never negative; a least-squares
    line through convex points can cross below 0, and would then predict too little at small m."""
    if fit is None or fit.fixed_bytes >= 0:
        return fit
    return Fit(fixed_bytes=0.0, bytes_per_sample=fit.bytes_per_sample)


def micro_batch_for_limit(fit: Fit, limit_bytes: float, cap: int | None = None) -> int:
    """The largest m whose fitted peak is within limit_bytes (0 when even m=1 is over).

    Used for predictions on another device's budget and to guide the search.
    """
    if fit.bytes_per_sample <= 0:
        fits_at_all = fit.fixed_bytes <= limit_bytes
        return (cap if cap is not None else 2**24) if fits_at_all else 0
    # The epsilon absorbs least-squares rounding: a fit through exact points must land exactly.
    micro = math.floor((limit_bytes - fit.fixed_bytes) / fit.bytes_per_sample + 1e-9)
    micro = max(0, micro)
    if cap is not None:
        micro = min(micro, cap)
    return micro
