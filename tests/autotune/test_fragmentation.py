"""The allocator's gap on the datasheet, from constructed CUDA profiles (no GPU needed)."""

from __future__ import annotations

from typing import Any

import pytest

from autotune.cli.report import datasheet
from autotune.core.schemas import Profile
from autotune.measure.fragmentation import LARGE_GAP_MIN_BYTES, expandable_segments_on, gap_advice, reserved_gap_at
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task
from tests.factories import make_profile

GiB = 1 << 30
MiB = 1 << 20
OUTSIDE = 600 * MiB  # the CUDA context and workspaces


def _cuda_profile(gap_bytes: int, *, expandable: bool | None = False) -> Profile:
    """The factory's profile (m_max 24 at 70 GiB) with the allocator's figures on its real trials:
    peak = reserved + outside, allocated = reserved - gap at every size."""
    base = make_profile()
    trials = [
        t.model_copy(update={"allocated_bytes": t.peak_bytes - OUTSIDE - gap_bytes, "outside_allocator_bytes": OUTSIDE})
        for t in base.trials
    ]
    data: dict[str, Any] = {**base.model_dump(), "trials": [t.model_dump() for t in trials]}
    data["expandable_segments"] = expandable
    data["reserved_gap_bytes"] = reserved_gap_at(trials, base.max_micro_batch)
    return Profile.model_validate(data)


def test_a_large_gap_is_said_with_the_setting_that_closes_it() -> None:
    profile = _cuda_profile(6 * GiB)
    assert profile.reserved_gap_bytes == 6 * GiB
    line = next(line for line in datasheet(profile).splitlines() if line.startswith("  fragmentation"))
    assert "6.00 GiB reserved but not allocated at m=24 (8.6% of its peak)" in line
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in line


def test_with_expandable_segments_on_the_gap_is_said_without_the_advice() -> None:
    advice = gap_advice(_cuda_profile(6 * GiB, expandable=True))
    assert advice is not None and "already on" in advice and "PYTORCH_CUDA_ALLOC_CONF" not in advice


@pytest.mark.parametrize("gap", [0, 2 * GiB, LARGE_GAP_MIN_BYTES - 1])
def test_a_small_gap_says_nothing(gap: int) -> None:
    # 2 GiB is 2.9 % of the 70 GiB peak: allocator rounding, not worth a setting.
    profile = _cuda_profile(gap)
    assert gap_advice(profile) is None
    assert "fragmentation" not in datasheet(profile)


def test_a_profile_without_allocator_figures_says_nothing() -> None:
    profile = make_profile()
    assert profile.reserved_gap_bytes is None and profile.expandable_segments is None
    assert reserved_gap_at(profile.trials, profile.max_micro_batch) is None
    assert gap_advice(profile) is None


def test_the_setting_is_read_from_either_variable() -> None:
    assert expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert expandable_segments_on({"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6,expandable_segments:true"})
    assert not expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})


def test_a_cpu_probe_records_neither() -> None:
    profile = probe(load_task("examples/mlp.py:task"), ProbeConfig(device="cpu", budget_bytes=4 * MiB))
    assert profile.expandable_segments is None and profile.reserved_gap_bytes is None
