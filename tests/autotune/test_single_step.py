"""A job that does not accumulate (A = 1; issue 33, item 8): one micro-batch, then the step. Its forwards hold
no gradient set, so it fits more than the accumulating job the probe's ordinary trial measures; where the
target can be met in one step (and a single step could hold it) the probe measures that case by trials of its own and
the plan uses it.

The truth is the CPU allocator's own count (torch.profiler's memory events, summed in order) of the model
built and trained the ordinary way with one micro-batch per step, written out below with no project code.
"""

from __future__ import annotations

import dataclasses
import gc
from functools import cache
from typing import Any

import pytest
from torch.profiler import ProfilerActivity, profile

from autotune.core.consistency import profile_problems
from autotune.core.plan import plan_profile
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.task import ProbeTask
from examples.gpt import GPTConfig, make_task
from tests.autotune._allocator_truth import allocator_peak_bytes

TINY = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=1)  # one block: a trial costs its ops
TASK = make_task(TINY)
# The size the budget is set at: between the single step's peak and the accumulating job's there.
M = 16


def single_step_peak_bytes(task: ProbeTask, micro_batch: int) -> int:
    """The CPU allocator's peak over the model built by its factory and two ordinary steps of one micro-batch."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = task.model()
        model.train()
        optimizer = task.make_optimizer(model.parameters())
        for _ in range(2):
            batch = task.batch(micro_batch)
            loss = task.compute_loss(model, batch)
            loss.backward()
            del batch, loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del model, optimizer
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@cache
def budget() -> int:
    """A budget the single step at M fits and the accumulating job at M does not (one gradient set apart)."""
    single, accumulating = single_step_peak_bytes(TASK, M), allocator_peak_bytes(TASK, M)
    assert single < accumulating
    return (single + accumulating) // 2


def _config(**changes: Any) -> ProbeConfig:
    return dataclasses.replace(
        ProbeConfig(device="cpu", budget_bytes=budget(), headroom=0, max_micro_batch=64), **changes
    )


def test_the_single_step_m_max_is_exact_against_the_allocator() -> None:
    # A target one step cannot hold at M + 1: the single-step search runs up to it and stops at M.
    profile_ = probe(TASK, _config(target_batch=M + 1))
    single = profile_.single_step
    assert single is not None and single.cap == M + 1
    m_max = single.max_micro_batch
    assert m_max == M and profile_.max_micro_batch < M  # one micro-batch more than the accumulating job
    at_max, past_max = single_step_peak_bytes(TASK, m_max), single_step_peak_bytes(TASK, m_max + 1)
    assert at_max <= budget() < past_max
    peaks = {t.micro_batch: t.peak_bytes for t in single.trials}
    assert peaks[m_max] == at_max and peaks[m_max + 1] == past_max
    assert not profile_problems(profile_)


def test_a_target_met_in_one_step_is_planned_without_accumulation() -> None:
    profile_ = probe(TASK, _config(target_batch=M))
    assert profile_.single_step is not None and profile_.single_step.cap == M
    plan = profile_.plan
    assert plan is not None and (plan.micro_batch, plan.accumulation_steps, plan.exact) == (M, 1, True)
    assert profile_.max_micro_batch < M and not profile_problems(profile_)
    assert any(f"target {M} is met without accumulation (A = 1)" in w for w in profile_.warnings)
    # The plan /suggest, the client and estimate make of the stored profile (autotune.core.plan.plan_profile).
    assert plan == plan_profile(profile_, M)
    # The datasheet's peak is the single-step trial's (within the limit), not the accumulating line's.
    from autotune.cli.report import datasheet

    single_peak = next(t.peak_bytes for t in profile_.single_step.trials if t.micro_batch == M)
    assert single_peak <= budget() and f"peak at m={M:<6d} " in datasheet(profile_)
    assert "one step)" in datasheet(profile_)


def test_a_target_one_step_cannot_hold_accumulates() -> None:
    profile_ = probe(TASK, _config(target_batch=M + 1))
    single = profile_.single_step
    assert single is not None and single.max_micro_batch == M and single.cap == M + 1
    plan = profile_.plan
    assert plan is not None and plan.accumulation_steps >= 2 and plan.micro_batch <= profile_.max_micro_batch
    assert any("the plan accumulates" in w for w in profile_.warnings)
    assert plan == plan_profile(profile_, M + 1)


def test_no_single_step_search_where_it_cannot_change_the_answer() -> None:
    # A target the accumulating trial already holds in one step: that trial, a gradient set heavier, bounds it.
    below = probe(TASK, _config(target_batch=4))
    assert below.single_step is None and below.plan is not None and below.plan.accumulation_steps == 1
    # No target: no plan depends on it, and the profile's m_max stays the accumulating job's.
    assert probe(TASK, _config()).single_step is None
    # A target whose activations alone, at the per-sample bytes the accumulating trials measured, are above
    # the limit: one gradient set less cannot make it fit.
    far = probe(TASK, _config(target_batch=512, max_micro_batch=512))
    assert far.single_step is None and far.plan is not None and far.plan.accumulation_steps >= 2
    # Gradients kept between steps: a single step's forward holds them too.
    keep = probe(dataclasses.replace(TASK, zero_grad="keep"), _config(target_batch=M + 1))
    assert keep.single_step is None


@pytest.mark.parametrize("micro_batch", [1, 7])
def test_the_single_step_trial_is_the_ordinary_one_micro_batch_loop(micro_batch: int) -> None:
    """The trial itself, away from any boundary: byte for byte the allocator's count."""
    from autotune.measure.meters.cpu import CpuMeter
    from autotune.measure.trial import TrialRunner

    runner = TrialRunner(TASK, CpuMeter(1 << 30), limit_bytes=1 << 30, accumulation=1, reuse_model=False)
    try:
        trial = runner(micro_batch)
    finally:
        runner.close()
    assert trial.peak_bytes == single_step_peak_bytes(TASK, micro_batch)


