"""The fake meter: the trial under FakeTensorMode, counted the way the CPU meter counts.

Fake tensors have shapes, dtypes and (meta) storages of the right size, but no data and no compute,
so a trial costs the Python dispatch of its ops whatever m, and no memory. Live storage bytes are
counted exactly as on the CPU meter, and crossing the budget raises the same CpuOutOfMemoryError
at the op that crosses it. On the CPU a fake trial's peak equals a real one's byte for byte (a
test checks every example); on CUDA it leaves out what only the device adds (allocator rounding,
kernel workspaces, the CUDA context), which is why real trials confirm the boundary it finds.

Ops that need data:

- ``.item()`` and friends (``aten._local_scalar_dense``) answer a placeholder: 1 for integers,
  1.0 for floats, False for booleans. Optimizer step counters, supervised-token counts and
  ``isfinite`` checks read scalars only to do arithmetic or to skip work, so memory is unchanged;
  a model that branches on a scalar to allocate differently can differ from a real trial.
- Ops whose output shape depends on data (``nonzero``, ``masked_select``, boolean indexing) cannot
  run fake: the trial fails with FakeTrialError naming the op, and the probe falls back to real
  trials.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from autotune.core.errors import AutotuneError
from autotune.core.schemas import Device
from autotune.measure.meters.cpu import CpuMeter, _LiveStorageMode

__all__ = ["FakeMeter", "FakeTrialError", "SCALAR_PLACEHOLDERS"]

SCALAR_PLACEHOLDERS = {"bool": False, "int": 1, "float": 1.0}


class FakeTrialError(AutotuneError):
    """An op of the task cannot run on fake tensors (its output shape depends on data)."""


def _placeholder(tensor: torch.Tensor) -> bool | int | float:
    if tensor.dtype == torch.bool:
        return SCALAR_PLACEHOLDERS["bool"]
    if tensor.is_floating_point() or tensor.is_complex():
        return SCALAR_PLACEHOLDERS["float"]
    return SCALAR_PLACEHOLDERS["int"]


class _FakeCountingMode(_LiveStorageMode):
    """The CPU meter's counting mode over FakeTensorMode, answering scalar reads of fake tensors."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return _placeholder(args[0])
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as exc:
            raise FakeTrialError(
                f"{func} cannot run on fake tensors ({type(exc).__name__}: its output depends on data)"
            ) from None


class FakeMeter(CpuMeter):
    """Fake-tensor trials on device_type ("cpu", or "cuda" where this torch has CUDA) under a budget.

    Args:
        budget_bytes: required; crossing it raises CpuOutOfMemoryError at the op that crosses it.
        device_type: the device the fake tensors claim to be on ("cpu", "cuda", "cuda:N"); it
            decides which kernels and autocast lists the ops take.
        device_name: what describe() reports (an estimate is labelled with the card it is for).
    """

    def __init__(self, budget_bytes: int | None, device_type: str = "cpu", device_name: str | None = None) -> None:
        super().__init__(budget_bytes)
        device = torch.device(device_type)
        if device.type not in ("cpu", "cuda"):
            raise AutotuneError(f"device kind must be cpu or cuda, got {device_type!r}")
        self.device = device if device.type == "cpu" or device.index is not None else torch.device("cuda", 0)
        self.device_name = device_name or device.type
        # Tensors made outside the mode (a batch built by the task, a loss's constant) are allowed
        # and turned fake on use.
        self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def describe(self) -> Device:
        return Device(
            kind=self.device.type,  # type: ignore[arg-type]
            name=self.device_name,
            index=None,
            total_bytes=self.budget_bytes,
            torch_version=torch.__version__,
        )

    @contextmanager
    def _counting(self) -> Iterator[None]:
        with self._fake_mode, self._storage_resizes(), _FakeCountingMode(self):
            yield
