"""autotune: measure the largest micro-batch that fits, and keep the effective batch.

The map (each package's ``__init__`` says what lives there and what it may import; arrows point down):

    cli/                 the commands; the only package that imports the server
      |
    fleet/               Ray tasks, a probe or a card's estimate each; the client for the sink's uploads
      |
    orchestrate/         probe, estimate, lengths, multi, a card's estimate: device(s) -> search -> plan -> Profile
      |
    emulation/           the emulated CUDA runtime for fake trials on a host without a card: the parent uses
      |                  core; its child process runs the search's fake trials (search, measure, tasks)
    search/              the search policy, the fake pre-search, fake lanes, the no-fit diagnosis
      |
    measure/   loop/     one trial on one device (meters, trial, strategies, policies, throughput);
      |          |       the training loop (accumulate, verify, the samplers; of measure, the OOM test only)
    tasks/ -------'      ProbeTask, hf: specs, the fingerprint, the batch walker
      |
    core/                torch-free: schemas, units, plan, consistency, curve, surface, recommend,
                         errors, the allocator model, the card catalog: all the server may import

Importing this package does not import torch (the service image has none): the public names below are
loaded on first use (``from autotune import probe, ProbeTask, Accumulator``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it (loaded on first access, PEP 562).
_PUBLIC = {
    "AutotuneError": "autotune.core.errors",
    "Profile": "autotune.core.schemas",
    "Plan": "autotune.core.schemas",
    "plan": "autotune.core.plan",
    "ProbeTask": "autotune.tasks.task",
    "load_task": "autotune.tasks.load",
    "probe": "autotune.orchestrate.probe",
    "ProbeConfig": "autotune.orchestrate.config",
    "estimate": "autotune.orchestrate.estimate",
    "EstimateConfig": "autotune.orchestrate.config",
    "probe_lengths": "autotune.orchestrate.lengths",
    "estimate_lengths": "autotune.orchestrate.lengths",
    "Accumulator": "autotune.loop.accumulate",
    "PlanBatchSampler": "autotune.loop.plan_sampler",
    "verify_gradients": "autotune.loop.verify",
    "verify_micro_batches": "autotune.loop.verify",
    "capacity": "autotune.core.capacity",
    "Capacity": "autotune.core.capacity",
    "CapacityError": "autotune.core.capacity",
    "LengthBatchSampler": "autotune.loop.sampler",
    "PackedRow": "autotune.loop.sampler",
    "with_options": "autotune.tasks.hf",
    "CpuMeter": "autotune.measure.meters.cpu",
    "parse_bytes": "autotune.core.units",
    "format_bytes": "autotune.core.units",
    "CannotFitError": "autotune.core.errors",
    "UnevenPlanWarning": "autotune.core.split",
}

__all__ = ["__version__", *sorted(_PUBLIC)]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
