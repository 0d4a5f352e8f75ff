"""Memory meters: one interface, a CUDA meter and a CPU meter.

A meter owns a device and a budget. ``with meter.measure():`` resets the peak, enforces the
budget (crossing it raises an OOM that subclasses ``torch.OutOfMemoryError``) and afterwards
``meter.reading()`` gives the peak of the measured span.

- CudaMeter: ``max_memory_reserved`` (the figure) and ``max_memory_allocated`` from the caching
  allocator, plus this process's memory outside the allocator (CUDA context, library
  workspaces) read through NVML. A budget below the card is enforced with
  ``torch.cuda.set_per_process_memory_fraction``.
- CpuMeter: the peak of live tensor-storage bytes, counted exactly: every storage produced by an
  operator while measuring (parameters, buffers, optimizer state, activations, gradients,
  temporaries returned by ops) is added when created and subtracted when freed. Scratch memory a
  kernel allocates and frees inside itself is not visible to it.
"""

from __future__ import annotations

import gc
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autotune.errors import BudgetError, DeviceError
from autotune.schemas import Device

__all__ = [
    "FORWARD_BACKWARD",
    "CpuMeter",
    "CpuOutOfMemoryError",
    "CudaMeter",
    "Meter",
    "MemoryReading",
    "describe_device",
    "make_meter",
    "resolve_device",
]


class CpuOutOfMemoryError(torch.OutOfMemoryError):
    """The CPU meter's budget was crossed. Subclasses torch.OutOfMemoryError so that the search and
    the clean-up take exactly the path they take on a GPU. The message carries the text of PyTorch's
    own CPU allocator failure, so that tools which recognise an OOM by its text (Lightning's
    is_oom_error, Accelerate's should_reduce_batch_size) recognise this one too."""


@dataclass(frozen=True)
class MemoryReading:
    peak_bytes: int
    forward_backward_bytes: int | None = None
    allocated_bytes: int | None = None
    outside_allocator_bytes: int | None = None


FORWARD_BACKWARD = "forward_backward"


