"""Host memory as a figure of its own (docs/design.md, "The waves' decisions": host memory): what offload
moves off the device, counted apart from the device's bytes.

``HOST`` is one ledger for the process: the storages an offload put on the host (saved activations packed by
``autotune.measure.offload``, FSDP2's offloaded shards, their gradients and the optimizer's state) are added to
it, each counted once at its size and subtracted when torch frees it, and its peak is restarted at the start
of every trial. Inside :func:`host_span` (a pack hook, the CPU step of ``--offload params``), the CPU meter
counts what is made on this ledger instead of the device's: on a CPU device "host" and "device" are one
memory, and this is where the probe says which of them a storage would be on a card. Under a running profiler
the span is also a range of its own (:data:`HOST_SPAN_MARK`): the compiled meter, which reads the allocator's
events, takes what was allocated inside it off the device's count.

    >>> import torch
    >>> ledger = HostLedger()
    >>> kept = torch.zeros(256)
    >>> ledger.add(kept.untyped_storage()), ledger.add(kept.untyped_storage())  # counted once
    (1024, 1024)
    >>> del kept
    >>> ledger.live_bytes, ledger.take_peak(), ledger.take_peak()
    (0, 1024, 0)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["HOST", "HOST_SPAN_MARK", "HostLedger", "host_span", "in_host_span"]

# The profiler range a host span leaves, where a profiler runs (the compiled meter's spans).
HOST_SPAN_MARK = "autotune.host_span"


class HostLedger:
    """Live bytes of the host storages added so far, with the peak since the last :meth:`take_peak`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, list[Any]] = {}  # storage key -> [finalizer, bytes]
        self.live_bytes = 0
        self.peak_bytes = 0

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.live_bytes -= entry[1]

    def add(self, storage: torch.UntypedStorage) -> int:
        """Count storage at its current size (a counted one that changed size is recounted); the live bytes."""
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                # Fires when the C++ storage is freed, as the CPU meter's ledger does.
                self._live[key] = [weakref.finalize(storage, self._release, key), nbytes]
                self.live_bytes += nbytes
            elif entry[1] != nbytes:
                self.live_bytes += nbytes - entry[1]
                entry[1] = nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            return self.live_bytes

    def holds(self, storage: torch.UntypedStorage) -> bool:
        # Without the lock: the CPU meter asks at every count, and a dict lookup is atomic under the GIL.
        return bool(self._live) and storage._cdata in self._live

    def take_peak(self) -> int:
        """The peak since the last call; the next one starts from the live bytes now."""
        with self._lock:
            peak, self.peak_bytes = self.peak_bytes, self.live_bytes
            return peak


HOST = HostLedger()

_SPAN = threading.local()


@contextmanager
def host_span() -> Iterator[None]:
    """What is made inside is host memory: the CPU meter counts it on :data:`HOST`, not on the device; under a
    running profiler the allocations inside are the children of a :data:`HOST_SPAN_MARK` range."""
    depth = getattr(_SPAN, "depth", 0)
    _SPAN.depth = depth + 1
    try:
        if depth == 0 and torch.autograd._profiler_enabled():
            with torch.profiler.record_function(HOST_SPAN_MARK):
                yield
        else:
            yield
    finally:
        _SPAN.depth = depth


def in_host_span() -> bool:
    return getattr(_SPAN, "depth", 0) > 0
