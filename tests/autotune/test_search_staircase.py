"""The CUDA search on a simulated caching allocator (no GPU here).

The H200 run (shared/gpu-runs/2026-11-30-h200-gpu_check.log) took 18 trials on the gpt example at a
2 GiB budget: the figure (max_memory_reserved plus memory outside the allocator) moves in steps,
because the allocator hands out memory in segments (20 MiB for mid-sized blocks, 2 MiB multiples for
large ones), and a line fitted to it keeps missing. The simulation below is fitted to those readings
near the boundary: m = 1195 ... 1212 all read 1.79 GiB (99.6 % of the 1.80 GiB limit), m = 1213
reads 1.81 GiB, about 0.82 MiB a sample of allocated memory (the run's fit), and ~796 MiB held outside
the allocator. The allocated bytes are smooth in m, the full figure is a staircase.
"""

from __future__ import annotations

import math

from autotune.core.schemas import Fit, Trial
from autotune.search.boundary import find_max_micro_batch, peaks_decrease

MiB = 1 << 20
BUDGET = 2048 * MiB
LIMIT = int(BUDGET * 0.9)  # 1843.2 MiB
PER_SAMPLE = 0.8237 * MiB  # the run's fit: 823.70 KiB a sample
ALLOCATED_FIXED = 33.3 * MiB
SLACK = 8 * MiB  # blocks cached and not reused within the trial
SEGMENT = 20 * MiB  # what the allocator reserves at a time for mid-sized blocks
OUTSIDE = int(795.8 * MiB)  # CUDA context and workspaces, outside the allocator
TRUE_M_MAX = 1212


def allocated(m: int) -> int:
    return int(ALLOCATED_FIXED + PER_SAMPLE * m)


def reserved(m: int) -> int:
    return math.ceil((allocated(m) + SLACK) / SEGMENT) * SEGMENT


def simulated_trial(log: list[int], bump: dict[int, int] | None = None):
    def trial(m: int) -> Trial:
        log.append(m)
        full = OUTSIDE + reserved(m) + (bump or {}).get(m, 0)
        return Trial(
            micro_batch=m,
            peak_bytes=full,
            fits=full <= LIMIT,
            forward_backward_bytes=full,
            allocated_bytes=allocated(m),
            outside_allocator_bytes=OUTSIDE,
        )

    return trial


def test_the_simulation_matches_the_h200_readings() -> None:
    full = {m: OUTSIDE + reserved(m) for m in (1195, 1203, 1208, 1212, 1213)}
    assert len({full[m] for m in (1195, 1203, 1208, 1212)}) == 1  # one stair
    assert abs(full[1212] / LIMIT - 0.996) < 0.001 and abs(full[1213] / LIMIT - 1.007) < 0.001
    truth = max(m for m in range(1, 2000) if OUTSIDE + reserved(m) <= LIMIT)
    assert truth == TRUE_M_MAX


def test_real_trials_alone_find_the_exact_m_in_fewer_trials_than_on_the_h200() -> None:
    log: list[int] = []
    result = find_max_micro_batch(simulated_trial(log), limit_bytes=LIMIT)
    print(f"real trials only: m={result.max_micro_batch} in {len(log)} trials: {log}")
    assert result.max_micro_batch == TRUE_M_MAX
    assert len(log) < 18


def test_with_the_fake_presearch_the_real_trials_start_at_its_answer_and_stay_few() -> None:
    # The fake trials see allocated bytes only; the probe takes what lives outside the allocator off
    # their limit, so their answer is the largest m whose allocated bytes fit beside it.
    fake_limit = LIMIT - OUTSIDE
    fake_m_max = max(m for m in range(1, 4096) if allocated(m) <= fake_limit)
    log: list[int] = []
    result = find_max_micro_batch(
        simulated_trial(log),
        limit_bytes=LIMIT,
        hint=fake_m_max,
        guide=Fit(fixed_bytes=ALLOCATED_FIXED, bytes_per_sample=PER_SAMPLE),
    )
    print(f"after a fake pre-search at {fake_m_max}: m={result.max_micro_batch} in {len(log)} real trials: {log}")
    assert result.max_micro_batch == TRUE_M_MAX
    assert log[0] == fake_m_max
    assert len(log) <= 6


def test_a_non_monotone_peak_is_detected_and_m_max_stays_below_the_first_failure() -> None:
    # cuDNN-like: one size needs a larger workspace than the sizes around it.
    log: list[int] = []
    bump = {m: 3 * SEGMENT for m in range(1100, 1213) if m % 7 == 0}
    result = find_max_micro_batch(simulated_trial(log, bump), limit_bytes=LIMIT)
    failed = [m for m in log if OUTSIDE + reserved(m) + bump.get(m, 0) > LIMIT]
    assert result.max_micro_batch < min(failed)
    assert result.max_micro_batch in log  # measured to fit
    trials = [simulated_trial([], bump)(m) for m in (1105, 1106, 1107)]
    pair = peaks_decrease(trials)
    assert pair is not None and (pair[0].micro_batch, pair[1].micro_batch) == (1106, 1107)
    assert peaks_decrease([simulated_trial([])(m) for m in (1, 500, 1212, 1213)]) is None
