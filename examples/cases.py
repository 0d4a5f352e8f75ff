"""The budgets at which the examples are checked on the CPU meter: a small, a medium and a large
largest micro-batch for each. tests/autotune/test_probe.py (against an exhaustive search),
bench/search_table.py and bench/peers.py all use these."""

from __future__ import annotations

# (example name, budget in MiB); the task is examples/<name>.py:task
CPU_BUDGET_CASES: list[tuple[str, float]] = [
    ("mlp", 1.875),
    ("mlp", 2),
    ("mlp", 2.25),
    ("gpt", 6),
    ("gpt", 12),
    ("gpt", 24),
    ("cnn", 4),
    ("cnn", 8),
    ("cnn", 16),
]
HEADROOM = 0.10


def task_spec(name: str) -> str:
    return f"examples/{name}.py:task"
