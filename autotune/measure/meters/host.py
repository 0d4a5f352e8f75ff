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

Each storage has a part (autotune.core.schemas.MEMORY_PARTS): what the offload says it is when it adds it (a
packed copy ``activations``, a shard ``trainable_parameters``, ...), else the span's (``host_span(part)``), else
``temporaries``; a later add may say better (the CPU step's allocations become ``optimizer_state`` once the step
says what it holds), and that part holds for the storage's whole life. :meth:`HostLedger.take_peak` also leaves the
host's peak by part in ``peak_parts``: the ledger's events since the last take, replayed with each storage's part.

    >>> import torch
    >>> ledger = HostLedger()
    >>> kept = torch.zeros(256)
    >>> ledger.add(kept.untyped_storage()), ledger.add(kept.untyped_storage())  # counted once
    (1024, 1024)
    >>> brief = torch.zeros(64)
    >>> _ = ledger.add(brief.untyped_storage(), "gradients")
    >>> del kept, brief
    >>> ledger.live_bytes, ledger.take_peak(), ledger.peak_parts, ledger.take_peak()
    (0, 1280, {'temporaries': 1024, 'gradients': 256}, 0)
"""

from __future__ import annotations

import collections
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
    """Live bytes of the host storages added so far, with the peak since the last :meth:`take_peak` and, at each
    take, that peak by part (``peak_parts``).

    A storage's death only queues its key (a finalizer, which can run on any thread, or on this one while it holds
    the lock: a collection set off inside :meth:`add`); the queue is applied under the lock before anything reads or
    changes the ledger, so a death lands before the next add, where a peak can be set."""

    # The changes kept between two takes for the peak's parts: beyond it (timed runs, which never take) they are
    # dropped and the next take says no parts.
    MAX_CHANGES = 1 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dead: collections.deque[int] = collections.deque()  # keys whose storages died, to be applied
        self._live: dict[int, list[Any]] = {}  # storage key -> [finalizer, bytes, serial of this life]
        # serial -> part of each life that is live or was since the last take (a key is reused after a free, a
        # serial never).
        self._parts: dict[int, str] = {}
        self._serial = 0
        self._since: list[tuple[int, int]] | None = []  # (serial, bytes) of every change since the last take
        self._held: list[tuple[int, int]] = []  # (serial, bytes) live at the last take
        self._live_bytes = 0
        self.peak_bytes = 0
        self.peak_parts: dict[str, int] = {}

    def _release(self, key: int) -> None:
        self._dead.append(key)  # no lock: see the class's docstring

    def _apply_deaths(self) -> None:
        """Under the lock: the queued deaths off the ledger."""
        while self._dead:
            entry = self._live.pop(self._dead.popleft(), None)
            if entry is not None:
                self._live_bytes -= entry[1]
                self._note(entry[2], -entry[1])

    def _note(self, serial: int, nbytes: int) -> None:
        if self._since is not None:
            self._since.append((serial, nbytes))
            if len(self._since) > self.MAX_CHANGES:
                self._since = None

    @property
    def live_bytes(self) -> int:
        with self._lock:
            self._apply_deaths()
            return self._live_bytes

    def add(self, storage: torch.UntypedStorage, part: str | None = None) -> int:
        """Count storage at its current size (a counted one that changed size is recounted), as ``part`` where
        given (else the span's, else what it was, else ``temporaries``); the live bytes."""
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            self._apply_deaths()
            entry = self._live.get(key)
            if entry is None:
                self._serial += 1
                # Fires when the C++ storage is freed, as the CPU meter's ledger does.
                self._live[key] = [weakref.finalize(storage, self._release, key), nbytes, self._serial]
                self._live_bytes += nbytes
                self._note(self._serial, nbytes)
                self._parts[self._serial] = part or getattr(_SPAN, "part", None) or "temporaries"
            else:
                if entry[1] != nbytes:
                    self._live_bytes += nbytes - entry[1]
                    self._note(entry[2], nbytes - entry[1])
                    entry[1] = nbytes
                if part is not None:
                    self._parts[entry[2]] = part
            self.peak_bytes = max(self.peak_bytes, self._live_bytes)
            return self._live_bytes

    def holds(self, storage: torch.UntypedStorage) -> bool:
        # The CPU meter asks at every count: the lock only where a death is queued (its key may be reused now).
        if self._dead:
            with self._lock:
                self._apply_deaths()
        return bool(self._live) and storage._cdata in self._live

    def take_peak(self) -> int:
        """The peak since the last call (its parts in ``peak_parts``); the next one starts from the live bytes
        now."""
        with self._lock:
            self._apply_deaths()
            peak, self.peak_bytes = self.peak_bytes, self._live_bytes
            self.peak_parts = self._parts_at_peak(peak)
            self._held = [(entry[2], entry[1]) for entry in self._live.values()]
            self._since = []
            self._parts = {serial: self._parts[serial] for serial, _ in self._held}
            return peak

    def _parts_at_peak(self, peak: int) -> dict[str, int]:
        """The live bytes by part where the replay of the changes since the last take first reaches ``peak``
        (empty where it never does: a change the ledger did not keep)."""
        parts: dict[str, int] = {}
        live = 0

        def change(serial: int, nbytes: int) -> None:
            part = self._parts.get(serial, "temporaries")
            parts[part] = parts.get(part, 0) + nbytes
            if not parts[part]:
                del parts[part]

        for serial, nbytes in self._held:
            change(serial, nbytes)
            live += nbytes
        if live == peak:
            return dict(parts)
        for serial, nbytes in self._since or []:
            change(serial, nbytes)
            live += nbytes
            if live == peak and nbytes > 0:
                return dict(parts)
        return {}


HOST = HostLedger()

_SPAN = threading.local()


@contextmanager
def host_span(part: str | None = None) -> Iterator[None]:
    """What is made inside is host memory: the CPU meter counts it on :data:`HOST` (as ``part`` where given, else
    as the enclosing span's), not on the device; under a running profiler the allocations inside are the children
    of a :data:`HOST_SPAN_MARK` range."""
    depth = getattr(_SPAN, "depth", 0)
    outer_part = getattr(_SPAN, "part", None)
    _SPAN.depth = depth + 1
    _SPAN.part = part or outer_part
    try:
        if depth == 0 and torch.autograd._profiler_enabled():
            with torch.profiler.record_function(HOST_SPAN_MARK):
                yield
        else:
            yield
    finally:
        _SPAN.depth = depth
        _SPAN.part = outer_part


def in_host_span() -> bool:
    return getattr(_SPAN, "depth", 0) > 0
