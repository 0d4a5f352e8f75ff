"""The probe on the three examples at three budgets each, on the CPU meter: m_max, trials, OOMs, seconds.

    .venv/bin/python bench/search_table.py

The same cases as tests/autotune/test_probe.py (which checks m_max against an exhaustive search).
"""

from __future__ import annotations

import statistics
import time

from autotune.probe import ProbeConfig, probe
from autotune.task import load_task
from autotune.units import format_bytes

MiB = 1 << 20
CASES = [
    ("examples/mlp.py:task", 1.875),
    ("examples/mlp.py:task", 2),
    ("examples/mlp.py:task", 2.25),
    ("examples/gpt.py:task", 6),
    ("examples/gpt.py:task", 12),
    ("examples/gpt.py:task", 24),
    ("examples/cnn.py:task", 4),
    ("examples/cnn.py:task", 8),
    ("examples/cnn.py:task", 16),
]


def main() -> None:
    print("| model | budget | m_max | trials | OOMs | seconds |")
    print("|---|---|---|---|---|---|")
    trials = []
    for spec, budget_mib in CASES:
        task = load_task(spec)
        started = time.perf_counter()
        profile = probe(task, ProbeConfig(device="cpu", budget_bytes=int(budget_mib * MiB)))
        seconds = time.perf_counter() - started
        trials.append(profile.trial_count)
        print(
            f"| {task.name} | {format_bytes(profile.budget_bytes)} | {profile.max_micro_batch} | "
            f"{profile.trial_count} | {profile.oom_count} | {seconds:.2f} |"
        )
    print(f"\nmedian trials: {statistics.median(trials)}")


if __name__ == "__main__":
    main()
