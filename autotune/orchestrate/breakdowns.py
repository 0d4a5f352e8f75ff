"""Which trials' breakdowns a profile keeps (autotune/measure/breakdown.py records them): probe and estimate ask."""

from __future__ import annotations

from autotune.core.schemas import MemoryBreakdown
from autotune.orchestrate.config import ProbeConfig
from autotune.tasks.task import ProbeTask

__all__ = ["chosen_breakdowns"]


def chosen_breakdowns(
    recorded: dict[int, MemoryBreakdown] | None,
    task: ProbeTask,
    config: ProbeConfig,
    m_max: int,
    device_type: str,
    warnings: list[str],
) -> list[MemoryBreakdown] | None:
    """The breakdowns of the trials at m_max and the next size (autotune/measure/breakdown.py: recorded by the
    search's own trials, so their parts sum to the figures the profile stores; a pipeline's, its most loaded
    stage's), where config asks for them. A job whose trials are not broken down (a card's real trials; a compiled
    job's fake trials, which run it eager, or a compiled trial whose frees the profiler did not all see) says so in
    a warning."""
    if not config.breakdown or recorded is None:
        return None
    if device_type != "cpu":
        warnings.append("the peak is not broken down for a card's trials yet")
        return None
    found = [recorded[m] for m in (m_max, m_max + config.multiple_of) if m in recorded]
    if not found and task.compile is not None:
        warnings.append(
            "the peak is not broken down for this compiled job (fake trials run it eager; a compiled trial is broken "
            "down where the profiler saw each of its frees)"
        )
    return found or None
