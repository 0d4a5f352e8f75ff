"""The optimizers of the optimizer specs written out the ordinary way, as a training script builds them: torch's,
bitsandbytes' or transformers' own constructor, not the project's spec (the truths of test_optimizer_specs.py).

Module-level and keyed by the spec's text, so that a spawned rank (tests/autotune/_fsdp_mp_truth.py) is handed the
key and builds the same optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _adamw_foreach_false(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, foreach=False)


def _adamw_fused(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, fused=True)


def _adafactor(params: Any) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False, warmup_init=False)


def _adamw8bit(params: Any) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params)  # type: ignore[no-any-return]


def _adamw4bit(params: Any) -> torch.optim.Optimizer:
    from torchao.optim import AdamW4bit

    return AdamW4bit(params)  # type: ignore[no-any-return]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params)


# spec -> the optimizer written out the ordinary way.
ORDINARY: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "torch.optim.AdamW:foreach=false": _adamw_foreach_false,
    "torch.optim.AdamW:fused=true": _adamw_fused,
    "adafactor": _adafactor,
    "adamw8bit": _adamw8bit,
    "adamw4bit": _adamw4bit,
}

# The truths' default (no spec): torch's AdamW as the probe's default builds it.
DEFAULT = _adamw
