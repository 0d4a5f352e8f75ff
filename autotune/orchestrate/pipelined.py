"""The estimate of a pipeline-parallel job (``--pp N``) with CPU semantics: the pipeline's search
(autotune/search/pipelined.py, which the probe runs on real trials) on fake trials, the fake meter counting each
stage as the CPU meter does, with no storage. On an emulated card (``--gpu``) the emulated child runs the same
search with each stage's trial replayed through the caching allocator (autotune/emulation/card_pipeline.py).

The probe of a pipeline runs real trials only: the fake pre-search and the single-step case do not apply (every
step runs the schedule's K micro-batches).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from autotune.core import units
from autotune.core.schemas import Device, MemoryBreakdown, Profile, Trial
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.strategy_choice import make_strategy
from autotune.orchestrate.breakdowns import chosen_breakdowns
from autotune.orchestrate.config import EstimateConfig
from autotune.orchestrate.estimated import estimated_profile
from autotune.search.pipelined import search_pipeline
from autotune.tasks.task import ProbeTask

__all__ = ["estimate_pipeline"]


def estimate_pipeline(
    task: ProbeTask,
    config: EstimateConfig,
    device_type: str,
    device_name: str,
    warnings: list[str],
    on_trial: Callable[[Trial], None] | None = None,
) -> Profile:
    """The estimate of a pipeline-parallel job by fake trials of every stage (``task`` has the setup applied).

    Raises:
        NoFitError: not even multiple_of fits the most loaded stage.
        AutotuneError: a pipeline the composition table refuses (autotune/core/compositions.py).
    """
    setup = config.probe
    assert setup.budget_bytes is not None
    started = time.perf_counter()
    meter = FakeMeter(setup.budget_bytes, device_type, device_name)
    limit_bytes = units.limit_bytes(setup.budget_bytes, setup.headroom)
    breakdowns: dict[int, MemoryBreakdown] | None = {} if setup.breakdown else None
    result = search_pipeline(
        task,
        meter,
        setup.mesh,
        make_strategy(setup.strategy, setup.world_size, setup.mesh),
        limit_bytes,
        warnings,
        on_trial,
        max_micro_batch=setup.max_micro_batch,
        multiple_of=setup.multiple_of,
        extra_sizes=config.micro_batches,
        breakdowns=breakdowns,
    )
    device = Device(
        kind=config.device_kind, name=device_name, total_bytes=setup.budget_bytes, torch_version=torch.__version__
    )
    # Chosen before the profile is made: a job not broken down says so in the warnings the profile copies.
    breakdown = chosen_breakdowns(breakdowns, task, setup, result.max_micro_batch, device_type, warnings)
    profile = estimated_profile(
        task,
        config,
        device=device,
        max_micro_batch=result.max_micro_batch,
        trials=result.trials,
        fit=result.fit,
        warnings=warnings,
        started=started,
        torch_version=torch.__version__,
        breakdown=breakdown,
    )
    profile.pipeline = result.pipeline
    return profile
