"""The recommendation: the faster of two policies whose timings are given, plans priced from timed
runs, and the timed run itself (never the search's trials)."""

from __future__ import annotations

import pytest

from autotune.core.plan import plan
from autotune.core.recommend import Option, option_for, recommend, samples_per_second, update_seconds
from autotune.core.schemas import Throughput
from autotune.measure.meters import CpuMeter
from autotune.measure.strategies import Replicated
from autotune.measure.throughput import throughput_of, time_sizes
from autotune.orchestrate.probe import ProbeConfig, probe
from examples.gpt import GPTConfig, make_task
from tests.factories import make_profile

TINY = make_task(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2), name="gpt-tiny")


def timed(sizes: dict[int, float], step_seconds: float) -> Throughput:
    largest = max(sizes)
    return Throughput(
        micro_batch=largest,
        samples_per_second=largest / (sizes[largest] + step_seconds),
        seconds_per_update=sizes[largest] + step_seconds,
        micro_batches=[(largest, 1)],
        micro_batch_seconds=list(sizes.items()),
        step_seconds=step_seconds,
    )


def test_the_recommendation_picks_the_faster_of_two_policies_whose_timings_are_given() -> None:
    # none: m_max 10, T = 120 in 12 steps of 10 at 0.5 s (+0.2 s step) = 6.2 s an update.
    # full: m_max 40, 3 steps of 40 at 2.4 s (recomputation) = 7.4 s: fewer steps, slower.
    none = make_profile(max_micro_batch=10, seed=1).model_copy(
        update={"plan": plan(10, 120), "throughput": [timed({10: 0.5}, 0.2)]}
    )
    full = make_profile(max_micro_batch=24, seed=2).model_copy(
        update={"max_micro_batch": 40, "plan": plan(40, 120), "activation_checkpointing": "full",
                "throughput": [timed({40: 2.4}, 0.2)]}
    )  # fmt: skip
    options = [option_for(full), option_for(none)]
    best = recommend(options, "throughput")
    assert best.policy == "none" and best.samples_per_second == pytest.approx(120 / 6.2)
    assert recommend(options, "memory").policy == "full"  # the fewest steps
    # Cheaper recomputation per sample and full wins.
    full.throughput = [timed({40: 1.6}, 0.2)]
    assert recommend([option_for(full), option_for(none)], "throughput").policy == "full"


def test_a_plan_is_priced_from_its_timed_sizes_and_untimed_sizes_from_the_nearest() -> None:
    timing = timed({26: 1.3, 25: 1.25}, 0.5)
    assert update_seconds([timing], [(26, 6), (25, 4)]) == (pytest.approx(6 * 1.3 + 4 * 1.25 + 0.5), True)
    assert samples_per_second([timing], [(26, 6), (25, 4)], world_size=2) == (
        pytest.approx(2 * 256 / (6 * 1.3 + 4 * 1.25 + 0.5)),
        True,
    )
    seconds, exact = update_seconds([timing], [(13, 2)])  # type: ignore[misc]
    assert not exact and seconds == pytest.approx(2 * 1.25 * 13 / 25 + 0.5)
    assert update_seconds([], [(4, 1)]) is None


def test_untimed_options_come_after_timed_ones_and_ties_go_to_less_recomputation() -> None:
    untimed = Option("every-2", 20, ((20, 1),), 1, None)
    slow = Option("full", 40, ((40, 1),), 1, 1.0)
    assert recommend([untimed, slow]).policy == "full"
    tie = [Option("full", 40, ((40, 1),), 1, 5.0), Option("none", 10, ((10, 4),), 4, 5.0)]
    assert recommend(tie).policy == "none"
    with pytest.raises(ValueError, match="objective must be memory or throughput"):
        recommend(tie, "speed")


def test_a_timed_run_times_each_size_after_a_warm_up_and_the_profile_records_it() -> None:
    timings = time_sizes(TINY, CpuMeter(1 << 30), Replicated(1), [4, 3], repeats=3, min_seconds=0.0)
    assert timings.repeats == 3 and sorted(timings.per_size) == [3, 4]
    assert all(len(times) == 3 and min(times) > 0 for times in timings.per_size.values())
    rate = throughput_of(timings, [(4, 2), (3, 1)])
    # The profile keeps seconds to 7 decimals: within half of the last one, whatever the size.
    expected = 2 * timings.median(4) + timings.median(3) + timings.step_median
    assert rate.seconds_per_update == pytest.approx(expected, abs=5e-8)
    assert rate.samples_per_second == pytest.approx(11 / rate.seconds_per_update, rel=1e-3)
    # The probe times after its search, at m_max and at the plan's sizes; without the flag it does not.
    config = ProbeConfig(device="cpu", budget_bytes=2 << 20, target_batch=50, throughput=True)
    profile = probe(TINY, config)
    assert profile.plan is not None and profile.throughput is not None
    assert profile.throughput[0].micro_batches == [(profile.max_micro_batch, 1)]
    if list(profile.plan.micro_batches) != [(profile.max_micro_batch, 1)]:
        assert profile.throughput[1].micro_batches == profile.plan.micro_batches
    assert not ProbeConfig().throughput  # the library's probe times only when asked (the CLI asks)


def test_a_profile_whose_timings_contradict_it_is_refused() -> None:
    from autotune.core.consistency import profile_problems

    good = make_profile(max_micro_batch=10).model_copy(update={"throughput": [timed({10: 0.5}, 0.2)]})
    assert profile_problems(good) == []
    too_large = good.model_copy(update={"throughput": [timed({12: 0.5}, 0.2)]})
    assert [p.field for p in profile_problems(too_large)] == ["throughput.0.micro_batches"]
    wrong_rate = good.model_copy(
        update={"throughput": [timed({10: 0.5}, 0.2).model_copy(update={"samples_per_second": 99.0})]}
    )
    assert [p.field for p in profile_problems(wrong_rate)] == ["throughput.0.samples_per_second"]
    estimate = make_profile(max_micro_batch=10, source="estimate").model_copy(update={"throughput": good.throughput})
    assert [p.field for p in profile_problems(estimate)] == ["throughput.0"]
