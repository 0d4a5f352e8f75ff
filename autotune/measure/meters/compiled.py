"""The meter of compiled trials on the CPU: the CPU allocator's own count (docs/compile.md).

The CPU meter counts the storages an operator returns, seen by a dispatch mode. Code that
``torch.compile`` generates (inductor's C++ wrapper) allocates its buffers with ``empty_strided``
calls the dispatch mode never sees, and frees and reuses them inside one kernel call: the CPU meter
would count a compiled step's inputs and outputs and miss its intermediates. The CPU allocator sees
every block: ``torch.profiler``'s memory events (``profile_memory=True``) carry each allocation's and
release's size, in order, and their running sum is the live bytes the step holds.

A span this meter tracks (``hold()``: the model's build and the compilation; ``measure()``: a trial)
runs under the profiler. What a hold span leaves allocated (the weights, what compilation keeps) is
the base every trial's peak starts from; a trial's peak is the base plus the largest running sum of
its own events. A block freed on a thread the profiler does not follow (gloo's worker, which can drop the last
reference to a collective's buffer) records no event: c10's ``caffe2_report_cpu_memory_usage`` is on while a span
runs, so the allocator's own running total (each event's ``total_allocated``) counts that free, and whatever the
total moved beyond an event's own bytes is counted just before that event. Phases (forward/backward, step) are split
by markers the trial's checkpoints leave in
the same event stream. The budget is enforced after the span: a trial whose peak crosses it ends in
:class:`~autotune.measure.meters.cpu.CpuOutOfMemoryError`, the OOM the search reads as "does not
fit" (the CPU has the memory to run it; the budget is the card's being emulated).

Also here: what a trial needs to run the model compiled (:func:`compile_model`, :func:`mark_dynamic_batch`,
:func:`memory_budget`, :func:`compile_failure`). The static confirmation of a compiled search's answer is the
search floor's (autotune/search/static.py).
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autotune.core.errors import TaskError
from autotune.core.library_logs import quiet_native_stderr
from autotune.core.policy_names import parse_policy
from autotune.measure.meters.base import FORWARD_BACKWARD, STEP, MemoryReading
from autotune.measure.meters.cpu import CpuMeter, CpuOutOfMemoryError
from autotune.measure.meters.host import HOST_SPAN_MARK

__all__ = [
    "EAGER_PRESEARCH",
    "CompiledCpuMeter",
    "DeferredEvents",
    "WARM_UP_MICRO_BATCH",
    "compile_and_warm",
    "compile_failure",
    "compile_model",
    "compiled_job",
    "compiled_mode_of",
    "compiles_on",
    "graphs_compiled",
    "compiled_for",
    "estimated_eager",
    "mark_dynamic_batch",
    "memory_budget",
    "quiet_grad_reads",
    "static_shapes",
]

_MARK = "autotune.phase."
# A breakdown recorder's marks (phase changes, what storages are) in the same event stream.
_RECORD = "autotune.record."


def _memory_events(
    prof: Any,
) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, str]], list[tuple[int, int]]]:
    """(start ns, bytes, address, the allocator's total after it) of every allocator event (a release's bytes
    negative), (start ns, phase) of every checkpoint marker, and (start ns, serial) of every mark a breakdown's
    recorder left (:meth:`CompiledCpuMeter.record_mark`)."""
    from torch._C._profiler import _ExtraFields_Allocation

    allocations: list[tuple[int, int, int, int]] = []
    marks: list[tuple[int, str]] = []
    records: list[tuple[int, int]] = []
    made_on_host: set[tuple[int, int]] = set()
    stack = [(node, False) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, on_host = stack.pop()
        on_host = on_host or node.name == HOST_SPAN_MARK
        stack.extend((child, on_host) for child in node.children)
        fields = node.extra_fields
        if isinstance(fields, _ExtraFields_Allocation):
            allocations.append((node.start_time_ns, fields.alloc_size, fields.ptr, fields.total_allocated))
            if on_host and fields.alloc_size > 0:
                made_on_host.add((node.start_time_ns, fields.ptr))
        elif node.name.startswith(_MARK):
            marks.append((node.start_time_ns, node.name.removeprefix(_MARK)))
        elif node.name.startswith(_RECORD):
            records.append((node.start_time_ns, int(node.name.removeprefix(_RECORD))))
    allocations.sort(key=lambda item: item[0])
    marks.sort(key=lambda item: item[0])
    records.sort(key=lambda item: item[0])
    return _device_events(allocations, made_on_host), marks, records


def _device_events(
    allocations: list[tuple[int, int, int, int]], made_on_host: set[tuple[int, int]]
) -> list[tuple[int, int, int, int]]:
    """The events as the device sees them. What was allocated inside a host span (offload's packed copies: a card
    makes them in host memory, autotune/measure/offload.py) is host memory: its allocation and its release are left
    out, and the allocator's total after each event is read less the host blocks live then, so that no host block
    reads as an allocation the profiler missed (:func:`_unseen_bytes`). The host's own figure is the host ledger's.

    >>> _device_events([(1, 8, 100, 8), (2, 4, 200, 12), (3, -8, 100, 4), (4, -4, 200, 0)], {(2, 200)})
    [(1, 8, 100, 8), (3, -8, 100, 0)]
    """
    if not made_on_host:
        return allocations
    device: list[tuple[int, int, int, int]] = []
    on_host: dict[int, int] = {}  # address -> bytes of the host blocks live
    host_bytes = 0
    for at, nbytes, address, total in allocations:
        if nbytes > 0 and (at, address) in made_on_host:
            on_host[address] = nbytes
            host_bytes += nbytes
        elif nbytes < 0 and address in on_host:
            host_bytes -= on_host.pop(address)
        else:
            device.append((at, nbytes, address, total - host_bytes))
    return device


def _recorded_items(
    allocations: list[tuple[int, int, int, int]], records: list[tuple[int, int]]
) -> tuple[list[tuple[str, int, int]], bool]:
    """A span's allocator events and a recorder's marks as one sequence in time order: ("alloc", address, bytes),
    ("free", address, bytes), ("mark", serial, 0); and whether the events are the whole story. Where the
    allocator's total grew by more than an event's own bytes (an allocation the profiler did not record: under
    op-level checkpointing in a compiled graph, 128 bytes a few times a step), the growth is an allocation of its
    own just before the event, at an address no block has, as :func:`_counted` counts it; where it fell (a block
    freed on a thread the profiler does not follow, which no breakdown can place), the events are not whole."""
    items: list[tuple[int, int, int, tuple[str, int, int]]] = []
    whole = True
    total_before: int | None = None
    unseen_address = 0  # negative: no real block's
    for order, (at, nbytes, address, total) in enumerate(allocations):
        unseen = _unseen_bytes(total_before, total, nbytes)
        total_before = total
        if unseen < 0:
            whole = False
        elif unseen > 0:
            unseen_address -= 1
            items.append((at, 0, 2 * order, ("alloc", unseen_address, unseen)))
        items.append((at, 0, 2 * order + 1, ("alloc" if nbytes > 0 else "free", address, abs(nbytes))))
    # A mark stamped at the same nanosecond as an allocation is put after it: what a mark says a storage is (its
    # gradients, its state) is said after the storage was made.
    items += [(at, 1, serial, ("mark", serial, 0)) for at, serial in records]
    items.sort(key=lambda item: item[:3])
    return [item for *_, item in items], whole


@dataclass
class DeferredEvents:
    """A compiled trial's events for a breakdown's recorder (autotune/measure/breakdown.py), known only after the
    profiler stops: the blocks held when the span began (address, bytes), then ``items`` (:func:`_recorded_items`);
    ``whole``: whether the allocator's total agreed with the events all along."""

    held: list[tuple[int, int]] = field(default_factory=list)
    items: list[tuple[str, int, int]] = field(default_factory=list)
    whole: bool = False
    filled: bool = False


