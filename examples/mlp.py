"""A plain MLP regression task (mean squared error), as a ProbeTask.

Wide inputs and a narrow hidden layer keep the largest micro-batch in the tens on a few MiB, so
the tests can afford an exhaustive search beside the probe.
"""

from __future__ import annotations

import torch
from torch import nn

from autotune import ProbeTask

IN_FEATURES = 1024
HIDDEN = 64
OUT_FEATURES = 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(IN_FEATURES, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, OUT_FEATURES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_batch(micro_batch: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(micro_batch, IN_FEATURES, generator=gen), torch.randn(micro_batch, OUT_FEATURES, generator=gen)


task = ProbeTask(name="mlp", model=MLP, batch=lambda m: make_batch(m))
