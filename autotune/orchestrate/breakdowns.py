"""Which trials' breakdowns a profile keeps (autotune/measure/breakdown.py records them): probe and estimate ask."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from autotune.core.errors import AutotuneError
from autotune.core.schemas import MAX_BYTES, MemoryBreakdown
from autotune.measure.breakdown import BreakdownRecorder
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.trial import run_trial
from autotune.orchestrate.config import ProbeConfig
from autotune.tasks.task import ProbeTask

__all__ = ["chosen_breakdowns", "fake_breakdowns"]


def chosen_breakdowns(
    recorded: dict[int, MemoryBreakdown] | None,
    task: ProbeTask,
    config: ProbeConfig,
    m_max: int,
    device_type: str,
    warnings: list[str],
) -> list[MemoryBreakdown] | None:
    """The breakdowns of the trials at m_max and the next size (autotune/measure/breakdown.py: recorded by the
    search's own trials, so their parts sum to the figures the profile stores), where config asks for them. A job
    whose trials are not broken down yet (compiled, on a card, a pipeline's stages) says so in a warning."""
    if not config.breakdown or recorded is None:
        return None
    left_out = (
        "a compiled job"
        if task.compile is not None
        else "a card's trials"
        if device_type != "cpu"
        else "a pipeline's stages"
        if config.mesh.pp > 1
        else None
    )
    if left_out is not None:
        warnings.append(f"the peak is not broken down for {left_out} yet")
        return None
    found = [recorded[m] for m in (m_max, m_max + config.multiple_of) if m in recorded]
    return found or None


def fake_breakdowns(
    task: Any, strategy: Any, *, device_type: str, sizes: Iterable[int], limit_bytes: int
) -> list[MemoryBreakdown]:
    """The breakdown of a fake trial of task at each size (m_max, and the size above it): no budget, so a size
    that does not fit runs to its whole peak; each inside the strategy's process group, on a model of its own.
    A size that cannot run fake is left out (the caller says so)."""
    found: list[MemoryBreakdown] = []
    for micro_batch in sizes:
        meter = FakeMeter(MAX_BYTES, device_type)
        recorder = BreakdownRecorder()
        try:
            with strategy.process_group(meter.device), recorder.recording(meter):
                trial = run_trial(task, meter, micro_batch, limit_bytes=limit_bytes, strategy=strategy)
            breakdown = recorder.breakdown(micro_batch, trial.fits, trial.peak_bytes)
            if breakdown is not None:
                found.append(breakdown)
        except AutotuneError:
            continue
        finally:
            meter.close()
    return found
