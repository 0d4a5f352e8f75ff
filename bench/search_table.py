"""The probe on the three examples at three budgets each, on the CPU meter: m_max, trials, OOMs, seconds.

    .venv/bin/python bench/search_table.py

The cases of examples/cases.py, which tests/autotune/test_probe.py checks against an exhaustive search.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from autotune.core.units import format_bytes
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task

# Run as a script, bench/ is on sys.path but the repo root (examples/) is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.cases import CPU_BUDGET_CASES, HEADROOM, task_spec  # noqa: E402

MiB = 1 << 20


def main() -> None:
    print("| model | budget | m_max | trials | OOMs | seconds |")
    print("|---|---|---|---|---|---|")
    trials = []
    for name, budget_mib in CPU_BUDGET_CASES:
        task = load_task(task_spec(name))
        started = time.perf_counter()
        profile = probe(task, ProbeConfig(device="cpu", budget_bytes=int(budget_mib * MiB), headroom=HEADROOM))
        seconds = time.perf_counter() - started
        trials.append(profile.trial_count)
        print(
            f"| {task.name} | {format_bytes(profile.budget_bytes)} | {profile.max_micro_batch} | "
            f"{profile.trial_count} | {profile.oom_count} | {seconds:.2f} |"
        )
    print(f"\nmedian trials: {statistics.median(trials)}")


if __name__ == "__main__":
    main()
