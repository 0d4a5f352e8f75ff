"""A small CNN with BatchNorm on 3x32x32 images, as a ProbeTask."""

from __future__ import annotations

import torch
from torch import nn

from autotune import ProbeTask

NUM_CLASSES = 10


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)
    )


class CNN(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            conv_block(3, width), conv_block(width, 2 * width), conv_block(2 * width, 4 * width)
        )
        self.head = nn.Linear(4 * width * 4 * 4, NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))


def make_batch(micro_batch: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(micro_batch, 3, 32, 32, generator=gen)
    labels = torch.randint(0, NUM_CLASSES, (micro_batch,), generator=gen)
    return images, labels


task = ProbeTask(
    name="cnn-bn",
    model=CNN,
    batch=lambda m: make_batch(m),
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    tags={"image_size": 32},
)
