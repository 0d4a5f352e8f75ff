"""The probe end to end on the CPU meter: the chosen m is the exact largest fitting m."""

from __future__ import annotations

import gc
import statistics

import pytest

from autotune.core.errors import AutotuneError, BudgetError
from autotune.measure.meters import CpuMeter
from autotune.measure.trial import run_trial
from autotune.orchestrate.probe import ProbeConfig, probe, probe_with_meter
from autotune.tasks.load import load_task
from examples.cases import CPU_BUDGET_CASES, HEADROOM, task_spec
from tests.autotune._tasks import assert_profile_contract

MiB = 1 << 20
CASES = [(task_spec(name), budget_mib) for name, budget_mib in CPU_BUDGET_CASES]


def exhaustive_max(spec: str, budget_bytes: int, upto: int) -> int:
    """Every m from 1 to upto, with the same meter: the largest that fits."""
    task = load_task(spec)
    meter = CpuMeter(budget_bytes)
    limit = int(budget_bytes * (1 - HEADROOM))
    best = 0
    freeze = gc.get_freeze_count() == 0  # as the probe does: a trial's collection walks only its own
    if freeze:
        gc.freeze()
    try:
        for m in range(1, upto + 1):
            if run_trial(task, meter, m, limit_bytes=limit).fits:
                best = m
    finally:
        if freeze:
            gc.unfreeze()
    return best


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "budget_mib"), CASES)
def test_probe_matches_exhaustive_search(spec: str, budget_mib: float) -> None:
    budget = int(budget_mib * MiB)
    profile = probe(load_task(spec), ProbeConfig(device="cpu", budget_bytes=budget, headroom=HEADROOM))
    found = profile.max_micro_batch
    assert exhaustive_max(spec, budget, found + 3) == found
    real = [t for t in profile.trials if not t.fake]
    # The fake pre-search finds the boundary; the real trials confirm m and m + 1.
    assert profile.trial_count == len(real) == 2


def test_median_trials_at_most_five_with_real_trials_only() -> None:
    # The search the probe falls back to where the fake pre-search cannot run.
    counts = []
    for spec, budget_mib in CASES:
        config = ProbeConfig(device="cpu", budget_bytes=int(budget_mib * MiB), presearch=False)
        profile = probe(load_task(spec), config)
        assert not any(t.fake for t in profile.trials)
        counts.append(profile.trial_count)
    assert statistics.median(counts) <= 5, counts


def test_profile_contract_and_plan() -> None:
    profile = probe(
        load_task("examples/cnn.py:task"),
        ProbeConfig(device="cpu", budget_bytes=4 * MiB, target_batch=64, world_size=2),
    )
    data = profile.model_dump(mode="json")
    assert_profile_contract(data)
    plan = profile.plan
    assert plan is not None and plan.micro_batch <= profile.max_micro_batch
    assert plan.micro_batch * plan.accumulation_steps * 2 == 64 and plan.exact
    assert any("BatchNorm" in w for w in profile.warnings)


def test_budget_too_small_says_what_weights_take() -> None:
    with pytest.raises(BudgetError, match=r"weights, gradients and optimizer state alone take \d+ bytes"):
        probe(load_task("examples/gpt.py:task"), ProbeConfig(device="cpu", budget_bytes=1 * MiB))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ProbeConfig(device="cpu", budget_bytes=MiB, target_batch=2, world_size=4), "smaller than world-size"),
        (ProbeConfig(device="cpu", budget_bytes=MiB, headroom=1.5), "headroom"),
        (ProbeConfig(device="cpu", budget_bytes=MiB, multiple_of=8, max_micro_batch=4), "multiple-of"),
        (ProbeConfig(device="cpu"), "needs a budget"),
        (ProbeConfig(device="cpu", budget_bytes=MiB, precision="fp8"), "precision"),
    ],
)
def test_bad_configuration(config: ProbeConfig, message: str) -> None:
    with pytest.raises(AutotuneError, match=message):
        probe(load_task("examples/mlp.py:task"), config)


def test_multiple_of_and_cap() -> None:
    task = load_task("examples/gpt.py:task")
    meter = CpuMeter(24 * MiB)
    profile = probe_with_meter(task, meter, ProbeConfig(device="cpu", budget_bytes=24 * MiB, multiple_of=8))
    assert profile.max_micro_batch == 24  # 26 fits, 32 does not: the largest multiple of 8 is 24
    assert all(t.micro_batch % 8 == 0 for t in profile.trials)
    capped = probe_with_meter(task, meter, ProbeConfig(device="cpu", budget_bytes=24 * MiB, max_micro_batch=10))
    assert capped.max_micro_batch == 10
    assert any("cap" in w for w in capped.warnings)
