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

A job that does not accumulate (A = 1) holds no gradient set across a forward, so one step may hold more
than the accumulating m_max (``Profile.single_step``, measured by single-step trials of its own). Every
planner that reads a stored profile (the probe, /suggest, the client, ``autotune estimate``) goes through
:func:`plan_with_single_step`, so one profile and one target get one answer wherever they are asked:

    >>> p = plan_with_single_step(26, 32, single_step_max=40)
    >>> (p.micro_batch, p.accumulation_steps, p.max_micro_batch)
    (32, 1, 40)
    >>> p = plan_with_single_step(26, 41, single_step_max=40)
    >>> (p.micro_batch, p.accumulation_steps, p.max_micro_batch)
    (21, 2, 26)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autotune.core.schemas import Fit, Plan, Profile, Suggestion
from autotune.core.split import (
    DEFAULT_PLAN_POLICY,
    EXACT_SEARCH_FACTOR,
    LINEAR_SCAN,
    MAX_ACCUMULATION_STEPS,
    MAX_TARGET_BATCH,
    PLAN_POLICIES,
    PlanPolicy,
    UnevenPlanWarning,
    micro_batches_text,
    split,
)

__all__ = [
    "TargetError",
    "in_tokens",
    "sequences_for_tokens",
    "target_in_sequences",
    "DEFAULT_PLAN_POLICY",
    "EXACT_SEARCH_FACTOR",
    "LINEAR_SCAN",
    "MAX_ACCUMULATION_STEPS",
    "MAX_TARGET_BATCH",
    "PLAN_POLICIES",
    "PlanPolicy",
    "UnevenPlanWarning",
    "fit_affine",
    "micro_batch_for_limit",
    "nonnegative_fit",
    "micro_batches_text",
    "pipeline_plan",
    "plan",
    "is_single_step",
    "plan_profile",
    "plan_with_single_step",
    "single_step_size",
]


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
    micro_batches, note = split(
        max_micro_batch,
        target_batch,
        world_size,
        max_accumulation_steps=max_accumulation_steps,
        multiple_of=multiple_of,
        policy=policy,
    )
    return _make_plan(micro_batches, world_size, target_batch, max_micro_batch, note)


def single_step_size(
    max_micro_batch: int, target_batch: int, world_size: int, single_step_max: int | None, multiple_of: int = 1
) -> int | None:
    """The micro-batch of a one-step update (A = 1) that the single-step figure holds where the accumulating
    one does not, else None. The rule, the same for every target so that a target that changes between calls
    only moves along it: the target must be met exactly in one step (D divides T, multiple_of divides T / D),
    T / D must be above the accumulating m_max (at or below it the accumulating plan is one step already) and
    within the single step's m_max (measured by single-step trials up to their cap; above it nothing says a
    single step fits, and a plan with A >= 2 accumulates, so the accumulating m_max bounds it).

    >>> single_step_size(26, 64, 2, 40), single_step_size(26, 65, 2, 80), single_step_size(26, 82, 2, 40)
    (32, None, None)
    """
    if single_step_max is None or world_size < 1 or multiple_of < 1:
        return None
    per_replica, rest = divmod(target_batch, world_size)
    if rest or per_replica % multiple_of:
        return None
    return per_replica if max_micro_batch < per_replica <= single_step_max else None


def plan_with_single_step(
    max_micro_batch: int,
    target_batch: int,
    world_size: int = 1,
    *,
    single_step_max: int | None = None,
    max_accumulation_steps: int | None = None,
    multiple_of: int = 1,
    policy: PlanPolicy = DEFAULT_PLAN_POLICY,
) -> Plan:
    """The plan of a stored profile: one step of T / D (A = 1) where :func:`single_step_size` says the
    single-step figure holds it, else :func:`plan` from the accumulating ``max_micro_batch``.

    ``single_step_max``: the single step's m_max (``Profile.single_step.max_micro_batch``, or what is left of
    it under a stricter limit); None where there is none. A one-step plan's ``max_micro_batch`` is that figure
    and its ``note`` says which case applied (:func:`is_single_step` reads it back from the numbers).

    Raises:
        ValueError: as :func:`plan` does (the input is checked the same way in both cases).
    """
    accumulating = plan(
        max_micro_batch,
        target_batch,
        world_size,
        max_accumulation_steps=max_accumulation_steps,
        multiple_of=multiple_of,
        policy=policy,
    )
    size = single_step_size(max_micro_batch, target_batch, world_size, single_step_max, multiple_of)
    if size is None or single_step_max is None:
        return accumulating
    note = (
        f"one step per update (A = 1): micro-batch {size} per replica is within the single step's max micro-batch "
        f"{single_step_max} (measured without accumulation: its forwards hold no gradient set); an accumulating "
        f"job fits {max_micro_batch}"
    )
    return _make_plan([(size, 1)], world_size, target_batch, single_step_max, note)