class Meter(ABC):
    """A device with a budget, able to measure the peak memory of a span of work.

    Inside ``measure()``, ``checkpoint(phase)`` closes a phase: the peak since the previous
    checkpoint is kept per phase name, so a trial can tell its forward/backward peak from the
    optimizer step's. The span's figure is the largest phase peak.
    """

    device: torch.device
    budget_bytes: int

    def __init__(self) -> None:
        self._phases: dict[str, int] = {}
        self._allocated = 0
        self._last = MemoryReading(0)

    @abstractmethod
    def describe(self) -> Device:
        """Facts about the device for the profile."""

    @abstractmethod
    def _take_peak(self) -> tuple[int, int | None]:
        """(peak bytes, peak allocated bytes or None) since the last call, and restart the peak."""

    @abstractmethod
    def _tracking(self) -> AbstractContextManager[Any]:
        """What must be active while measuring (the CPU meter's dispatch mode)."""

    def _outside(self) -> int | None:
        return None

    def checkpoint(self, phase: str) -> None:
        """Close the current phase; its peak counts towards ``phase``."""
        peak, allocated = self._take_peak()
        self._phases[phase] = max(self._phases.get(phase, 0), peak)
        if allocated is not None:
            self._allocated = max(self._allocated, allocated)

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Reset the peak, enforce the budget for the span, record the peak at exit."""
        self.release()
        self._phases, self._allocated = {}, 0
        self._take_peak()
        try:
            with self._tracking():
                yield
        finally:
            self.checkpoint("tail")
            self._last = MemoryReading(
                peak_bytes=max(self._phases.values()),
                forward_backward_bytes=self._phases.get(FORWARD_BACKWARD),
                allocated_bytes=self._allocated or None,
                outside_allocator_bytes=self._outside(),
            )

    def reading(self) -> MemoryReading:
        """The peak of the last measured span."""
        return self._last

    def adopt(self, module: torch.nn.Module) -> None:  # noqa: B027 - optional hook
        """Count a module's tensors that were created in ways the meter could not see."""

    @contextmanager
    def unbounded(self) -> Iterator[None]:
        """Measure without enforcing the budget (used to report what the weights alone take)."""
        yield

    def release(self) -> None:
        """Drop whatever the last span left behind: cycles, allocator caches."""
        gc.collect()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Undo any process-wide setting the meter made."""


# --------------------------------------------------------------------------------------------- CPU


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


# -------------------------------------------------------------------------------------------- CUDA


class _Nvml:
    """This process's memory on one GPU as the driver sees it (context and workspaces included)."""

    def __init__(self, index: int) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self.handle = self._find_handle(index)

    def _find_handle(self, index: int) -> Any:
        nvml = self._nvml
        # CUDA's index and NVML's differ under CUDA_VISIBLE_DEVICES: match by UUID.
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            nvml_uuid = nvml.nvmlDeviceGetUUID(handle)
            nvml_uuid = nvml_uuid.decode() if isinstance(nvml_uuid, bytes) else nvml_uuid
            if nvml_uuid.removeprefix("GPU-") == uuid.removeprefix("GPU-"):
                return handle
        return nvml.nvmlDeviceGetHandleByIndex(index)

    def facts(self) -> dict[str, str | int]:
        nvml = self._nvml
        driver = nvml.nvmlSystemGetDriverVersion()
        uuid = nvml.nvmlDeviceGetUUID(self.handle)
        info = nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return {
            "driver_version": driver.decode() if isinstance(driver, bytes) else driver,
            "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
            "used_bytes": int(info.used),
            "total_bytes": int(info.total),
        }

    def process_used_bytes(self) -> int | None:
        """Bytes NVML attributes to this process, or None where it cannot say (containers)."""
        import os

        nvml = self._nvml
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except nvml.NVMLError:
            return None
        for proc in procs:
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return None

    def device_used_bytes(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self.handle).used)


