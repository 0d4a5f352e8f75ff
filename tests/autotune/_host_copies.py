"""The truths' host memory under --offload activations: save_on_cpu's pack and unpack as a card runs them, the host
copies in numpy's memory (the CPU allocator does not see them, as a card's does not see pinned host memory). Shares
nothing with the project (autotune/measure/offload.py); used by test_offload.py and _pipeline_worker.py."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks


class HostCopies:
    """save_on_cpu's pack and unpack as a card runs them, the host copies in numpy's memory; their live bytes
    and peak."""

    def __init__(self) -> None:
        self.live_bytes = self.peak_bytes = 0

    def _freed(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def pack(self, tensor: torch.Tensor) -> tuple[torch.device, np.ndarray]:
        host = tensor.detach().numpy().copy(order="K")
        self.live_bytes += host.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(host, self._freed, host.nbytes)
        return tensor.device, host

    def unpack(self, packed: tuple[torch.device, np.ndarray]) -> torch.Tensor:
        device, host = packed
        return torch.from_numpy(host).to(device, copy=True)


def offload_blocks(blocks: Iterable[nn.Module], copies: HostCopies) -> None:
    """Every block's forward under the hooks (outside a block's checkpoint wrapper, if it has one), as
    torchtitan-style recipes wrap a block in save_on_cpu."""
    for block in blocks:
        forward = block.forward

        def run(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            with saved_tensors_hooks(copies.pack, copies.unpack):
                return _forward(*args, **kwargs)

        block.forward = run  # type: ignore[method-assign]
