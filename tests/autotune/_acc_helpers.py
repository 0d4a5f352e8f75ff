"""Factories and gradient helpers shared by the accumulation, verify and DDP tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from autotune.loop.accumulate import Accumulator
from examples import gpt

LossSum = Callable[[nn.Module, Any], tuple[torch.Tensor, int]]


def concat(batches: list[Any]) -> Any:
    """Concatenate micro-batches (tensors or dict/tuple/list of tensors) along dim 0."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, Mapping):
        return {key: concat([b[key] for b in batches]) for key in first}
    return type(first)(concat([b[i] for b in batches]) for i in range(len(first)))


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def max_relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Worst over parameters of ||got - want|| / ||want||."""
    assert got.keys() == want.keys()
    return max(float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)) for k in want)


def full_batch_grads(model: nn.Module, batch: Any, loss: Callable[[nn.Module, Any], torch.Tensor]) -> dict:
    model.zero_grad(set_to_none=True)
    loss(model, batch).backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def mean_of_means_grads(model: nn.Module, micro_batches: list[Any], mean_loss: Callable) -> dict:
    """The classic mistake: backward(mean loss of each micro-batch / A)."""
    model.zero_grad(set_to_none=True)
    for batch in micro_batches:
        (mean_loss(model, batch) / len(micro_batches)).backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def accumulated_grads(
    model: nn.Module,
    micro_batches: Iterable[Any],
    *,
    loss_sum: LossSum | None = None,
    mean_loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    count: Callable[[Any], Any] | None = None,
    accumulation_steps: int | None = None,
) -> dict[str, torch.Tensor]:
    """Gradient of one group accumulated by the Accumulator, read just before its step (lr=0)."""
    micro_batches = list(micro_batches)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = Accumulator(model, opt, accumulation_steps=accumulation_steps or len(micro_batches))
    captured: dict[str, torch.Tensor] = {}
    for group in acc.groups(micro_batches, count=count):
        for batch in group:
            with acc.micro_step():
                if loss_sum is not None:
                    total, n = loss_sum(model, batch)
                    acc.backward(total, count=n)
                else:
                    assert mean_loss is not None
                    acc.backward_mean(mean_loss(model, batch))
        captured = grads(model)
        acc.step()
    return captured


def gpt_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"] != gpt.IGNORE_INDEX).sum()


def mse_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    x, y = batch
    return F.mse_loss(model(x), y, reduction="sum"), y.numel()


def mse_mean(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def ce_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum"), y.numel()


def ce_mean(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def gpt_micro_batches(n: int, micro_batch: int, *, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """n variable-length padded micro-batches with different supervised-token counts."""
    return [gpt.make_batch(micro_batch, seed=seed + i, variable_lengths=True) for i in range(n)]
