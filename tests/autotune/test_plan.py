"""plan(): m x A x D == T when exact, never m > m_max, fewest steps first, clear errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.plan import EXACT_SEARCH_FACTOR, fit_affine, micro_batch_for_limit, plan
from autotune.schemas import Fit

sizes = st.integers(min_value=1, max_value=4096)


@settings(max_examples=300, deadline=None)
@given(m_max=sizes, target=st.integers(min_value=1, max_value=100_000), world=st.integers(1, 64))
def test_plan_properties(m_max: int, target: int, world: int) -> None:
    if target < world:
        with pytest.raises(ValueError, match="smaller than world_size"):
            plan(m_max, target, world)
        return
    p = plan(m_max, target, world)
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


def test_plan_examples() -> None:
    p = plan(8, 512, 4)
    assert (p.micro_batch, p.accumulation_steps, p.exact) == (8, 16, True)
    p = plan(10, 48, 1)  # 48 = 8 x 6 with A=6 is exact; A_min = 5 does not divide 48
    assert (p.micro_batch, p.accumulation_steps, p.exact) == (8, 6, True)
    p = plan(4, 7, 1)  # 7 is prime and 1 x 7 is outside the range: nearest, said plainly
    assert not p.exact and p.effective_batch in (6, 8) and "not reachable exactly" in p.note
    p = plan(64, 10, 4)  # 10 does not divide by 4 replicas
    assert not p.exact and p.effective_batch in (8, 12)


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
            plan(m_max, target, world, multiple_of=unit)
        return
    p = plan(m_max, target, world, multiple_of=unit)
    assert p.micro_batch % unit == 0 and p.micro_batch <= m_max
    assert p.exact == (p.micro_batch * p.accumulation_steps * world == target)


def test_huge_inputs_are_bounded_and_fast() -> None:
    with pytest.raises(ValueError, match="accumulation steps"):
        plan(1, 2**40 - 1)
    with pytest.raises(ValueError, match="larger than"):
        plan(64, 2**41)
    p = plan(64, 1_000_000_007)  # a prime: nearest plan, found by a bounded scan
    assert not p.exact and abs(p.deviation) < 64
    p = plan(100_000, 999_999_999_989)
    assert p.micro_batch <= 100_000


def test_a_plan_never_passes_the_largest_effective_batch() -> None:
    for args, kwargs in [((1, 2**40, 786_432), {}), ((8, 2**40 - 5, 3 * 2**18), {"multiple_of": 8})]:
        try:
            p = plan(*args, **kwargs)
        except ValueError as exc:  # a clean refusal, never a schema error
            assert "target_batch" in str(exc)
        else:
            assert p.effective_batch <= 2**40
