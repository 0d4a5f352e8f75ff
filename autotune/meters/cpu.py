"""The CPU meter: real execution on the CPU with a budget on live tensor-storage bytes.

Every storage produced by an operator while measuring (parameters, buffers, optimizer state,
activations, gradients, temporaries returned by ops) is added when created and subtracted when
freed. Scratch memory a kernel allocates and frees inside itself is not visible to it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autotune.errors import BudgetError
from autotune.meters.base import Meter
from autotune.schemas import Device

__all__ = ["CpuMeter", "CpuOutOfMemoryError"]


class CpuOutOfMemoryError(torch.OutOfMemoryError):
    """The CPU meter's budget was crossed. Subclasses torch.OutOfMemoryError so that the search and
    the clean-up take exactly the path they take on a GPU. The message carries the text of PyTorch's
    own CPU allocator failure, so that tools which recognise an OOM by its text (Lightning's
    is_oom_error, Accelerate's should_reduce_batch_size) recognise this one too."""


class _StorageLedger:
    """Live bytes of the storages seen so far, with the peak since the last reset."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, Any] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def _release(self, key: int, nbytes: int) -> None:
        with self._lock:
            if self._live.pop(key, None) is not None:
                self.live_bytes -= nbytes

    def add(self, storage: torch.UntypedStorage) -> int:
        """Start counting storage; returns the live bytes after it (0 added if already counted)."""
        key = storage._cdata
        with self._lock:
            if key in self._live:
                return self.live_bytes
            nbytes = storage.nbytes()
            # The finalizer fires when the C++ storage is freed, not when one Python handle dies:
            # PyTorch keeps the storage's Python object alive while C++ still owns the storage.
            self._live[key] = weakref.finalize(storage, self._release, key, nbytes)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            return self.live_bytes

    def take_peak(self) -> int:
        with self._lock:
            peak, self.peak_bytes = self.peak_bytes, self.live_bytes
            return peak


def _storages(obj: Any) -> Iterator[torch.UntypedStorage]:
    for leaf in tree_flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and leaf.device.type != "meta":
            try:
                yield leaf.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. functional wrappers)
                continue


class _LiveStorageMode(TorchDispatchMode):
    """Sees every operator call on this thread, forward, backward and optimizer alike."""

    def __init__(self, meter: CpuMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.meter._account(out, func)
        return out


class CpuMeter(Meter):
    """Real execution on the CPU with a budget on live tensor-storage bytes.

    Args:
        budget_bytes: required; crossing it raises CpuOutOfMemoryError at the op that crosses it.
    """

    def __init__(self, budget_bytes: int | None) -> None:
        if budget_bytes is None:
            raise BudgetError("the CPU meter needs a budget: pass --budget (for example --budget 512MiB)")
        if budget_bytes <= 0:
            raise BudgetError(f"budget must be positive, got {budget_bytes} bytes")
        super().__init__()
        self.device = torch.device("cpu")
        self.budget_bytes = budget_bytes
        self._ledger = _StorageLedger()
        self._enforce = True

    def describe(self) -> Device:
        return Device(
            kind="cpu",
            name="cpu",
            index=None,
            total_bytes=self.budget_bytes,
            torch_version=torch.__version__,
        )

    def _account(self, tensors: Any, what: Any) -> None:
        """Count the storages of tensors; raise the OOM at the one that crosses the budget."""
        for storage in _storages(tensors):
            live = self._ledger.add(storage)
            if self._enforce and live > self.budget_bytes:
                raise CpuOutOfMemoryError(
                    f"CPU meter: out of memory (DefaultCPUAllocator: can't allocate memory): {what} "
                    f"brought live tensor bytes to {live} over the budget of {self.budget_bytes} bytes"
                )

    def _take_peak(self) -> tuple[int, int | None]:
        return self._ledger.take_peak(), None

    def _tracking(self) -> AbstractContextManager[Any]:
        return _LiveStorageMode(self)

    @contextmanager
    def unbounded(self) -> Iterator[None]:
        self._enforce = False
        try:
            yield
        finally:
            self._enforce = True

    def adopt(self, module: torch.nn.Module) -> None:
        self._account([*module.parameters(), *module.buffers()], "the model's weights")

    @property
    def live_bytes(self) -> int:
        """Bytes still held by storages created while measuring (0 after a clean trial)."""
        return self._ledger.live_bytes