def _unseen_bytes(total_before: int | None, total: int, nbytes: int) -> int:
    """What the allocator's total moved before an event beyond the event's own bytes (0 at a span's first event):
    blocks allocated or freed on a thread the profiler does not follow."""
    return 0 if total_before is None else total - total_before - nbytes


def _counted(
    events: list[tuple[int, int, int, int]], held: dict[int, int], fresh: dict[int, int]
) -> list[tuple[int, int]]:
    """(start ns, bytes) of the events this meter counts: every allocation (into ``fresh``, by address), and the
    release of a block allocated in a span it tracked (``held``: the hold spans' blocks; ``fresh``: this span's).
    The release of a block from before (a model of an earlier trial that the collector frees during this one) is
    left out: its allocation was never counted, and its release read the peak low (a GPT-2 config's static trial
    at m_max once 917,508 B below an ordinary compile's).

    What the allocator's total moved between two events beyond the later event's own bytes was allocated or freed
    on a thread the profiler does not follow, and is counted just before the later event (what moved before a
    span's first event is not seen: a block of before, freed then, is not this span's). gloo's worker thread can drop
    the last reference to a collective's buffer (tests/autotune/test_compiled_meter_threads.py frees a block on
    another thread: 1 MiB read where 2 MiB was read before)."""
    counted: list[tuple[int, int]] = []
    total_before: int | None = None
    for at, nbytes, address, total in events:
        unseen = _unseen_bytes(total_before, total, nbytes)
        total_before = total
        if unseen:  # it happened before this event: counted first, so that a peak between the two is read
            counted.append((at, unseen))
        if nbytes > 0:
            fresh[address] = nbytes
            counted.append((at, nbytes))
        elif address in fresh:
            counted.append((at, -fresh.pop(address)))
        elif address in held:
            counted.append((at, -held.pop(address)))
    return counted


