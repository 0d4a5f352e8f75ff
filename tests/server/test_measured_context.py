"""autotune_server.measured_context: an estimate's trials and m_max re-derived with the memory outside the
allocator measured on its card, on hand-made trials (pure arithmetic, no database)."""

from __future__ import annotations

from dataclasses import replace

from autotune.core.schemas import DeviceContext, Fit
from autotune_server.candidates import Candidate
from autotune_server.measured_context import EstimateTrial, TrialFigure, for_candidate, rederive

MiB = 1 << 20
H200 = "NVIDIA H200"
ASSUMED = 800 * MiB
# Figures of 1900, 2000, 3000, 4200 and 4300 MiB with 800 MiB outside: m = 24 fits 4250 MiB, 25 does not.
RESERVED = {1: 1100 * MiB, 2: 1200 * MiB, 12: 2200 * MiB, 24: 3400 * MiB, 25: 3500 * MiB}
LIMIT = 4250 * MiB


def _trials(outside: int | None = ASSUMED, reserved: dict[int, int] | None = None) -> list[EstimateTrial]:
    return [
        EstimateTrial(m, r + (outside or 0), oom=False, outside_allocator_bytes=outside)
        for m, r in (reserved or RESERVED).items()
    ]


def _measured(outside_mib: int, *, profiles: int = 3, torch_version: str | None = "2.11") -> DeviceContext:
    figure = outside_mib * MiB
    return DeviceContext(
        device_name=H200,
        torch_version=torch_version,
        outside_allocator_bytes=figure,
        low_bytes=742 * MiB,
        high_bytes=max(figure, 877 * MiB),
        trials=5 * profiles,
        profiles=profiles,
    )


def test_more_outside_than_assumed_falls_to_the_largest_tested_size_that_still_fits() -> None:
    """876 MiB: m = 24 reads 4276 MiB, over; sizes 13 ... 23 were never run, so the answer is 12."""
    found = rederive(_trials(), max_micro_batch=24, limit_bytes=LIMIT, measured=_measured(876))
    assert found is not None
    assert found.max_micro_batch == 12
    assert found.trials[3] == TrialFigure(24, 3400 * MiB + 876 * MiB, fits=False, oom=False)
    assert [t.fits for t in found.trials] == [True, True, True, False, False]
    assert found.shift_bytes == 76 * MiB
    assert found.note == (
        "estimate re-derived with the 876.00 MiB outside the allocator measured on NVIDIA H200 (3 profiles, "
        "torch 2.11) instead of the estimate's 800.00 MiB: max micro-batch 12 (the estimate's 24)"
    )


def test_less_outside_than_assumed_rises_only_to_a_tested_size() -> None:
    """742 MiB: m = 25 reads 4242 MiB and now fits; it is the largest size tested, nothing above it is known."""
    found = rederive(_trials(), max_micro_batch=24, limit_bytes=LIMIT, measured=_measured(742, torch_version=None))
    assert found is not None
    assert found.max_micro_batch == 25
    assert all(t.fits for t in found.trials)
    assert found.shift_bytes == -58 * MiB
    assert "(3 profiles) instead of" in found.note  # any torch: none named


def test_the_cap_and_multiple_of_bound_the_answer() -> None:
    found = rederive(_trials(), max_micro_batch=24, limit_bytes=LIMIT, measured=_measured(742), micro_batch_cap=24)
    assert found is not None and found.max_micro_batch == 24  # 25 fits now, but is above the cap
    eights = {8: 1500 * MiB, 16: 2500 * MiB, 20: 2900 * MiB, 24: 3400 * MiB, 32: 3500 * MiB}
    found = rederive(
        _trials(reserved=eights), max_micro_batch=24, limit_bytes=LIMIT, measured=_measured(876), multiple_of=8
    )
    assert found is not None and found.max_micro_batch == 16  # 20 fits too, but is not a multiple of 8


