"""The meter interface: a device with a budget, able to measure the peak memory of a span of work.

``with meter.measure():`` resets the peak, enforces the budget (crossing it raises an OOM that
subclasses ``torch.OutOfMemoryError``) and afterwards ``meter.reading()`` gives the peak of the
measured span. One module per kind beside this one: cpu (live tensor bytes), cuda (the caching
allocator plus NVML).
"""

from __future__ import annotations

import gc
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from autotune.core.schemas import Device

__all__ = ["FORWARD_BACKWARD", "STEP", "MemoryReading", "Meter"]


@dataclass(frozen=True)
class MemoryReading:
    peak_bytes: int
    forward_backward_bytes: int | None = None
    step_bytes: int | None = None
    allocated_bytes: int | None = None
    outside_allocator_bytes: int | None = None


FORWARD_BACKWARD = "forward_backward"
STEP = "step"


class Meter(ABC):
    """A device with a budget, able to measure the peak memory of a span of work.

    Inside ``measure()``, ``checkpoint(phase)`` closes a phase: the peak since the previous
    checkpoint is kept per phase name, so a trial can tell its forward/backward peak from the
    optimizer step's. The span's figure is the largest phase peak.
    """

    device: torch.device
    budget_bytes: int
    # Seconds the last compiled model's compilation took (autotune/measure/meters/compiled.py); None: eager.
    compile_seconds: float | None = None

    def __init__(self) -> None:
        self._phases: dict[str, int] = {}
        self._allocated = 0
        self._last = MemoryReading(0)
        self._tracking_now = False
        self._phase_allocated: dict[str, int] = {}

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

    def unseen_bytes(self) -> int:
        """Bytes the device holds for this process that no tensor accounts for (the CUDA context
        and library workspaces): fake trials never see them."""
        return 0

    def expandable_segments(self) -> bool | None:
        """Whether the device's caching allocator runs with expandable segments (None: no such
        allocator here, as on the CPU)."""
        return None

    def checkpoint(self, phase: str) -> None:
        """Close the current phase; its peak counts towards ``phase``."""
        peak, allocated = self._take_peak()
        self._phases[phase] = max(self._phases.get(phase, 0), peak)
        if allocated is not None:
            self._allocated = max(self._allocated, allocated)
            self._phase_allocated[phase] = max(self._phase_allocated.get(phase, 0), allocated)

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Reset the peak, enforce the budget for the span, record the peak at exit."""
        self.release()
        self._phases, self._allocated, self._phase_allocated = {}, 0, {}
        self._take_peak()
        try:
            with self._tracked():
                yield
        finally:
            self.checkpoint("tail")
            outside = self._outside()
            self._last = MemoryReading(
                peak_bytes=max(self._phases.values()),
                forward_backward_bytes=self._phases.get(FORWARD_BACKWARD),
                step_bytes=self._step_bytes(outside),
                allocated_bytes=self._allocated or None,
                outside_allocator_bytes=outside,
            )

    def _step_bytes(self, outside: int | None) -> int | None:
        """What the optimizer step needs. A caching allocator keeps the segments the activations
        used reserved through the step, so there it is the step's allocated peak plus what lives
        outside the allocator, not its reserved figure."""
        allocated = self._phase_allocated.get(STEP)
        if allocated is not None:
            return allocated + (outside or 0)
        return self._phases.get(STEP)

    @contextmanager
    def _tracked(self) -> Iterator[None]:
        if self._tracking_now:
            yield
            return
        self._tracking_now = True
        try:
            with self._tracking():
                yield
        finally:
            self._tracking_now = False

    def hold(self) -> AbstractContextManager[None]:
        """Make what outlives a measured span (a model reused across trials) under the meter's
        accounting and budget: it stays counted, and every later span's peak includes it."""
        return self._tracked()

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