class CudaMeter(Meter):
    """torch.cuda peak statistics plus NVML, with the budget enforced through the memory fraction.

    Args:
        index: the CUDA device index.
        budget_bytes: None for what this process can get (total minus other processes' use).
    """

    def __init__(self, index: int, budget_bytes: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise DeviceError("CUDA is not available on this machine: use --device cpu with a --budget")
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise DeviceError(f"device cuda:{index} does not exist: this machine has {count} CUDA device(s)")
        super().__init__()
        self.index = index
        self.device = torch.device("cuda", index)
        torch.cuda.set_device(index)
        torch.cuda.init()
        torch.empty(1, device=self.device)  # create the context now so NVML sees it in the baseline
        free, total = torch.cuda.mem_get_info(index)
        self.total_bytes = int(total)
        try:
            self._nvml: _Nvml | None = _Nvml(index)
        except Exception:  # no NVML (driver without it, pynvml missing): the allocator figure only
            self._nvml = None
        self._others_bytes = self._other_processes_bytes(free)
        available = self.total_bytes - self._others_bytes
        if budget_bytes is None:
            budget_bytes = available
        if budget_bytes <= 0:
            raise BudgetError(f"budget must be positive, got {budget_bytes} bytes")
        if budget_bytes > self.total_bytes:
            raise BudgetError(f"budget {budget_bytes} bytes is more than cuda:{index} has ({self.total_bytes} bytes)")
        self.budget_bytes = int(budget_bytes)
        # The allocator's share leaves room for what lives outside it (context, workspaces).
        allocator_bytes = max(0, self.budget_bytes - self._outside_bytes())
        torch.cuda.set_per_process_memory_fraction(min(1.0, allocator_bytes / self.total_bytes), index)

    def _other_processes_bytes(self, free: int) -> int:
        mine = self._nvml.process_used_bytes() if self._nvml else None
        used = self.total_bytes - int(free)
        if mine is None:
            mine = torch.cuda.memory_reserved(self.index)
        return max(0, used - mine)

    def _outside_bytes(self) -> int:
        """This process's device memory that the caching allocator does not hold."""
        reserved = torch.cuda.memory_reserved(self.index)
        mine = self._nvml.process_used_bytes() if self._nvml else None
        if mine is None:
            free, _ = torch.cuda.mem_get_info(self.index)
            mine = self.total_bytes - int(free) - self._others_bytes
        return max(0, mine - reserved)

    def describe(self) -> Device:
        props = torch.cuda.get_device_properties(self.index)
        free, total = torch.cuda.mem_get_info(self.index)
        facts = self._nvml.facts() if self._nvml else {}
        uuid = facts.get("uuid") or str(getattr(props, "uuid", ""))
        return Device(
            kind="cuda",
            name=props.name,
            index=self.index,
            total_bytes=int(total),
            free_bytes=int(free),
            uuid=str(uuid) or None,
            driver_version=str(facts["driver_version"]) if "driver_version" in facts else None,
            cuda_version=torch.version.cuda,
            torch_version=torch.__version__,
            compute_capability=f"{props.major}.{props.minor}",
        )

    def release(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.index)
        torch.cuda.empty_cache()

    def _take_peak(self) -> tuple[int, int | None]:
        torch.cuda.synchronize(self.index)
        peak = int(torch.cuda.max_memory_reserved(self.index)) + self._outside_bytes()
        allocated = int(torch.cuda.max_memory_allocated(self.index))
        torch.cuda.reset_peak_memory_stats(self.index)
        return peak, allocated

    def _tracking(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def _outside(self) -> int | None:
        return self._outside_bytes()

    @contextmanager
    def unbounded(self) -> Iterator[None]:
        torch.cuda.set_per_process_memory_fraction(1.0, self.index)
        try:
            yield
        finally:
            allocator_bytes = max(0, self.budget_bytes - self._outside_bytes())
            torch.cuda.set_per_process_memory_fraction(min(1.0, allocator_bytes / self.total_bytes), self.index)

    def nvml_device_used_bytes(self) -> int | None:
        """NVML's reading of the whole device, for comparison with the meter's figure."""
        return self._nvml.device_used_bytes() if self._nvml else None

    def close(self) -> None:
        torch.cuda.set_per_process_memory_fraction(1.0, self.index)


# ------------------------------------------------------------------------------------------ lookup


def resolve_device(spec: str) -> str:
    """Normalise a --device value: "auto" becomes "cuda:0" when CUDA is available, else "cpu"."""
    spec = spec.strip().lower()
    if spec == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        return "cuda:0"
    if spec == "cpu" or spec == "all":
        return spec
    if spec.startswith("cuda:") and spec[5:].isdigit():
        return spec
    raise DeviceError(f"unknown device {spec!r}: use cpu, cuda, cuda:N, all or auto")


def make_meter(spec: str, budget_bytes: int | None) -> Meter:
    """The meter for a device spec ("cpu", "cuda", "cuda:N", "auto")."""
    device = resolve_device(spec)
    if device == "cpu":
        return CpuMeter(budget_bytes)
    if device == "all":
        raise DeviceError("--device all is handled by the probe, one process per GPU")
    return CudaMeter(int(device[5:]), budget_bytes)


def describe_device(spec: str) -> Device:
    """Cheap facts about a device without setting a budget (for lookups before a probe)."""
    device = resolve_device(spec)
    if device == "cpu":
        return Device(kind="cpu", name="cpu", torch_version=torch.__version__)
    if device == "all":
        device = "cuda:0"
    if not torch.cuda.is_available():
        raise DeviceError("CUDA is not available on this machine")
    index = int(device[5:])
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {device} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    props = torch.cuda.get_device_properties(index)
    return Device(
        kind="cuda",
        name=props.name,
        index=index,
        total_bytes=int(props.total_memory),
        cuda_version=torch.version.cuda,
        torch_version=torch.__version__,
        compute_capability=f"{props.major}.{props.minor}",
    )
