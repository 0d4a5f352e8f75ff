"""autotune.core.capacity: L -> m_max(L) from the profiles of one run over lengths (torch-free)."""

from __future__ import annotations

import copy
import doctest
import subprocess
import sys
from typing import Any

import pytest

import autotune.core.capacity as capacity_module
from autotune.core.capacity import Capacity, CapacityError, capacity
from autotune.core.schemas import Profile
from autotune.core.surface import PeakSurface
from tests.factories import make_profile, surface_gpt_payloads

# The real probe of examples/gpt.py:task_seq under 64 MiB (tests/data/surface_gpt.json).
MEASURED = {128: 36, 256: 18, 512: 9}
LIMIT = int(64 * 2**20 * 0.9)


@pytest.fixture
def payloads() -> list[dict[str, Any]]:
    return surface_gpt_payloads()


def test_measured_lengths_answer_their_own_m_max(payloads: list[dict[str, Any]]) -> None:
    cap = capacity(payloads)
    assert {length: cap(length) for length in MEASURED} == MEASURED
    assert cap.measured == MEASURED
    assert cap.covered == (128, 2048)


def test_between_the_surface_answers_and_its_answer_fits(payloads: list[dict[str, Any]]) -> None:
    cap = capacity(payloads)
    surface = PeakSurface.from_dict(payloads[0]["surface"])
    for length in (129, 200, 384, 700, 1000, 1500, 2048):
        m = cap(length)
        assert m >= 1
        assert surface.peak_bytes(m, length) <= LIMIT, length
        assert m == min(surface.max_fitting(LIMIT, length, cap=4096), max(v for k, v in MEASURED.items() if k < length))


def test_capacity_never_grows_with_the_length(payloads: list[dict[str, Any]]) -> None:
    cap = capacity(payloads)
    answers = [cap(length) for length in range(1, 2049)]
    assert all(a >= b for a, b in zip(answers, answers[1:], strict=False))


def test_shorter_than_covered_answers_as_the_shortest(payloads: list[dict[str, Any]]) -> None:
    cap = capacity(payloads)
    assert cap(1) == cap(64) == cap(128) == 36


def test_longer_than_covered_is_one_line_naming_the_cover(payloads: list[dict[str, Any]]) -> None:
    cap = capacity(payloads)
    with pytest.raises(CapacityError) as caught:
        cap(2049)
    message = str(caught.value)
    assert "\n" not in message
    assert "2049" in message and "128..2048" in message
    assert caught.value.seq_len == 2049 and caught.value.longest == 2048
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "128", None])
def test_a_length_that_is_not_a_positive_integer_is_refused(payloads: list[dict[str, Any]], bad: Any) -> None:
    with pytest.raises(CapacityError, match="positive integer"):
        capacity(payloads)(bad)


def test_profiles_or_their_json_give_the_same_capacity(payloads: list[dict[str, Any]]) -> None:
    from_json = capacity(payloads)
    from_models = capacity(Profile.model_validate(p) for p in payloads)
    assert [from_json(length) for length in range(100, 2049, 37)] == [
        from_models(length) for length in range(100, 2049, 37)
    ]
    # One profile of the run is enough: exact at its length, the surface elsewhere.
    alone = capacity(payloads[1:2])
    assert alone(256) == 18 and alone.measured == {256: 18}
    assert alone(2048) == from_json(2048)


def test_the_offset_the_device_showed_lowers_the_surface_answer(payloads: list[dict[str, Any]]) -> None:
    shifted = copy.deepcopy(payloads)
    surface = PeakSurface.from_dict(payloads[0]["surface"])
    offset = surface.peak_bytes(13, 384) - surface.peak_bytes(12, 384)  # one sample's worth at L = 384
    for body in shifted:
        body["surface"]["offset_bytes"] = offset
    assert capacity(shifted)(384) == capacity(payloads)(384) - 1
    assert capacity(shifted)(256) == 18  # measured: the trials already include it


def test_a_run_without_a_surface_answers_from_its_measured_lengths(payloads: list[dict[str, Any]]) -> None:
    plain = copy.deepcopy(payloads)
    for body in plain:
        body["surface"] = None
    cap = capacity(plain)
    assert cap.covered == (128, 512)
    assert (cap(100), cap(128), cap(200), cap(256), cap(300), cap(512)) == (36, 36, 18, 18, 9, 9)
    with pytest.raises(CapacityError, match="128..512"):
        cap(513)


def test_no_profiles_is_refused() -> None:
    with pytest.raises(CapacityError, match="run over lengths"):
        capacity([])


def test_a_profile_that_is_not_sequence_aware_is_refused() -> None:
    with pytest.raises(CapacityError, match="has no seq_len"):
        capacity([make_profile()])


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("budget_bytes", 32 * 2**20, "budget_bytes"),
        ("headroom", 0.2, "headroom"),
        ("fingerprint", "f" * 64, "fingerprint"),
    ],
)
def test_profiles_of_different_runs_are_refused(
    payloads: list[dict[str, Any]], field: str, value: Any, named: str
) -> None:
    other = copy.deepcopy(payloads)
    other[2][field] = value
    with pytest.raises(CapacityError, match=f"not of one run over lengths: their {named} differ"):
        capacity(other)


def test_another_surface_is_another_run(payloads: list[dict[str, Any]]) -> None:
    other = copy.deepcopy(payloads)
    other[0]["surface"]["covered"] = [128, 1024]
    with pytest.raises(CapacityError, match="their surface differ"):
        capacity(other)


def test_two_answers_at_one_length_are_refused(payloads: list[dict[str, Any]]) -> None:
    twice = [*payloads, copy.deepcopy(payloads[0])]
    assert capacity(twice)(128) == 36  # the same profile twice is fine
    twice[-1]["max_micro_batch"] = 35
    twice[-1]["plan"] = None
    with pytest.raises(CapacityError, match="disagree"):
        capacity(twice)


def test_the_doctest_holds() -> None:
    result = doctest.testmod(capacity_module)
    assert result.attempted >= 3 and result.failed == 0


def test_it_is_a_plain_value() -> None:
    cap = capacity(surface_gpt_payloads())
    assert isinstance(cap, Capacity)
    assert "Capacity(shortest=128, longest=2048" in repr(cap)


def test_importing_it_does_not_import_torch() -> None:
    code = (
        "import sys, autotune.core.capacity as c; from tests.factories import surface_gpt_payloads; "
        "print(c.capacity(surface_gpt_payloads())(300), 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == [str(capacity(surface_gpt_payloads())(300)), "False"]
