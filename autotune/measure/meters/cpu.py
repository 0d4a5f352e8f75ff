"""The CPU meter: real execution on the CPU with a budget on live tensor-storage bytes.

Every storage produced by an operator while measuring (parameters, buffers, optimizer state,
activations, gradients, temporaries returned by ops) is added when created and subtracted when
freed. Scratch memory a kernel allocates and frees inside itself is not visible to it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autotune.core.allocator import FREE
from autotune.core.errors import BudgetError
from autotune.core.schemas import Device
from autotune.measure.meters.base import Meter
from autotune.measure.meters.host import HOST, in_host_span

__all__ = ["CpuMeter", "CpuOutOfMemoryError", "StorageEvents"]


@dataclass
class StorageEvents:
    """Storages live when a recording began (``held``: (key, bytes)) and every allocation (key,
    bytes) and release (key, FREE) after it, in order (CpuMeter.record_events); ``streams``: the CUDA
    stream (its ``stream_id``) of each allocation made off the current device's default stream, by the event's
    index in ``events`` (FSDP2's all-gather and reduce-scatter buffers: the caching allocator keeps each stream's
    blocks apart). By index, not key: a key is a storage's address, which a later storage can take again."""

    held: list[tuple[int, int]]
    events: list[tuple[int, int]]
    streams: dict[int, int] = field(default_factory=dict)


class CpuOutOfMemoryError(torch.OutOfMemoryError):
    """The CPU meter's budget was crossed. Subclasses torch.OutOfMemoryError so that the search and
    the clean-up take exactly the path they take on a GPU. The message carries the text of PyTorch's
    own CPU allocator failure, so that tools which recognise an OOM by its text (Lightning's
    is_oom_error, Accelerate's should_reduce_batch_size) recognise this one too."""