def test_an_estimate_says_it_has_no_single_step_figure() -> None:
    """Fake trials run the accumulating job only: where one step might hold the target the datasheet says the
    plan accumulates and a probe measures the single step (autotune estimate, autotune.cli.estimate)."""
    from autotune.cli.estimate import single_step_not_estimated
    from autotune.core.plan import plan
    from tests.factories import make_profile

    said = "fake trials estimate the accumulating job only"
    # m_max 24 (10 GiB + 2.5 GiB x m within 72 GiB); one step of 26 might hold: said, and planned accumulating.
    near = make_profile(max_micro_batch=24, source="estimate")
    near.plan = plan(24, 26)
    single_step_not_estimated(near)
    assert near.plan == plan_profile(near, 26) and near.plan.accumulation_steps == 2
    assert any(said in w and "micro-batch 26 per replica" in w for w in near.warnings)
    # The activations alone at 32 per replica (80 GiB by the fit) are over the limit; a one-step target within
    # m_max, and an inexact one (3 replicas, 77), need no word.
    for target, world in ((32, 1), (24, 1), (77, 3)):
        other = make_profile(max_micro_batch=24, source="estimate")
        other.plan = plan(24, target, world)
        single_step_not_estimated(other)
        assert not any(said in w for w in other.warnings), (target, world)


def test_an_estimate_proposes_no_single_step_its_own_figures_rule_out() -> None:
    """Issue 62, item 8: the advice proposed one step at "micro-batch 16 per replica" where m = 1 already held
    54.64 GiB of an 80 GiB card. A single step saves at most one gradient set (the breakdown's, 4 GiB here): at 16
    per replica the fit says 53 + 16 x 1.6 = 78.6 GiB, 74.6 GiB less the gradients, over the 72 GiB limit: no word.
    With gradients as large as the fit's fixed bytes, the same target is left said (the figures allow it)."""
    from autotune.cli.estimate import single_step_not_estimated
    from autotune.core.plan import plan
    from autotune.core.schemas import MemoryBreakdown
    from tests.factories import make_profile

    gib = 2**30

    def at_sixteen(gradients_bytes: int) -> list[str]:
        profile = make_profile(
            max_micro_batch=11, fixed_bytes=53 * gib, bytes_per_sample=1.6 * gib, budget_bytes=80 * gib,
            source="estimate",
        )  # fmt: skip
        peak = profile.peak_at(11)
        assert peak is not None
        profile.breakdown = [
            MemoryBreakdown(
                micro_batch=11, fits=True, peak_bytes=peak, parts={"gradients": gradients_bytes,
                "activations": peak - gradients_bytes}, peak_event=0, events=1, timeline=[[0]], phases=[],
            )
        ]  # fmt: skip
        profile.plan = plan(11, 16)
        single_step_not_estimated(profile)
        return [w for w in profile.warnings if "in one step (A = 1)" in w]

    assert at_sixteen(4 * gib) == []
    assert len(at_sixteen(53 * gib)) == 1
