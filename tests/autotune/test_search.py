"""The search policy, driven by synthetic trial functions ("fails above N") without torch work."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.core.schemas import Trial
from autotune.search.boundary import NoFitError, find_max_micro_batch


def memory_model(
    fixed: int, per_sample: int, limit: int, budget: int, *, step_peak: int = 0, round_to: int = 1
) -> Callable[[int], Trial]:
    """peak(m) = max(step_peak, fixed + per_sample x m), rounded up like an allocator's blocks."""

    def trial(m: int) -> Trial:
        forward_backward = -(-(fixed + per_sample * m) // round_to) * round_to
        peak = max(step_peak, forward_backward)
        oom = peak > budget
        return Trial(
            micro_batch=m,
            peak_bytes=min(peak, budget + 1),
            fits=not oom and peak <= limit,
            oom=oom,
            forward_backward_bytes=None if oom else forward_backward,
        )

    return trial


def truth(trial: Callable[[int], Trial], cap: int, multiple_of: int = 1) -> int:
    best = 0
    for m in range(multiple_of, cap + 1, multiple_of):
        if trial(m).fits:
            best = m
    return best


def test_affine_needs_few_trials_and_no_oom() -> None:
    trial = memory_model(1000, 37, limit=9000, budget=10000)
    result = find_max_micro_batch(trial, limit_bytes=9000)
    assert result.max_micro_batch == truth(trial, 4096) == 216
    assert len(result.trials) <= 5
    assert result.oom_count == 0
    assert result.fit is not None and result.fit.bytes_per_sample == pytest.approx(37)


def test_flat_step_peak_then_affine() -> None:
    # The optimizer step dominates small m: the whole-trial peak is flat there.
    trial = memory_model(7_000_000, 9000, limit=9_400_000, budget=10_000_000, step_peak=8_500_000)
    result = find_max_micro_batch(trial, limit_bytes=9_400_000)
    assert result.max_micro_batch == truth(trial, 4096)
    assert len(result.trials) <= 6


@settings(max_examples=150, deadline=None)
@given(
    fixed=st.integers(0, 10_000),
    per_sample=st.integers(1, 5_000),
    limit=st.integers(1, 2_000_000),
    round_to=st.sampled_from([1, 512, 4096, 65536]),
    multiple_of=st.sampled_from([1, 2, 8]),
    cap=st.sampled_from([64, 1000, 4096]),
)
def test_exact_on_every_monotone_curve(
    fixed: int, per_sample: int, limit: int, round_to: int, multiple_of: int, cap: int
) -> None:
    trial = memory_model(fixed, per_sample, limit=limit, budget=int(limit * 1.1) + 1, round_to=round_to)
    expected = truth(trial, cap, multiple_of)
    if expected == 0:
        with pytest.raises(NoFitError):
            find_max_micro_batch(trial, limit_bytes=limit, max_micro_batch=cap, multiple_of=multiple_of)
        return
    result = find_max_micro_batch(trial, limit_bytes=limit, max_micro_batch=cap, multiple_of=multiple_of)
    assert result.max_micro_batch == expected
    assert result.max_micro_batch % multiple_of == 0
    tried = {t.micro_batch: t.fits for t in result.trials}
    assert tried[expected] is True
    assert expected == cap - cap % multiple_of or tried.get(expected + multiple_of) is False
    assert len(result.trials) <= 25


def test_cap_is_honoured() -> None:
    trial = memory_model(10, 1, limit=10**9, budget=10**9)
    result = find_max_micro_batch(trial, limit_bytes=10**9, max_micro_batch=100)
    assert result.max_micro_batch == 100
    assert max(t.micro_batch for t in result.trials) == 100


def test_nothing_fits() -> None:
    trial = memory_model(10_000, 10, limit=5_000, budget=6_000)
    with pytest.raises(NoFitError) as info:
        find_max_micro_batch(trial, limit_bytes=5_000)
    assert info.value.trial.micro_batch == 1 and info.value.trial.oom


def test_bad_arguments() -> None:
    trial = memory_model(1, 1, limit=100, budget=100)
    with pytest.raises(ValueError, match="smaller than multiple_of"):
        find_max_micro_batch(trial, limit_bytes=100, max_micro_batch=4, multiple_of=8)