def test_an_oom_trial_stays_a_failure() -> None:
    """The allocator model refused m = 25 (no figure, no outside bytes): less outside does not make it fit."""
    trials = [*_trials()[:4], EstimateTrial(25, 8 * 1024 * MiB, oom=True, outside_allocator_bytes=None)]
    found = rederive(trials, max_micro_batch=24, limit_bytes=LIMIT, measured=_measured(742))
    assert found is not None
    assert found.max_micro_batch == 24
    assert found.trials[4] == TrialFigure(25, 8 * 1024 * MiB, fits=False, oom=True)


def test_a_size_that_fits_above_the_first_failure_is_not_the_answer() -> None:
    """A staircase that is not monotone: m = 24 goes over with 876 MiB, m = 25 (a smaller figure) fits."""
    stairs = {**RESERVED, 25: 3300 * MiB}
    found = rederive(_trials(reserved=stairs), max_micro_batch=12, limit_bytes=LIMIT, measured=_measured(876))
    assert found is not None and found.max_micro_batch == 12
    assert found.trials[4].fits


def test_nothing_fits_is_m_max_zero_and_said() -> None:
    found = rederive(_trials(), max_micro_batch=24, limit_bytes=LIMIT, measured=_measured(4000))
    assert found is not None and found.max_micro_batch == 0
    assert found.note.endswith("instead of the estimate's 800.00 MiB: not even micro-batch 1 fits")


def test_nothing_to_re_derive() -> None:
    measured = _measured(876)
    # The figure assumed is the one measured.
    assert rederive(_trials(876 * MiB), max_micro_batch=24, limit_bytes=LIMIT, measured=measured) is None
    # No trial records what it assumed (CPU semantics), or one that ran does not.
    assert rederive(_trials(None), max_micro_batch=24, limit_bytes=LIMIT, measured=measured) is None
    partial = [*_trials()[:4], EstimateTrial(25, 4300 * MiB, oom=False, outside_allocator_bytes=None)]
    assert rederive(partial, max_micro_batch=24, limit_bytes=LIMIT, measured=measured) is None


def test_the_estimates_figures_when_they_differ() -> None:
    """One figure per estimate is what ``autotune estimate --gpu`` writes; several are named as a range and
    the shift is from the smallest (the fit rises by at least what any trial rose)."""
    trials = [t._replace(outside_allocator_bytes=ASSUMED + i * MiB) for i, t in enumerate(_trials())]
    found = rederive(trials, max_micro_batch=24, limit_bytes=LIMIT, measured=_measured(876))
    assert found is not None
    assert "instead of the estimate's 800.00 MiB to 804.00 MiB" in found.note
    assert found.shift_bytes == 76 * MiB


def _candidate(**changes: object) -> Candidate:
    trials = _trials()
    base = Candidate(
        id=7,
        fingerprint="ab" * 32,
        device_name=H200,
        budget_bytes=5000 * MiB,
        headroom=0.15,  # a limit of 4250 MiB
        max_micro_batch=24,
        micro_batch_cap=4096,
        multiple_of=1,
        fit=Fit(fixed_bytes=1800 * MiB, bytes_per_sample=100 * MiB),
        source="estimate",
        trials=tuple((t.micro_batch, t.peak_bytes, t.micro_batch <= 24, False) for t in trials),
        outside_allocator_bytes=tuple(t.outside_allocator_bytes for t in trials),
        measured_context=_measured(876),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_a_candidate_is_re_derived_with_its_fit() -> None:
    c = _candidate()
    rederived, note = for_candidate(c)
    assert note is not None and "max micro-batch 12" in note
    assert rederived.max_micro_batch == 12
    assert rederived.trials[2] == (12, 3076 * MiB, True, False)
    assert rederived.fit == Fit(fixed_bytes=1876 * MiB, bytes_per_sample=100 * MiB)
    assert (c.max_micro_batch, c.trials[2][1]) == (24, 3000 * MiB)  # the stored figures are left alone


def test_a_measurement_or_an_estimate_without_a_measured_context_is_left_alone() -> None:
    for c in (_candidate(source="measured"), _candidate(measured_context=None), _candidate(outside_allocator_bytes=())):
        assert for_candidate(c) == (c, None)
