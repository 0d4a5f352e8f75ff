"""Memory meters: one interface (base), one module per kind (cpu, cuda), and the lookup by device spec.

- CudaMeter: ``max_memory_reserved`` (the figure) and ``max_memory_allocated`` from the caching
  allocator, plus this process's memory outside the allocator read through NVML. A budget below
  the card is enforced with ``torch.cuda.set_per_process_memory_fraction``.
- CpuMeter: the peak of live tensor-storage bytes, counted exactly; crossing the budget raises
  CpuOutOfMemoryError (a torch.OutOfMemoryError) at the op that crosses it.
"""

from __future__ import annotations

import torch

from autotune.core.errors import DeviceError
from autotune.core.schemas import Device
from autotune.measure.meters.base import FORWARD_BACKWARD, STEP, MemoryReading, Meter
from autotune.measure.meters.cpu import CpuMeter, CpuOutOfMemoryError
from autotune.measure.meters.cuda import CudaMeter

__all__ = [
    "FORWARD_BACKWARD",
    "STEP",
    "CpuMeter",
    "CpuOutOfMemoryError",
    "CudaMeter",
    "Meter",
    "MemoryReading",
    "describe_device",
    "make_meter",
    "resolve_device",
]


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


def make_meter(spec: str, budget_bytes: int | None, *, compiled: bool = False) -> Meter:
    """The meter for a device spec ("cpu", "cuda", "cuda:N", "auto"); ``compiled``: the trials run a compiled
    model, which on the CPU only the allocator's own count sees (autotune/measure/meters/compiled.py; a card's
    caching allocator sees it already)."""
    device = resolve_device(spec)
    if device == "cpu" and compiled:
        from autotune.measure.meters.compiled import CompiledCpuMeter

        return CompiledCpuMeter(budget_bytes)
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
