"""Small ProbeTasks for the probe's own tests (the examples are used where realism matters)."""

from __future__ import annotations

import torch
from torch import nn

from autotune.task import ProbeTask


def linear_task(**overrides: object) -> ProbeTask:
    fields: dict = {
        "name": "linear",
        "model": lambda: nn.Linear(64, 8),
        "batch": lambda m: (torch.randn(m, 64), torch.randn(m, 8)),
    }
    fields.update(overrides)
    return ProbeTask(**fields)