class _StorageLedger:
    """Live bytes of the storages seen so far, with the peak since the last reset.

    A storage is counted at its current size: FSDP2 keeps its unsharded parameters' storages alive
    and resizes them to 0 after use and back before the next all-gather, so a size taken once at
    creation would count them as held all the time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # storage key -> [finalizer, counted bytes]
        self._live: dict[int, list[Any]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        # Live bytes after every count that added bytes, while a trace is kept (CpuMeter.keep_trace).
        # Counts that add nothing are left out: FSDP2's first forward makes empty storages and
        # resizes that later trials do not, and they can never hold a peak.
        self.trace: list[int] | None = None
        # Every allocation and release, while recorded (CpuMeter.record_events): (key, nbytes) when a
        # storage gets bytes, (key, FREE) when it gives them back, in order, for the caching allocator's
        # model (autotune/core/allocator.py). A storage resized in place is a release and an allocation:
        # to 0 and back (FSDP2's unsharded parameters) under its own key; from one size to another, the
        # new bytes under a new key first and the old ones freed after, as resize_ copies.
        self.events: list[tuple[int, int]] | None = None
        self._renamed: dict[int, int] = {}  # storage key -> its event key, after a resize to a new size
        # While recorded on a CUDA device: the current stream's id, and the default stream's; an allocation
        # on another stream goes into `streams` (the event's index -> stream id).
        self.stream_of: Callable[[], int] | None = None
        self.default_stream = 0
        self.streams: dict[int, int] = {}
        self._new_keys = itertools.count(-2, -1)  # never a storage's key (those are addresses)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is not None:
                self._release_entry(key, entry)

    def _release_entry(self, key: int, entry: list[Any]) -> None:  # under the lock
        self._live.pop(key, None)
        self.live_bytes -= entry[1]
        if self.events is not None and entry[1]:
            self.events.append((self._renamed.pop(key, key), FREE))
        elif self._renamed:
            self._renamed.pop(key, None)

    def add(self, storage: torch.UntypedStorage) -> int:
        """Count storage at its current size (a counted storage that changed size is recounted);
        returns the live bytes after it."""
        key = storage._cdata
        nbytes = storage.nbytes()
        with self._lock:
            before = self.live_bytes
            entry = self._live.get(key)
            if entry is None:
                # The finalizer fires when the C++ storage is freed, not when one Python handle dies:
                # PyTorch keeps the storage's Python object alive while C++ still owns the storage.
                self._live[key] = [weakref.finalize(storage, self._release, key), nbytes]
                self.live_bytes += nbytes
                if self.events is not None and nbytes:
                    self.events.append((key, nbytes))
                    if self.stream_of is not None:
                        self._tag()
            elif entry[1] != nbytes:
                self.live_bytes += nbytes - entry[1]
                if self.events is not None:
                    self._resized(key, entry[1], nbytes)
                entry[1] = nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            if self.trace is not None and self.live_bytes > before:
                self.trace.append(self.live_bytes)
            return self.live_bytes

    def _tag(self, back: int = 1) -> None:
        """The stream the allocation event ``back`` from the end was made on, where it is not the default one."""
        assert self.stream_of is not None and self.events is not None
        stream = self.stream_of()
        if stream != self.default_stream:
            self.streams[len(self.events) - back] = stream

    def _resized(self, key: int, old_bytes: int, new_bytes: int) -> None:
        assert self.events is not None
        event_key = self._renamed.get(key, key)
        if old_bytes and new_bytes:
            self._renamed[key] = new_key = next(self._new_keys)
            self.events += [(new_key, new_bytes), (event_key, FREE)]
            if self.stream_of is not None:
                self._tag(back=2)
        elif new_bytes:
            self.events.append((event_key, new_bytes))
            if self.stream_of is not None:
                self._tag()
        else:
            self.events.append((event_key, FREE))

    def scratch(self, steps: list[tuple[str, int]]) -> None:
        """A kernel's temporaries (autotune/core/kernel_temporaries.py): allocated and freed within one op,
        after its outputs. They raise the peak and go into the recorded events under keys of their own; the
        live bytes after them (and so the trace) are unchanged."""
        with self._lock:
            keys: dict[str, tuple[int, int]] = {}
            held = 0
            for name, nbytes in steps:
                if nbytes == FREE:
                    key, freed = keys.pop(name)
                    held -= freed
                    if self.events is not None and freed:
                        self.events.append((key, FREE))
                    continue
                key = next(self._new_keys)
                keys[name] = (key, nbytes)
                held += nbytes
                if self.events is not None and nbytes:
                    self.events.append((key, nbytes))
                    if self.stream_of is not None:
                        self._tag()
                self.peak_bytes = max(self.peak_bytes, self.live_bytes + held)

    def event_key(self, storage: torch.UntypedStorage) -> int | None:
        """The key the events give a counted storage that holds bytes (None: not counted, or empty)."""
        key = storage._cdata
        with self._lock:
            entry = self._live.get(key)
            if entry is None or not entry[1]:
                return None
            return self._renamed.get(key, key)

    def held(self) -> list[tuple[int, int]]:
        """(event key, bytes) of every live storage that holds bytes, in the order they were counted."""
        with self._lock:
            return [(self._renamed.get(key, key), entry[1]) for key, entry in self._live.items() if entry[1]]

    def forget(self, storage: torch.UntypedStorage) -> None:
        """Stop counting storage (it is the host's now): its bytes leave the live bytes, as a release."""
        key = storage._cdata
        with self._lock:
            entry = self._live.get(key)
            if entry is not None:
                entry[0].detach()
                self._release_entry(key, entry)

    def counts(self, storage: torch.UntypedStorage) -> bool:
        with self._lock:
            return storage._cdata in self._live

    def take_peak(self) -> int:
        with self._lock:
            peak, self.peak_bytes = self.peak_bytes, self.live_bytes
            return peak


def _current_stream_id() -> int:
    return torch.cuda.current_stream().stream_id


def _plain_tensors(leaf: torch.Tensor) -> Iterator[torch.Tensor]:
    """A tensor subclass that wraps others (FSDP2's DTensor parameters) has no storage of its own:
    its inner tensors (the local shard) hold the memory. Fake tensors are leaves: their (meta)
    storage has the size the real one would have."""
    kind = type(leaf)
    if kind is not torch.Tensor and kind is not FakeTensor and hasattr(kind, "__tensor_flatten__"):
        names, _ = leaf.__tensor_flatten__()  # type: ignore[attr-defined]
        for name in names:
            inner = getattr(leaf, name)
            if isinstance(inner, torch.Tensor):
                yield from _plain_tensors(inner)
        return
    yield leaf


def _storage(leaf: torch.Tensor) -> torch.UntypedStorage | None:
    if leaf.layout != torch.strided or (leaf.device.type == "meta" and type(leaf) is not FakeTensor):
        return None
    try:
        return leaf.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. functional wrappers)
        return None


def _storages(obj: Any) -> Iterator[torch.UntypedStorage]:
    # Most ops return one plain tensor: skip the tree walk for them (the fake meter's trial is
    # nothing but this bookkeeping and the dispatch).
    tops = (obj,) if type(obj) is torch.Tensor or type(obj) is FakeTensor else tree_flatten(obj)[0]
    for top in tops:
        if not isinstance(top, torch.Tensor):
            continue
        for leaf in _plain_tensors(top):
            storage = _storage(leaf)
            if storage is not None:
                yield storage


def _attention_kernels() -> dict[Any, str]:
    """scaled_dot_product_attention's fused kernels by their forward op (what SDPA dispatched to; its math path
    runs as plain matmuls and a softmax, no op of its own)."""
    aten = torch.ops.aten
    named = {
        "_scaled_dot_product_flash_attention": "flash",
        "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
        "_scaled_dot_product_efficient_attention": "memory-efficient",
        "_scaled_dot_product_cudnn_attention": "cuDNN",
    }
    return {getattr(aten, name).default: kernel for name, kernel in named.items() if hasattr(aten, name)}


