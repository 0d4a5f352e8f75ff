"""The headroom rule has one home (autotune.core.units): the limit a peak is held to, budget x (1 - headroom),
rounded down to a whole byte where a trial is judged and unrounded where the server predicts with it."""

from __future__ import annotations

import doctest

import pytest

import autotune.core.units as units_module
from autotune.core.units import limit_bytes, limit_bytes_unrounded
from tests.factories import make_profile

BUDGETS = [1, 999, 3000, 8 << 20, 80 * 10**9, 141 * 2**30 + 12345]
HEADROOMS = [0.0, 0.05, 0.1, 1 / 3, 0.5, 0.999]


def test_the_doctests_hold() -> None:
    failures, tried = doctest.testmod(units_module)
    assert (failures, tried >= 3) == (0, True)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("headroom", HEADROOMS)
def test_the_limit_is_the_budget_less_its_headroom_rounded_down(budget: int, headroom: float) -> None:
    exact = budget - budget * headroom  # the same rule written another way (not the code under test)
    unrounded = limit_bytes_unrounded(budget, headroom)
    assert unrounded == pytest.approx(exact, rel=1e-12, abs=1e-9)
    assert limit_bytes(budget, headroom) == int(unrounded)
    assert isinstance(limit_bytes(budget, headroom), int)
    assert limit_bytes(budget, headroom) <= unrounded < limit_bytes(budget, headroom) + 1


def test_a_profile_states_the_same_limit() -> None:
    profile = make_profile(budget_bytes=80 * 2**30 + 7, headroom=0.1)
    assert profile.limit_bytes == limit_bytes(80 * 2**30 + 7, 0.1) == 77309411334
