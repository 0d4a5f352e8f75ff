"""What a process on an emulated card sets up and reads, shared by the child's jobs (child.py,
card_search.py): torch's settings for fake CUDA trials, what torch reads of the device, the ops a
trial dispatches (allocation traces with small keys: autotune/search/reserved.py). Its functions
import torch (the child's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["device_facts", "prepare_fake_cuda", "recording_ops"]


def prepare_fake_cuda() -> None:
    """What a fake trial on the emulated card needs of torch, before any fake tensor is made.

    - ``FakeTensorMode.avoid_device_init``: with CUDA available, fake mode would initialize the device
      and constant-propagate tensors moved to it by computing them there: on an emulated card, real
      allocations. Fake tensors never need the device.
    - The optimizers pick their ``foreach`` (and ``fused``) paths only for parameters whose type is a
      plain Tensor or Parameter; a fake parameter is a FakeTensor, so without it every fake trial takes
      the for-loop path that a real CUDA job would not. ``clip_grad_norm_`` has a list of its own.
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.optim.optimizer import _foreach_supported_types as optimizer_types
    from torch.utils._foreach_utils import _foreach_supported_types as clip_types

    FakeTensorMode.avoid_device_init = property(lambda self: True)  # type: ignore[assignment,method-assign]
    for supported in (optimizer_types, clip_types):
        if FakeTensor not in supported:
            supported.append(FakeTensor)


def device_facts() -> dict[str, Any]:
    """What torch reads of the device."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False under the emulation")
    props = torch.cuda.get_device_properties(0)
    return {
        "name": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "total_bytes": int(props.total_memory),
        "sm_count": int(props.multi_processor_count),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
    }


@contextmanager
def recording_ops(ops: dict[str, set[str]]) -> Iterator[None]:
    """Note every op the fake meter's counting mode dispatches, with the dtypes of what it returned
    (this process's own class is wrapped, for as long as the block runs)."""
    import torch
    from torch.utils._pytree import tree_flatten

    from autotune.measure.meters.fake import _FakeCountingMode

    original = _FakeCountingMode.__torch_dispatch__

    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = original(self, func, types, args, kwargs)
        dtypes = ops.setdefault(str(func), set())
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                dtypes.add(str(leaf.dtype).removeprefix("torch."))
        return out

    _FakeCountingMode.__torch_dispatch__ = dispatch  # type: ignore[method-assign]
    try:
        yield
    finally:
        _FakeCountingMode.__torch_dispatch__ = original  # type: ignore[method-assign]