_ATTENTION_KERNELS = _attention_kernels()


class _LiveStorageMode(TorchDispatchMode):
    """Sees every operator call on this thread, forward, backward and optimizer alike."""

    def __init__(self, meter: CpuMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.meter._account(out, func)
        kernel = _ATTENTION_KERNELS.get(func)
        if kernel is not None:  # which attention kernel the trial ran, for the datasheet
            self.meter.attention_kernels.add(kernel)
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
        self._recording: StorageEvents | None = None  # record_events's, while one runs
        self._enforce = True
        self.keep_trace = False
        self.last_trace: list[int] | None = None
        # A trial's breakdown recorder while one records (autotune/measure/breakdown.py).
        self.recorder: Any = None
        # The fused attention kernels SDPA dispatched to in the trials so far ("flash", "memory-efficient", ...).
        self.attention_kernels: set[str] = set()

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
            self._count(storage, what)

    def _count(self, storage: torch.UntypedStorage, what: Any) -> None:
        if in_host_span() or HOST.holds(storage):  # host memory under --offload (autotune/measure/meters/host.py)
            HOST.add(storage)
            return
        live = self._ledger.add(storage)
        if self.recorder is not None:  # the breakdown's recorder learns the operator of the peak
            self.recorder.note_peak(live, what)
        if self._enforce and live > self.budget_bytes:
            raise CpuOutOfMemoryError(
                f"CPU meter: out of memory (DefaultCPUAllocator: can't allocate memory): {what} "
                f"brought live tensor bytes to {live} over the budget of {self.budget_bytes} bytes"
            )

    @contextmanager
    def _storage_resizes(self) -> Iterator[None]:
        """Recount a counted storage when it is resized in place (FSDP2 frees and re-allocates its
        unsharded parameters this way, outside any operator the dispatch mode sees)."""
        original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            if self._ledger.counts(storage):
                self._count(storage, "UntypedStorage.resize_")
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]

    @contextmanager
    def _counting(self) -> Iterator[None]:
        with self._storage_resizes(), _LiveStorageMode(self):
            yield

    def _take_peak(self) -> tuple[int, int | None]:
        return self._ledger.take_peak(), None

    def _tracking(self) -> AbstractContextManager[Any]:
        return self._counting()

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Measure (see Meter.measure); with ``keep_trace`` set, ``last_trace`` is then the live
        bytes after every count in the span that added bytes, in order. Live bytes only grow at a
        count, so the peak is the trace's maximum, and two traces of one trial at two sizes line up
        allocation by allocation (autotune/core/curve.py)."""
        with super().measure():
            self._ledger.trace = [] if self.keep_trace else None
            try:
                yield
            finally:
                self.last_trace = self._ledger.trace
                self._ledger.trace = None

    @contextmanager
    def record_events(self) -> Iterator[StorageEvents]:
        """Record every storage allocation and release from now to the end of the block: what was
        live when it began (``held``, in the order it was counted), then the events in order (see
        ``_StorageLedger.events``). A trial recorded from before its ``measure()`` to after its
        ``release()`` has balanced events: each key it allocates, it frees.

        Inside a recording, another one is the same recording (its held storages and its events so far): a card's
        search records a trial for the allocator's model while the trial's breakdown records it too."""
        if self._recording is not None:
            yield self._recording
            return
        recorded = StorageEvents(held=self._ledger.held(), events=[])
        self._recording = recorded
        ledger = self._ledger
        ledger.events = recorded.events
        ledger.streams = recorded.streams
        if self.device.type == "cuda":
            ledger.stream_of = _current_stream_id
            ledger.default_stream = torch.cuda.default_stream().stream_id
        try:
            yield recorded
        finally:
            self._recording = None
            ledger.events = None
            ledger.stream_of = None
            ledger.streams = {}

    def event_key(self, storage: torch.UntypedStorage) -> int | None:
        """The key the recorded events give storage (None where it is not counted)."""
        return self._ledger.event_key(storage)

    @contextmanager
    def unbounded(self) -> Iterator[None]:
        self._enforce = False
        try:
            yield
        finally:
            self._enforce = True

    def to_host(self, storage: torch.UntypedStorage, part: str | None = None) -> None:
        """A storage the device counted is host memory from now on (a shard FSDP2 offloads, which on a CPU
        device stays where it was): it leaves the device's live bytes and is counted on :data:`HOST` (as ``part``)."""
        self._ledger.forget(storage)
        HOST.add(storage, part)

    def adopt(self, module: torch.nn.Module) -> None:
        self._account([*module.parameters(), *module.buffers()], "the model's weights")

    @property
    def live_bytes(self) -> int:
        """Bytes still held by storages created while measuring (0 after a clean trial)."""
        return self._ledger.live_bytes
