"""A tiny Lightning job (an MLP on a fixed dataset, SGD) run for a few optimizer steps, used by the
Lightning callback's tests in one process and in each of 2 gloo processes under DDP."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SAMPLES = 256
TOKENS = 64  # each sample is a short sequence: activations, not weights, decide what fits
FEATURES = 32
CLASSES = 4
RECIPE_BATCH = 16  # per device: what the module's batch_size says
STEPS = 3  # optimizer updates
LR = 0.1
# The CPU budget of the local probe: the recipe's 16 per device does not fit in it, 4 does.
BUDGET = "2MiB"


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, TOKENS, FEATURES, generator=gen)
    return TensorDataset(x, x[:, 0, :CLASSES].argmax(dim=1))


class Classifier(LightningModule):
    def __init__(self, batch_size: int = RECIPE_BATCH) -> None:
        super().__init__()
        self.batch_size = batch_size
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES)
        )
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).mean(dim=1), y)
        self.log("train_loss", loss)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader[Any]:
        data = dataset()
        if torch.distributed.is_initialized():
            # In order, interleaved over the ranks (rank r: r, r + D, ...): an update of D ranks sees
            # the same samples as one process's batch of D times the size (Lightning's own sampler
            # would shuffle; the trainer runs with use_distributed_sampler=False).
            return DataLoader(data, batch_size=self.batch_size, sampler=DistributedSampler(data, shuffle=False))
        return DataLoader(data, batch_size=self.batch_size, shuffle=False)


def trainer(callbacks: list[Any], **kwargs: Any) -> Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": STEPS,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **kwargs,
    }
    return Trainer(callbacks=callbacks, **options)


def fit(module: Classifier, callbacks: list[Any], **kwargs: Any) -> Trainer:
    with warnings.catch_warnings():
        # Lightning's advice for real jobs (DataLoader workers, log intervals): not what is tested.
        warnings.filterwarnings("ignore", message=".*(num_workers|log_every_n_steps|does not have many workers).*")
        # Lightning's own use of a torch pytree API that this torch deprecates.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        t = trainer(callbacks, **kwargs)
        t.fit(module)
    return t


def update_losses(module: Classifier, accumulation_steps: int) -> list[float]:
    """The loss of each update: the mean over its equal micro-batches (the big batch's mean loss)."""
    losses, steps = module.losses, accumulation_steps
    return [sum(losses[i : i + steps]) / steps for i in range(0, len(losses), steps)]


def parameters(module: Classifier) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def ddp_env(rank: int, world_size: int, port: int) -> None:
    """The variables torchrun sets: Lightning then runs this process as one rank, launching nothing."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(world_size),
    )
