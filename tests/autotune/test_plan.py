"""plan(): m x A x D == T when exact, never m > m_max, fewest steps first, clear errors; balanced
plans (the default) and divisor plans (equal micro-batches)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.core.plan import EXACT_SEARCH_FACTOR, fit_affine, micro_batch_for_limit, micro_batches_text, plan
from autotune.core.schemas import Fit

sizes = st.integers(min_value=1, max_value=4096)


@settings(max_examples=300, deadline=None)
@given(m_max=sizes, target=st.integers(min_value=1, max_value=100_000), world=st.integers(1, 64))
def test_divisor_plan_properties(m_max: int, target: int, world: int) -> None:
    if target < world:
        with pytest.raises(ValueError, match="smaller than world_size"):
            plan(m_max, target, world, policy="divisor")
        return
    p = plan(m_max, target, world, policy="divisor")
    assert p.micro_batches == [(p.micro_batch, p.accumulation_steps)]
    assert p.micro_batch >= 1 and p.micro_batch <= m_max
    assert p.effective_batch == p.micro_batch * p.accumulation_steps * world
    assert p.exact == (p.effective_batch == target)
    a_min = -(-target // (world * m_max))
    assert a_min <= p.accumulation_steps <= EXACT_SEARCH_FACTOR * a_min
    # No exact plan with fewer steps exists.
    for steps in range(1, p.accumulation_steps):
        micro, rest = divmod(target, world * steps)
        assert rest != 0 or micro > m_max
    if not p.exact:
        assert str(target) in p.note and "nearest" in p.note


def test_divisor_plan_examples() -> None:
    p = plan(8, 512, 4, policy="divisor")
    assert (p.micro_batch, p.accumulation_steps, p.exact) == (8, 16, True)
    p = plan(10, 48, 1, policy="divisor")  # 48 = 8 x 6 with A=6 is exact; A_min = 5 does not divide 48
    assert (p.micro_batch, p.accumulation_steps, p.exact) == (8, 6, True)
    p = plan(4, 7, 1, policy="divisor")  # 7 is prime and 1 x 7 is outside the range: nearest, said plainly
    assert not p.exact and p.effective_batch in (6, 8) and "not reachable exactly" in p.note
    p = plan(64, 10, 4, policy="divisor")  # 10 does not divide by 4 replicas
    assert not p.exact and p.effective_batch in (8, 12)
    p = plan(26, 256, policy="divisor")  # the case: equal micro-batches need 16 steps
    assert (p.micro_batch, p.accumulation_steps, p.micro_batches) == (16, 16, [(16, 16)])


def test_balanced_plan_examples() -> None:
    p = plan(26, 256)  # the default policy: 6 x 26 + 4 x 25 in 10 steps instead of 16 x 16
    assert (p.micro_batch, p.accumulation_steps, p.micro_batches, p.exact) == (26, 10, [(26, 6), (25, 4)], True)
    assert micro_batches_text(p.micro_batches, p.world_size) == "6×26 + 4×25 = 256 (10 steps)"
    p = plan(8, 512, 4, policy="balanced")  # all equal: one pair
    assert p.micro_batches == [(8, 16)] and p.exact
    p = plan(10, 48)
    assert (p.accumulation_steps, p.micro_batches) == (5, [(10, 3), (9, 2)])
    p = plan(4, 7)  # a prime target is exact now: 4 + 3
    assert p.exact and p.micro_batches == [(4, 1), (3, 1)]
    p = plan(64, 10, 4)  # 10 does not divide by 4 replicas: nearest, said plainly
    assert not p.exact and p.effective_batch in (8, 12) and "not reachable exactly" in p.note
    p = plan(26, 255, 2)
    assert not p.exact and p.effective_batch == 256 and "(3×26 + 2×25) × 2 = 256 (5 steps)" in p.note
    p = plan(26, 256, multiple_of=8)  # sizes differ by one unit of 8
    assert p.exact and p.micro_batches == [(24, 10), (16, 1)]
    with pytest.raises(ValueError, match="policy"):
        plan(26, 256, policy="round")  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    m_max=sizes,
    target=st.integers(min_value=1, max_value=100_000),
    world=st.integers(1, 64),
    unit=st.sampled_from([1, 1, 2, 3, 8]),
)
def test_balanced_plan_properties(m_max: int, target: int, world: int, unit: int) -> None:
    if target < world or m_max < unit:
        with pytest.raises(ValueError):
            plan(m_max, target, world, multiple_of=unit)
        return
    p = plan(m_max, target, world, multiple_of=unit)
    sizes_ = [size for size, _ in p.micro_batches]
    counts = [count for _, count in p.micro_batches]
    # Sizes <= m_max, multiples of multiple_of, within one unit of each other, largest first.
    assert all(1 <= size <= m_max and size % unit == 0 for size in sizes_)
    assert max(sizes_) - min(sizes_) <= unit and sizes_ == sorted(sizes_, reverse=True)
    assert p.micro_batch == max(sizes_) and sum(counts) == p.accumulation_steps and all(c >= 1 for c in counts)
    per_replica = sum(size * count for size, count in p.micro_batches)
    assert p.effective_batch == per_replica * world
    assert p.exact == (p.effective_batch == target)
    # Exact whenever it can be: D x multiple_of divides T.
    assert p.exact == (target % (world * unit) == 0)
    # The fewest steps: no plan of any kind with fewer steps reaches T.
    a_min = -(-target // (world * (m_max // unit) * unit))
    assert p.accumulation_steps == a_min if p.exact else p.accumulation_steps <= a_min
    if p.exact:
        assert (p.accumulation_steps - 1) * (m_max // unit) * unit * world < target
    else:
        assert abs(p.deviation) < world * unit and str(target) in p.note


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 8, 1), "max_micro_batch"),
        ((8, 0, 1), "target_batch"),
        ((8, 8, 0), "world_size"),
        ((8, -3, 1), "target_batch"),
        ((8, 2, 4), "smaller than world_size"),
        ((8, 8.5, 1), "target_batch"),
        ((True, 8, 1), "max_micro_batch"),
    ],
)
def test_plan_rejects_nonsense(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan(*args)


def test_fit_and_limit() -> None:
    fit = fit_affine([(1, 110), (2, 120), (4, 140)])
    assert fit is not None
    assert fit.fixed_bytes == pytest.approx(100)
    assert fit.bytes_per_sample == pytest.approx(10)
    assert micro_batch_for_limit(fit, 400) == 30
    assert micro_batch_for_limit(fit, 400, cap=16) == 16
    assert micro_batch_for_limit(fit, 50) == 0
    assert fit_affine([(3, 100)]) is None
    assert micro_batch_for_limit(Fit(fixed_bytes=10, bytes_per_sample=0), 20, cap=64) == 64


@settings(max_examples=200, deadline=None)
@given(
    m_max=sizes,
    target=st.integers(min_value=1, max_value=100_000),
    world=st.integers(1, 16),
    unit=st.sampled_from([1, 2, 8, 64]),
)
def test_micro_batch_respects_multiple_of(m_max: int, target: int, world: int, unit: int) -> None:
    if m_max < unit or target < world:
        with pytest.raises(ValueError):
            plan(m_max, target, world, multiple_of=unit, policy="divisor")
        return
    p = plan(m_max, target, world, multiple_of=unit, policy="divisor")
    assert p.micro_batch % unit == 0 and p.micro_batch <= m_max
    assert p.exact == (p.micro_batch * p.accumulation_steps * world == target)


def test_huge_inputs_are_bounded_and_fast() -> None:
    for policy in ("balanced", "divisor"):
        with pytest.raises(ValueError, match="accumulation steps"):
            plan(1, 2**40 - 1, policy=policy)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="larger than"):
            plan(64, 2**41, policy=policy)  # type: ignore[arg-type]
        p = plan(100_000, 999_999_999_989, policy=policy)  # type: ignore[arg-type]
        assert p.micro_batch <= 100_000
    p = plan(64, 1_000_000_007, policy="divisor")  # a prime: nearest plan, found by a bounded scan
    assert not p.exact and abs(p.deviation) < 64
    p = plan(64, 1_000_000_007, 3)  # balanced: the nearest multiple of 3, in A_min steps
    assert not p.exact and abs(p.deviation) < 3 and p.accumulation_steps == -(-1_000_000_008 // (3 * 64))


def test_a_plan_never_passes_the_largest_effective_batch() -> None:
    cases = [((1, 2**40, 786_432), {}), ((8, 2**40 - 5, 3 * 2**18), {"multiple_of": 8})]
    for (args, kwargs), policy in [(case, policy) for case in cases for policy in ("balanced", "divisor")]:
        try:
            p = plan(*args, **kwargs, policy=policy)  # type: ignore[arg-type]
        except ValueError as exc:  # a clean refusal, never a schema error
            assert "target_batch" in str(exc)
        else:
            assert p.effective_batch <= 2**40
