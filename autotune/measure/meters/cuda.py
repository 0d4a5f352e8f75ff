"""The CUDA meter: torch.cuda peak statistics plus NVML, the budget enforced by the memory fraction.

The figure is ``max_memory_reserved`` plus this process's memory outside the caching allocator
(CUDA context, library workspaces) read through NVML, with ``max_memory_allocated`` beside it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from autotune.core.errors import BudgetError, DeviceError
from autotune.core.schemas import Device
from autotune.measure.fragmentation import expandable_segments_on
from autotune.measure.meters.base import Meter

__all__ = ["CudaMeter"]


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

    def unseen_bytes(self) -> int:
        return self._outside_bytes()

    def expandable_segments(self) -> bool | None:
        # Read from the environment the allocator was configured from at CUDA's first use.
        return expandable_segments_on()

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
