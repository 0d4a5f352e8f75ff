"""Small ProbeTasks for the probe's own tests (the examples are used where realism matters)."""

from __future__ import annotations

import torch
from torch import nn

from autotune.tasks.task import ProbeTask


def linear_task(**overrides: object) -> ProbeTask:
    fields: dict = {
        "name": "linear",
        "model": lambda: nn.Linear(64, 8),
        "batch": lambda m: (torch.randn(m, 64), torch.randn(m, 8)),
    }
    fields.update(overrides)
    return ProbeTask(**fields)


def assert_profile_contract(data: dict) -> None:
    """The keys docs/design.md's "Contracts" promises in a Profile's JSON (other tools depend on them)."""
    top = {"fingerprint", "task", "device", "budget_bytes", "headroom", "max_micro_batch", "plan", "trials", "fit"}
    assert top <= set(data), top - set(data)
    assert set(data["device"]) >= {"kind", "name", "index", "total_bytes"}
    if data["plan"] is not None:
        assert set(data["plan"]) >= {"micro_batch", "accumulation_steps", "world_size", "effective_batch", "exact"}
    assert set(data["trials"][0]) >= {"micro_batch", "peak_bytes", "fits", "oom", "seconds"}
    assert set(data["fit"]) == {"fixed_bytes", "bytes_per_sample"}