def plan_profile(
    profile: Profile, target_batch: int, world_size: int = 1, *, policy: PlanPolicy = DEFAULT_PLAN_POLICY
) -> Plan:
    """:func:`plan_with_single_step` on a stored profile's own figures (its accumulating m_max, its
    single-step m_max where it has one, its multiple_of)."""
    single = profile.single_step
    return plan_with_single_step(
        profile.max_micro_batch,
        target_batch,
        world_size,
        single_step_max=single.max_micro_batch if single is not None else None,
        multiple_of=profile.multiple_of,
        policy=policy,
    )


def is_single_step(chosen: Plan, max_micro_batch: int) -> bool:
    """Whether a plan is the one-step case of :func:`plan_with_single_step`: one micro-batch above the
    accumulating m_max."""
    return chosen.accumulation_steps == 1 and chosen.micro_batch > max_micro_batch


def pipeline_plan(
    max_micro_batch: int,
    target_batch: int,
    data_parallel: int,
    *,
    stages: int,
    max_microbatches: int,
    min_microbatches: int = 1,
    multiple_of: int = 1,
    virtual_stages: int = 1,
) -> Plan:
    """The plan of a pipeline: m x K x D = T, where K, the micro-batches of one step, is the schedule's (the
    plan's accumulation steps) and D counts data-parallel replicas only.

    A stage's peak grows with K (GPipe holds all K micro-batches; every schedule keeps a receive buffer per
    micro-batch), so m_max holds for every K up to the K it was measured at (max_microbatches), and from
    min_microbatches (pp under 1F1B, where every stage needs one in flight). Exact plans first; among them the
    largest K, whose bubble (pp - 1) / (V K + pp - 1) is the smallest. Without an exact one, the nearest effective
    batch at the largest K, the deviation said in ``note``. With V virtual stages per rank (interleaved 1F1B),
    K is one the schedule runs: a multiple of its rounds, max(1, K // pp).

        >>> p = pipeline_plan(6, 64, 2, stages=2, max_microbatches=8, min_microbatches=2)
        >>> (p.micro_batch, p.accumulation_steps, p.world_size, p.exact)
        (4, 8, 2, True)
        >>> p = pipeline_plan(3, 64, 2, stages=2, max_microbatches=8, min_microbatches=2)
        >>> (p.micro_batch, p.accumulation_steps, p.effective_batch, p.exact)
        (3, 8, 48, False)

    Raises:
        ValueError: non-positive input, max_microbatches below min_microbatches, or max_micro_batch below
            multiple_of.
    """
    for name, value in (
        ("max_micro_batch", max_micro_batch),
        ("target_batch", target_batch),
        ("data_parallel", data_parallel),
        ("stages", stages),
        ("max_microbatches", max_microbatches),
        ("min_microbatches", min_microbatches),
        ("multiple_of", multiple_of),
        ("virtual_stages", virtual_stages),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_microbatches < min_microbatches:
        raise ValueError(f"micro-batches per step {max_microbatches} is below the schedule's least {min_microbatches}")
    largest = max_micro_batch - max_micro_batch % multiple_of
    if largest < 1:
        raise ValueError(f"max_micro_batch {max_micro_batch} is below multiple_of {multiple_of}")
    bubble = (
        "bubble (pp - 1) / (V K + pp - 1) = {:.3f}" if virtual_stages > 1 else "bubble (pp - 1) / (K + pp - 1) = {:.3f}"
    )
    for k in range(max_microbatches, min_microbatches - 1, -1):
        if virtual_stages > 1 and k % max(1, k // stages):
            continue
        per_step, rest = divmod(target_batch, k * data_parallel)
        if rest == 0 and per_step % multiple_of == 0 and multiple_of <= per_step <= largest:
            note = f"K = {k} micro-batches per step, " + bubble.format((stages - 1) / (virtual_stages * k + stages - 1))
            return _make_plan([(per_step, k)], data_parallel, target_batch, max_micro_batch, note)
    k = max_microbatches
    wanted = target_batch / (k * data_parallel)
    size = min(largest, max(multiple_of, round(wanted / multiple_of) * multiple_of))
    effective = size * k * data_parallel
    note = (
        f"no m x K x D equals target {target_batch} with m <= {max_micro_batch} and {min_microbatches} <= K <= "
        f"{max_microbatches}: effective batch {effective} ({size} x {k} x {data_parallel}); "
        + bubble.format((stages - 1) / (virtual_stages * k + stages - 1))
    )
    return _make_plan([(size, k)], data_parallel, target_batch, max_micro_batch, note)


def _make_plan(micro_batches: Sequence[tuple[int, int]], world: int, target: int, m_max: int, note: str) -> Plan:
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


class TargetError(ValueError):
    """A target that cannot be planned; ``field`` names the parameter at fault (the API's 422 says it)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def target_in_sequences(
    target_batch: int | None,
    target_tokens: int | None,
    seq_len: int | None,
    world_size: int,
    *,
    required: bool = True,
) -> tuple[int | None, str | None]:
    """The target of an update in sequences: target_batch, or target_tokens over seq_len (see
    :func:`sequences_for_tokens`), and what to say where the tokens are not a whole number of
    sequences. The one decision the CLI, the client and the server make alike.

    Raises:
        TargetError: a value that is not a positive integer, both targets, neither where one is
            required, or tokens without a length.

    >>> target_in_sequences(None, 65536, 512, 4)
    (128, None)
    >>> target_in_sequences(None, None, None, 1, required=False)
    (None, None)
    """
    for name, value in (("target_batch", target_batch), ("target_tokens", target_tokens), ("seq_len", seq_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TargetError(f"{name} must be a positive integer, got {value!r}", name)
    if target_tokens is None:
        if target_batch is None and required:
            raise TargetError(
                "give target_batch (sequences per update) or target_tokens (tokens per update)", "target_batch"
            )
        return target_batch, None
    if target_batch is not None:
        raise TargetError(
            "give target_batch (sequences per update) or target_tokens (tokens per update), not both", "target_tokens"
        )
    if seq_len is None:
        raise TargetError("target_tokens needs seq_len: tokens are planned in sequences of a length", "seq_len")
    return sequences_for_tokens(target_tokens, seq_len, world_size)


def in_tokens(answer: Suggestion, seq_len: int | None, target_tokens: int | None, note: str | None) -> Suggestion:
    """A suggestion in tokens too, for a job with a length, with the note of an uneven token target."""
    if seq_len is not None:
        answer.seq_len = seq_len
        answer.tokens_per_micro_batch = answer.micro_batch * seq_len
        answer.tokens_per_update = answer.effective_batch * seq_len
    answer.target_tokens = target_tokens  # None where the job asked in sequences, whatever came before
    if note and note not in answer.warnings:
        answer.warnings.append(note)
    return answer


def sequences_for_tokens(target_tokens: int, seq_len: int, world_size: int = 1) -> tuple[int, str | None]:
    """A target in tokens per update as a target batch in sequences of seq_len, and what to say when
    the tokens are not a whole number of sequences: the nearest count (ties down), never fewer than
    world_size (every replica needs one sequence).

    >>> sequences_for_tokens(1 << 20, 512, 8)
    (2048, None)
    >>> sequences_for_tokens(1 << 20, 1000, 8)[0]
    1049
    """
    if target_tokens < 1 or seq_len < 1:
        raise ValueError(f"target_tokens and seq_len must be positive, got {target_tokens} and {seq_len}")
    sequences = max(world_size, (target_tokens + (seq_len - 1) // 2) // seq_len)
    if sequences * seq_len == target_tokens:
        return sequences, None
    return sequences, (
        f"target {target_tokens} tokens is not a multiple of seq_len {seq_len}"
        + (f" x world size {world_size}" if world_size > 1 else "")
        + f": planned in sequences, {sequences} of them = {sequences * seq_len} tokens per update"
    )