@contextmanager
def _every_threads_frees() -> Iterator[None]:
    """c10's flag ``caffe2_report_cpu_memory_usage`` on within: the CPU allocator's total then counts the frees of
    every thread, not only of the threads the profiler follows (c10/core/CPUAllocator.cpp,
    ProfiledCPUMemoryReporter::Delete). Where the flag cannot be found (another platform's library name), nothing
    changes: the events alone are counted, as before."""
    flag = _report_flag()
    if flag is None:
        yield
        return
    before = flag.value
    flag.value = True
    try:
        yield
    finally:
        flag.value = before


@functools.cache
def _report_flag() -> Any:
    """c10's ``FLAGS_caffe2_report_cpu_memory_usage`` as a ctypes bool, or None where this torch's library lacks it."""
    import ctypes
    import os

    library_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib", "c10.dll"):
        path = os.path.join(library_dir, name)
        if os.path.exists(path):
            try:
                return ctypes.c_bool.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage")
            except (OSError, ValueError):
                return None
    return None


class CompiledCpuMeter(CpuMeter):
    """The CPU meter for compiled trials: live bytes as the CPU allocator counts them (module docstring).

    Args:
        budget_bytes: required; a trial whose peak crosses it is an OOM.
    """

    def __init__(self, budget_bytes: int | None) -> None:
        super().__init__(budget_bytes)
        self._base_bytes = 0  # what the hold spans left allocated: the weights and what compilation keeps
        self._profiling = False
        self._holders: list[weakref.finalize[Any, Any]] = []  # a held model's death takes its bytes out of the base
        self._held_blocks: dict[int, int] = {}  # address -> bytes of what the hold spans allocated and kept
        self._deferred: DeferredEvents | None = None  # record_events's, while a breakdown records a trial

    @contextmanager
    def _profiled(
        self,
    ) -> Iterator[tuple[list[tuple[int, int, int, int]], list[tuple[int, str]], list[tuple[int, int]]]]:
        from torch.profiler import ProfilerActivity, profile

        allocations: list[tuple[int, int, int, int]] = []
        marks: list[tuple[int, str]] = []
        records: list[tuple[int, int]] = []
        self._profiling = True
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        try:
            # Kineto prints a line at every start and stop, which only a quiet stderr keeps off the terminal.
            with _every_threads_frees():
                with quiet_native_stderr():
                    prof.__enter__()
                try:
                    yield allocations, marks, records
                finally:
                    with quiet_native_stderr():
                        prof.__exit__(None, None, None)
        finally:
            self._profiling = False
            # After the profiler has stopped: its results exist only then.
            found = _memory_events(prof)
            allocations.extend(found[0])
            marks.extend(found[1])
            records.extend(found[2])

    def hold(self) -> AbstractContextManager[None]:
        return self._held()

    @contextmanager
    def _held(self) -> Iterator[None]:
        if self._profiling:  # inside a span already (build_model holds within the runner's hold)
            yield
            return
        with self._profiled() as (allocations, _, _):
            yield
        fresh: dict[int, int] = {}
        self._base_bytes += sum(nbytes for _, nbytes in _counted(allocations, self._held_blocks, fresh))
        self._held_blocks.update(fresh)

    def adopt(self, module: nn.Module) -> None:
        """Nothing to add: the allocator saw the weights being made, in the hold span."""

    @contextmanager
    def record_events(self) -> Iterator[DeferredEvents]:  # type: ignore[override]
        """A trial's events for its breakdown, filled when its measured span ends (the profiler's events exist only
        after it stops): the recorder leaves marks in the stream (:meth:`record_mark`) instead of reading indices."""
        if self._deferred is not None:
            yield self._deferred
            return
        self._deferred = DeferredEvents()
        try:
            yield self._deferred
        finally:
            self._deferred = None

    def record_mark(self, serial: int) -> None:
        """A recorder's mark ``serial`` in the event stream, where a span runs."""
        if self._profiling:
            with torch.profiler.record_function(f"{_RECORD}{serial}"):
                pass

    def checkpoint(self, phase: str) -> None:
        if self._profiling:
            with torch.profiler.record_function(_MARK + phase):
                pass

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Reset, run the span under the profiler, read its peak; an OOM after a span whose peak crossed
        the budget (and that raised nothing else)."""
        self.release()
        if self._profiling:
            raise RuntimeError("the compiled meter's measure() cannot nest in another of its spans")
        failed = False
        deferred = self._deferred
        held = list(self._held_blocks.items())
        try:
            with self._profiled() as (allocations, marks, records):
                try:
                    yield
                except BaseException:
                    failed = True
                    raise
        finally:
            if deferred is not None and not deferred.filled:  # the trial's recorder reads them after the span
                deferred.held = held
                deferred.items, deferred.whole = _recorded_items(allocations, records)
                deferred.filled = True
            self._last = self._read(_counted(allocations, self._held_blocks, {}), marks)
        if not failed and self._enforce and self._last.peak_bytes > self.budget_bytes:
            raise CpuOutOfMemoryError(
                f"CPU meter (compiled): out of memory (DefaultCPUAllocator: can't allocate memory): the step "
                f"peaked at {self._last.peak_bytes} bytes, over the budget of {self.budget_bytes} bytes"
            )

    def _read(self, allocations: list[tuple[int, int]], marks: list[tuple[int, str]]) -> MemoryReading:
        phases: dict[str, int] = {}
        live = phase_peak = self._base_bytes
        cursor = 0
        for at, nbytes in allocations:
            while cursor < len(marks) and marks[cursor][0] <= at:
                name = marks[cursor][1]
                phases[name] = max(phases.get(name, 0), phase_peak)
                phase_peak = live
                cursor += 1
            live += nbytes
            phase_peak = max(phase_peak, live)
        for _, name in marks[cursor:]:
            phases[name] = max(phases.get(name, 0), phase_peak)
            phase_peak = live
        phases["tail"] = phase_peak
        return MemoryReading(
            peak_bytes=max(phases.values()),
            forward_backward_bytes=phases.get(FORWARD_BACKWARD),
            step_bytes=phases.get(STEP),
        )

    @property
    def live_bytes(self) -> int:
        """What the hold spans left allocated (the base of every trial's peak)."""
        return self._base_bytes

    def forget(self, nbytes: int, blocks: dict[int, int] | None = None) -> None:
        """A model held since the base was ``nbytes`` died (its weights, what its compilation kept), and with it
        ``blocks`` (address -> bytes, :attr:`held_blocks` when it was held): a trial's breakdown starts from the
        blocks still held, which must sum to the base its peak starts from."""
        self._base_bytes = max(0, self._base_bytes - nbytes)
        for address, size in (blocks or {}).items():
            if self._held_blocks.get(address) == size:
                self._held_blocks.pop(address, None)

    @property
    def held_blocks(self) -> dict[int, int]:
        """address -> bytes of what the hold spans allocated and kept (a copy)."""
        return dict(self._held_blocks)

    def held_by(self, model: Any) -> None:
        """``model`` holds what the hold spans left: when it dies (outside the meter's spans, the runner's close, or
        a rebuild after an OOM), those bytes and blocks leave the base."""
        self._holders.append(weakref.finalize(model, self.forget, self._base_bytes, self.held_blocks))

    def clear_base(self) -> None:
        """A fresh build follows and nothing before it counts (the static confirmation's): the base is 0, and a
        model of before that dies later (a cycle the collector has not broken yet) takes nothing out of it."""
        for holder in self._holders:
            holder.detach()
        self._holders.clear()
        self._held_blocks.clear()
        self._base_bytes = 0

    def _tracking(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()


# True while graphs compile static (dynamic=False, batches not marked): the static confirmation and the timed
# runs, which run one model at fixed sizes as a job does.
_static = {"on": False}


@contextmanager
def static_shapes() -> Iterator[None]:
    """Within: :func:`compile_model` compiles with ``dynamic=False`` and :func:`mark_dynamic_batch` marks
    nothing, so each size runs the graph an ordinary ``torch.compile(model)`` called at that size makes."""
    before = _static["on"]
    _static["on"] = True
    try:
        yield
    finally:
        _static["on"] = before


def mark_dynamic_batch(batch: Any) -> None:
    """Mark dimension 0 (the micro-batch) of every tensor of a batch dynamic, so that one compilation
    serves every m >= 2 (docs/compile.md: one dynamic graph costs one compile where automatic dynamic
    shapes cost two). Size 1 is left static: dynamo specializes it. Nothing is marked under
    :func:`static_shapes`. ``maybe_mark_dynamic``, not ``mark_dynamic``: where the step's own code specializes the
    dimension (FSDP2's hooks around an hf: model's loss specialized the labels' batch dimension), dynamo compiles
    that size as a static graph instead of stopping the probe with a ConstraintViolationError (issue 41).
    """
    from torch._dynamo import maybe_mark_dynamic

    if _static["on"]:
        return

    from autotune.tasks.batches import map_tensors

    def mark(tensor: torch.Tensor) -> torch.Tensor:
        # Not a fake trial's tensors (the pre-search runs the eager model): marked under FakeTensorMode, dynamo
        # compiles no frame afterwards in this process.
        if type(tensor) is torch.Tensor and tensor.dim() > 0 and tensor.shape[0] >= 2:
            maybe_mark_dynamic(tensor, 0)
        return tensor

    map_tensors(mark, batch)


def compile_model(model: nn.Module, mode: str) -> nn.Module:
    """``torch.compile(model, mode=mode)`` (``dynamic=False`` under :func:`static_shapes`): compiled on its
    first call (the runner's warm-up)."""
    with warnings.catch_warnings():  # inductor's first import touches torch.jit, which warns it is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch._inductor.compile_fx  # noqa: F401
    dynamic = False if _static["on"] else None
    return torch.compile(model, mode=None if mode == "default" else mode, dynamic=dynamic)  # type: ignore[return-value]


def memory_budget(policy: str) -> AbstractContextManager[Any]:
    """``torch._functorch.config.activation_memory_budget`` set to R while a ``budget:R`` policy's model
    compiles (the partitioner reads it then); a no-op for every other policy."""
    parsed = parse_policy(policy)
    if parsed.kind != "budget":
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=parsed.budget)


def compile_failure(exc: BaseException, task_name: str) -> TaskError | None:
    """A compiler error as one line (what stopped it: the unsupported op or the graph break's reason), or
    None for an error that is not the compiler's."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException, Unsupported

    if not isinstance(exc, (TorchDynamoException, BackendCompilerFailed, Unsupported)):
        return None
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    # Dynamo's first line says what failed ("RuntimeError when making fake tensor call"); its Explanation line
    # names the op or the graph break.
    said = [*lines[:1], *[line for line in lines[1:] if line.startswith("Explanation:")][:1]]
    return TaskError(
        f"--compile: the model of task {task_name!r} cannot be compiled: {type(exc).__name__}: {'; '.join(said)}"[:1000]
    )


def compiled_mode_of(model: Any) -> tuple[str | None, str | None]:
    """How a model handed to ``suggest()`` is compiled: ``(mode, None)`` for a ``torch.compile``'d module
    (an ``OptimizedModule``, or anything that keeps dynamo's context as ``dynamo_ctx``) compiled by inductor
    in one of the installed torch's modes; ``(None, why)`` for a compiled model whose compilation a probe
    cannot repeat (another backend, inductor options beyond a mode); ``(None, None)`` for an eager model.

    >>> compiled_mode_of(torch.nn.Linear(2, 2))
    (None, None)
    """
    context = getattr(model, "dynamo_ctx", None)
    if context is None:
        return None, None
    backend: Any = getattr(context, "callback", None)
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    name = getattr(backend, "compiler_name", None)
    if name != "inductor":
        return None, (
            f"the model is compiled with the {name or type(backend).__name__} backend: autotune compiles with "
            "inductor only, and measured it eager"
        )
    from torch._inductor import list_mode_options

    options = dict(getattr(backend, "config", None) or {})
    if not options:
        return "default", None
    for mode in list_mode_options():
        if dict(list_mode_options(mode)) == options:
            return mode, None
    return None, (
        f"the model is compiled with inductor options {sorted(options)} beyond a mode: autotune compiles in a "
        "mode only, and measured it eager"
    )


# The activation memory budget the last compilation of this process ran under (None: the default).
_compiled_under: dict[str, float | None] = {}

# The micro-batch the warm-up compiles at: the smallest size dynamo does not specialize.
WARM_UP_MICRO_BATCH = 2


def compiles_on(meter: Any) -> bool:
    """Whether trials on ``meter`` run the model compiled: on a real device. Fake trials (the pre-search, an
    estimate, an emulated card) run it eager: dynamo cannot trace under FakeTensorMode, and a frame it fails
    on once it skips for good in this process, so the real trials after would run eager too."""
    from autotune.measure.meters.fake import FakeMeter

    return not isinstance(meter, FakeMeter)


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process (since its last reset): a span that changed it compiled."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def fresh_compiler_for(policy: str) -> float | None:
    """The compiler's activation memory budget under ``policy`` (R of ``budget:R``, else None), with dynamo's caches
    reset where the last compilation ran under another: its cache does not guard on the partitioner's budget, so a
    graph compiled under another ratio would answer this probe's calls (a fresh compiler, as a fresh process has)."""
    parsed = parse_policy(policy)
    ratio = parsed.budget if parsed.kind == "budget" else None
    if _compiled_under.get("budget", None) != ratio:
        torch._dynamo.reset()
    _compiled_under["budget"] = ratio
    return ratio


def compiled_for(task: Any, model: nn.Module) -> nn.Module:
    """``model`` compiled in the task's mode, lazily (its first call compiles); under ``budget:R`` its forward runs
    with the compiler's activation memory budget at R, so every compilation of it (the first, a recompilation
    for another size) partitions under R."""
    fresh_compiler_for(task.activation_checkpointing)
    compiled = compile_model(model, task.compile)
    forward = under_memory_budget(compiled.forward, task.activation_checkpointing)
    compiled.forward = quiet_grad_reads(forward)  # type: ignore[method-assign]
    return compiled


def quiet_grad_reads(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` without the warning dynamo's tracer raises when it reads ``.grad`` of a tensor that is no leaf (a
    block's input, the previous block's output, where a pipeline compiles block by block or a graph breaks at a
    block, as at ``--offload activations``' save_on_cpu): it reads it to guard on it, the job never asks for it.
    Under an "error" filter (pytest's, a user's ``-W error``) the warning would stop the compilation."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            return forward(*args, **kwargs)

    return call


def under_memory_budget(forward: Callable[..., Any], policy: str) -> Callable[..., Any]:
    """``forward`` run with the compiler's activation memory budget of a ``budget:R`` policy (each compilation it
    makes partitions under R); ``forward`` itself for any other policy."""
    if parse_policy(policy).kind != "budget":
        return forward

    def forward_under_budget(*args: Any, **kwargs: Any) -> Any:
        with memory_budget(policy):
            return forward(*args, **kwargs)

    return forward_under_budget


def compile_and_warm(
    task: Any,
    meter: Any,
    model: nn.Module,
    strategy: Any,
    make_batch: Callable[[Any, int, torch.device], Any],
    micro_batch: int | None = None,
) -> tuple[nn.Module, float]:
    """The model compiled in the task's mode, its first forward and backward run (and so compiled) at the
    first trial's ``micro_batch`` (at least :data:`WARM_UP_MICRO_BATCH`; a graph first compiled near the sizes it
    runs at peaks closer to an ordinary compile at them: docs/compile.md) inside the meter's hold: what
    compilation keeps allocated is part of every trial's base, and its seconds are not a trial's. Under
    ``budget:R`` every compilation (the warm-up's, a recompilation for m = 1) runs with the compiler's
    activation memory budget at R.

    ``make_batch(task, m, device)`` is the trial's own (autotune.measure.trial.make_batch: it marks the batch
    dimension dynamic).

    Returns:
        (the compiled model, the seconds the warm-up took: the compilation, mostly).

    Raises:
        TaskError: the compiler failed (one line: what stopped it).
    """
    compiled = compiled_for(task, model)
    budget = memory_budget(task.activation_checkpointing)
    started = time.perf_counter()
    try:
        with meter.hold(), budget:
            batch = make_batch(task, max(WARM_UP_MICRO_BATCH, micro_batch or 0), meter.device)
            with strategy.autocast(task.precision, meter.device):
                loss = task.compute_loss(compiled, batch)
            loss.backward()
            del batch, loss
            compiled.zero_grad(set_to_none=True)
    except TaskError:
        raise
    except Exception as exc:
        failure = compile_failure(exc, task.name)
        if failure is None:
            raise
        raise failure from None
    seconds = time.perf_counter() - started
    meter.compile_seconds = (meter.compile_seconds or 0.0) + seconds
    if isinstance(meter, CompiledCpuMeter):
        # The model dies outside the meter's spans (the runner's close): its bytes leave the base then.
        meter.held_by(compiled)
    return compiled, seconds


# The datasheet's line for a compiled job's pre-search (docs/compile.md, "The pre-search").
EAGER_PRESEARCH = (
    "the fake pre-search ran the eager model (fake tensors cannot run the compiler): its max micro-batch was an "
    "estimate for the compiled job, and the real trials, compiled, decided"
)


def estimated_eager(task: Any) -> str:
    """The datasheet's line for an estimate of a compiled job: fake trials (a CPU or CUDA estimate, an emulated
    card) cannot run the compiler, so they run the eager model, and the compiled step's memory is assumed to be
    eager's; ``budget:R`` is refused (the compiler's budget acts only where the model compiles).

    Raises:
        TaskError: the task's policy is ``budget:R``.
    """
    if parse_policy(task.activation_checkpointing).kind == "budget":
        raise TaskError(
            f"--ac {task.activation_checkpointing}: the compiler's activation memory budget acts where the model "
            "compiles, and an estimate runs fake trials, which cannot compile: probe it on a device"
        )
    return (
        f"compiled ({task.compile}): an estimate runs fake trials, which run the eager model (fake tensors cannot "
        "run the compiler): the compiled step's memory is assumed to be eager's, which it can be above or below "
        "(bench/compile.py); probe on a device to measure it compiled"
    )


def compiled_job(task: Any, meter: Any, *, presearch: bool, stages: int = 1) -> list[str]:
    """What a compiled job's datasheet says before its trials run, and the meter check: a CPU meter that
    counts storages by dispatch would miss the compiled code's own buffers. ``stages`` > 1: a pipeline's, whose
    stages compile block by block (autotune/measure/pipeline/) and are searched without a fake pre-search.

    Raises:
        TaskError: the meter cannot see a compiled step.
    """
    if isinstance(meter, CpuMeter) and not isinstance(meter, CompiledCpuMeter):
        raise TaskError(
            f"task {task.name!r} is compiled (--compile {task.compile}): on the CPU its trials need the allocator's "
            "own count (CompiledCpuMeter, make_meter(..., compiled=True)); the dispatch meter misses inductor's buffers"
        )
    meter.compile_seconds = None
    if stages > 1:
        return [
            f"compiled ({task.compile}) under --pp {stages}: each stage's blocks were compiled one by one, as "
            "torchtitan's apply_compile compiles them (the stage's cut, its embedding and head eager), static at each "
            "trial's micro-batch by a fresh compiler, as a job at that size compiles them, and each stage was measured "
            "in steps that compiled nothing (after the steps that did); a trial's seconds include its compilations"
        ]
    notes = [
        f"compiled ({task.compile}): the model was compiled once, at the first trial's micro-batch (at least "
        f"{WARM_UP_MICRO_BATCH}) with the micro-batch dimension dynamic, and every trial ran the compiled step; "
        "m_max and the size above it were then each compiled static at their size and measured again, and those "
        "trials decided; compile_seconds (every compilation) is apart from the trials' seconds"
    ]
    if presearch:
        notes.append(EAGER_PRESEARCH)
    return notes
