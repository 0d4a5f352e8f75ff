"""Where a trial's memory goes: its peak broken down by what holds it, and the step drawn as a timeline.

A trial run with a :class:`BreakdownRecorder` on a CPU or fake meter records every storage the meter counts (the
meter's own events: ``CpuMeter.record_events``), the phase each was allocated in, and what the trial knows the
storages to be once it knows it: the model's parameters (trainable and frozen apart) and buffers when the cycle
starts, each micro-batch's gradients after its backward, the optimizer's state after each step. After the trial
the events are replayed twice: the first pass gives every allocation its category (what it was last known to be,
else its phase's: the micro-batch's tensors are ``inputs``, what the forward allocates ``activations``, what the
backward or the step allocates and is nothing else ``temporaries``; what FSDP2 allocates while it gathers a unit's
parameters or reduce-scatters its gradients, ``collectives``); the second sums the live bytes of each
category after every event. The parts at the event where the total peaks sum to the trial's peak exactly (the
same storages, counted once), and the totals after every event, thinned to a few hundred points that keep every
local peak, are the timeline.

Why categories are given after the fact: a gradient is allocated in the backward as a temporary and becomes the
parameter's ``.grad`` only when accumulated (FSDP2 assigns it after its reduce-scatter); the optimizer's state is
allocated in the step beside the step's own temporaries. Replayed with what each storage turned out to be, the
peak's parts say what was held, not when it was first seen.

The peak's place: the operator that allocated the byte that set the peak, and the innermost module running then
(torch's ``ModTracker``), forward or backward.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from autotune.core.allocator import FREE
from autotune.core.schemas import MEMORY_PARTS, MemoryBreakdown

__all__ = ["BreakdownRecorder", "TIMELINE_POINTS", "breakdown_of", "with_card_parts", "with_host_parts"]

TIMELINE_POINTS = 120
# The category an allocation takes from the phase it was made in, unless the trial later says what it is.
_PHASE_PART = {
    "held": "temporaries",
    "model": "trainable_parameters",
    "inputs": "inputs",
    "forward": "activations",
    "backward": "temporaries",
    "step": "temporaries",
}


# FSDP2's methods whose allocations are the mesh's: the all-gather and its copy-out into the unsharded parameters,
# and the reduce-scatter of a unit's gradients (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py).
_COLLECTIVE_METHODS = ("unshard", "wait_for_unshard", "post_backward")
# DDP's: its forward's preamble, where the reducer builds (and after the first iteration rebuilds) the gradient
# buckets it all-reduces (torch/nn/parallel/distributed.py, _pre_forward: reducer._rebuild_buckets()).
_DDP_COLLECTIVE_METHODS = ("_pre_forward",)


class BreakdownRecorder:
    """Records one trial on a CPU (or fake) meter for :meth:`breakdown`. The trial marks its phases
    (:meth:`phase`) and says what storages are (:meth:`classify`); the meter tells it the operator of each new
    peak (:meth:`note_peak`)."""

    def __init__(self) -> None:
        self._events: list[tuple[int, int]] | None = None
        self._held: list[tuple[int, int]] = []
        self._phases: list[tuple[int, str]] = []
        self._known: list[tuple[int, int, str]] = []  # (event index, event key, category)
        # (event index, in a collective or not): the spans where FSDP2 gathers or reduce-scatters, or DDP builds
        # its buckets.
        self._collective: list[tuple[int, bool]] = []
        self._collective_depth = 0
        self._event_key: Any = None
        self._peak_label = ""
        self._best = -1
        self._tracker: Any = None
        # A compiled trial's (CompiledCpuMeter): its events come after the span, so what happens during it is kept by
        # serial, with a mark of that serial left in the profiler's stream, and placed when the events come.
        self._deferred: Any = None
        self._meter: Any = None
        self._pending: list[tuple[str, Any]] = []

    @contextmanager
    def recording(self, meter: Any) -> Iterator[None]:
        """Record meter's events for the block (meter: a CpuMeter or FakeMeter, the modules tracked; or a
        CompiledCpuMeter, whose events come when its span ends and whose graphs no module hook may touch)."""
        from torch.distributed._tools.mod_tracker import ModTracker

        from autotune.measure.meters.compiled import CompiledCpuMeter

        compiled = isinstance(meter, CompiledCpuMeter)
        with (
            meter.record_events() as recorded,
            _grad_hooks_removed_after() if not compiled else contextlib.nullcontext(),
            contextlib.nullcontext() if compiled else ModTracker() as tracker,
            self._collectives_marked(),
            warnings.catch_warnings(),
        ):
            # A trial that runs out of its budget raises inside a module's forward; ModTracker's always-called
            # forward hook then finds its module stack unwound and says so in a UserWarning, or torch silences the
            # hook's error with one (seen with transformers 5.25). The trial's own error is what counts, and
            # ModTracker only names the peak's module: its warnings, under an "error" filter (pytest's), would
            # stand in the trial's place.
            warnings.filterwarnings("ignore", message="global module forward hook with ``always_call=True``")
            warnings.filterwarnings("ignore", message="The module hierarchy tracking")
            if compiled:
                self._deferred, self._meter, self._events, self._held = recorded, meter, [], []
            else:
                self._events, self._held = recorded.events, recorded.held
                self._event_key = meter.event_key
            self._tracker = tracker
            self._phases = [(0, "model")]
            meter.recorder = self
            try:
                yield
            finally:
                meter.recorder = None
                self._tracker = None
                self._meter = None

    @contextmanager
    def _collectives_marked(self) -> Iterator[None]:
        """FSDP2's gathering and reduce-scattering methods, and DDP's forward preamble, mark their spans while the
        trial is recorded (put back after it)."""
        from torch.nn.parallel import DistributedDataParallel

        try:
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        except ImportError:  # a torch without FSDP2: DDP's alone
            marked_methods: list[tuple[Any, str]] = []
        else:
            marked_methods = [(FSDPParamGroup, name) for name in _COLLECTIVE_METHODS]
        marked_methods += [(DistributedDataParallel, name) for name in _DDP_COLLECTIVE_METHODS]
        originals = {(owner, name): getattr(owner, name) for owner, name in marked_methods}

        def marked(original: Any) -> Any:
            def method(*args: Any, **kwargs: Any) -> Any:
                self._enter_collective(True)
                try:
                    return original(*args, **kwargs)
                finally:
                    self._enter_collective(False)

            return method

        for (owner, name), original in originals.items():
            setattr(owner, name, marked(original))
        try:
            yield
        finally:
            for (owner, name), original in originals.items():
                setattr(owner, name, original)

    def _enter_collective(self, entering: bool) -> None:
        self._collective_depth += 1 if entering else -1
        if self._events is not None and self._collective_depth == (1 if entering else 0):
            if not self._mark_later("collective", entering):
                self._collective.append((len(self._events), entering))

    def phase(self, name: str) -> None:
        """The allocations from now on were made in phase ``name`` (a key of the phase table above)."""
        if self._events is not None and not self._mark_later("phase", name):
            self._phases.append((len(self._events), name))

    def classify(self, tensors: Iterable[torch.Tensor | None], part: str) -> None:
        """The live storages of tensors are ``part`` (one of MEMORY_PARTS), for their whole lives."""
        if self._events is None:
            return
        from autotune.measure.meters.cpu import _storages

        storages = _storages([t for t in tensors if t is not None])
        if self._deferred is not None:  # a compiled trial's real storages: placed by address among its events
            self._mark_later("known", [(storage.data_ptr(), part) for storage in storages if storage.nbytes()])
            return
        index = len(self._events)
        for storage in storages:
            key = self._event_key(storage)
            if key is not None:
                self._known.append((index, key, part))

    def _mark_later(self, kind: str, what: Any) -> bool:
        """In a compiled trial's recording: keep (kind, what) to be placed where its mark falls among the events
        (True). Otherwise False: the caller places it now."""
        if self._deferred is None:
            return False
        if self._meter is not None:
            self._meter.record_mark(len(self._pending))
            self._pending.append((kind, what))
        return True

    def _place_deferred(self) -> bool:
        """A compiled trial's events and what was marked among them, as an eager trial's recording holds them (keys
        per allocation, by address while it lives). False where they cannot be had whole (no breakdown then)."""
        deferred = self._deferred
        if not deferred.filled or not deferred.whole:
            return False
        events: list[tuple[int, int]] = []
        self._events = events
        live: dict[int, int] = {}  # address -> key of the block living there
        serial = 0
        for address, nbytes in deferred.held:
            serial += 1
            live[address] = serial
            self._held.append((serial, nbytes))
        for kind, where, nbytes in deferred.items:
            if kind == "alloc":
                serial += 1
                live[where] = serial
                events.append((serial, nbytes))
            elif kind == "free":
                key = live.pop(where, None)
                if key is not None:  # a block from before the recording: never counted, as the meter does
                    events.append((key, FREE))
            elif where < len(self._pending):
                index = len(events)
                what, said = self._pending[where]
                if what == "phase":
                    self._phases.append((index, said))
                elif what == "collective":
                    self._collective.append((index, said))
                else:
                    self._known += [(index, live[address], part) for address, part in said if address in live]
        return True

    def classify_model(self, model: nn.Module) -> None:
        params = list(model.parameters())
        self.classify([p for p in params if p.requires_grad], "trainable_parameters")
        self.classify([p for p in params if not p.requires_grad], "frozen_parameters")
        self.classify(model.buffers(), "buffers")

    def classify_gradients(self, model: nn.Module) -> None:
        self.classify((p.grad for p in model.parameters()), "gradients")

    def classify_optimizer(self, optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # a wrapper (LightningOptimizer, accelerate's) holds one
        state = getattr(inner, "state", {})
        tensors = [v for values in state.values() if isinstance(values, dict) for v in values.values()]
        self.classify((t for t in tensors if isinstance(t, torch.Tensor)), "optimizer_state")

    def note_peak(self, peak_bytes: int, what: Any) -> None:
        """The meter's live bytes reached peak_bytes at an allocation by ``what`` (an operator, or a text): the
        place of the trial's peak, where it is the highest yet."""
        if peak_bytes <= self._best:
            return
        self._best = peak_bytes
        tracker = self._tracker
        module, backward = "", False
        if tracker is not None:
            running = [name for name in tracker.parents if name != "Global"]
            # The innermost running module, the longest name; between two as long, the last by name (the set's own
            # order is its strings' hashes', which differ from process to process).
            module = max(running, key=_innermost) if running else ""
            backward = bool(tracker.is_bw)
        op = getattr(what, "__name__", None) or str(what)
        phase = self._phases[-1][1] if self._phases else ""
        where = f"{module} {'backward' if backward else 'forward'}" if module else phase
        self._peak_label = f"{op} in {where}" if where else op

    def breakdown(self, micro_batch: int, fits: bool, peak_bytes: int) -> MemoryBreakdown | None:
        """The recorded trial's peak by part, and its timeline. ``peak_bytes``: the trial's peak as the meter read
        it; the parts sum to it, and where they do not (a storage the meter counted outside its events) there is
        no breakdown (None) rather than a wrong one."""
        assert self._events is not None, "breakdown() after recording()"
        if self._deferred is not None and not self._events and not self._place_deferred():
            return None
        phases = [[index, name] for index, name in self._phases]
        if self._deferred is not None:  # no operator is seen inside a compiled graph: the phase it peaked in
            best_index = _peak_of(self._held, self._events, self._categories())[2]
            at = ([""] + [name for index, name in self._phases if index < best_index])[-1]
            self._peak_label = f"compiled code in the {at}" if at else "compiled code"
        return breakdown_of(
            self._held, self._events, self._categories(), phases, self._peak_label, micro_batch, fits, peak_bytes
        )

    def _categories(self) -> list[str]:
        """The category of every allocation, by serial (held storages first, then each allocation event)."""
        assert self._events is not None
        categories: list[str] = []
        live: dict[int, int] = {}  # event key -> serial
        for key, _ in self._held:
            live[key] = len(categories)
            categories.append(_PHASE_PART["held"])
        known = sorted(self._known, key=lambda k: k[0])
        phases = self._phases
        collective = self._collective
        next_known = next_phase = next_collective = 0
        phase = _PHASE_PART["held"]
        in_collective = False
        for index, (key, nbytes) in enumerate([*self._events, (0, 0)]):
            while next_known < len(known) and known[next_known][0] <= index:
                _, known_key, part = known[next_known]
                if known_key in live:
                    categories[live[known_key]] = part
                next_known += 1
            while next_phase < len(phases) and phases[next_phase][0] <= index:
                phase = _PHASE_PART[phases[next_phase][1]]
                next_phase += 1
            while next_collective < len(collective) and collective[next_collective][0] <= index:
                in_collective = collective[next_collective][1]
                next_collective += 1
            if index == len(self._events):
                break
            if nbytes == FREE:
                live.pop(key, None)
            else:
                live[key] = len(categories)
                categories.append("collectives" if in_collective else phase)
        return categories


def _innermost(name: str) -> tuple[int, str]:
    return len(name), name


def _peak_of(
    held: list[tuple[int, int]], events: list[tuple[int, int]], categories: list[str]
) -> tuple[int, list[int], int, list[list[int]]]:
    """Replay held storages and events with each allocation's category (by serial, held first): the peak's total,
    its parts (by MEMORY_PARTS' order), its event (1-based; 0 the held storages) and every event's point."""
    parts_index = {part: i for i, part in enumerate(MEMORY_PARTS)}
    live = [0] * len(MEMORY_PARTS)
    where: dict[int, tuple[int, int]] = {}  # key -> (part index, bytes)
    for serial, (key, nbytes) in enumerate(held):
        part = parts_index[categories[serial]]
        where[key] = (part, nbytes)
        live[part] += nbytes
    points: list[list[int]] = [[0, *live]]
    best = sum(live)
    best_parts = list(live)
    best_index = 0
    serial = len(held)
    for index, (key, nbytes) in enumerate(events, start=1):
        if nbytes == FREE:
            gone = where.pop(key, None)
            if gone is None:  # a storage the recording never saw get bytes: nothing to take off
                points.append([index, *live])
                continue
            part, freed = gone
            live[part] -= freed
        else:
            part = parts_index[categories[serial]]
            serial += 1
            where[key] = (part, nbytes)
            live[part] += nbytes
        points.append([index, *live])
        total = sum(live)
        if total > best:
            best, best_parts, best_index = total, list(live), index
    return best, best_parts, best_index, points


def breakdown_of(
    held: list[tuple[int, int]],
    events: list[tuple[int, int]],
    categories: list[str],
    phases: list[list[Any]],
    peak_label: str,
    micro_batch: int,
    fits: bool,
    peak_bytes: int,
) -> MemoryBreakdown | None:
    """A recorded trial's peak by part and its timeline, from its held storages and events (``(key, bytes)``, bytes
    ``FREE`` for a release), each allocation's category by serial (held first), the phases' marks ([event, name])
    and the place of the peak. None where the parts do not sum to ``peak_bytes`` (a storage the meter counted
    outside its events): no breakdown rather than a wrong one. What :meth:`BreakdownRecorder.breakdown` returns, and
    what a trace made for a deeper model (autotune/search/depth.py) gives."""
    best, best_parts, best_index, points = _peak_of(held, events, categories)
    if best != peak_bytes:
        return None
    return MemoryBreakdown.model_validate(
        {
            "micro_batch": micro_batch,
            "fits": fits,
            "peak_bytes": best,
            "parts": {part: best_parts[i] for i, part in enumerate(MEMORY_PARTS) if best_parts[i]},
            "peak_event": best_index,
            "peak_where": peak_label[:256],
            "events": len(events),
            "timeline": _thinned(points, best_index, TIMELINE_POINTS),
            "phases": _phase_starts(phases),
        }
    )


def with_card_parts(
    live: MemoryBreakdown, *, reserved_bytes: int, outside_bytes: int, fits: bool
) -> MemoryBreakdown | None:
    """A card's figure broken down: the live tensors' parts at their peak (``live``, a fake trial's), the caching
    allocator's reserve beyond them (its peak reserved bytes, by its model, less the live peak: cached blocks,
    rounding, the cuBLAS workspaces) and the memory outside the allocator. They sum to the figure the card's
    search decides on, reserved + outside. The timeline stays the live tensors' (the card's parts at 0 there).
    None where the reserved bytes are below the live peak, which a replay of the same storages cannot give: no
    breakdown rather than a wrong one."""
    reserve = reserved_bytes - live.peak_bytes
    if reserve < 0:
        return None
    parts = dict(live.parts)
    parts.update({"allocator_reserve": reserve, "outside_allocator": outside_bytes})
    return live.model_copy(
        update={
            "parts": {part: parts[part] for part in MEMORY_PARTS if parts.get(part)},
            "peak_bytes": reserved_bytes + outside_bytes,
            "fits": fits,
        }
    )


def _thinned(points: list[list[int]], peak_index: int, count: int) -> list[list[int]]:
    """At most about ``count`` points of the timeline: in each of ``count`` spans of events, the point with the
    most live bytes (a stacked area drawn through them keeps every span's highest), and the peak's own point."""
    if len(points) <= count:
        return points
    span = len(points) / count
    kept: list[list[int]] = []
    for i in range(count):
        chunk = points[int(i * span) : int((i + 1) * span)] or [points[-1]]
        kept.append(max(chunk, key=lambda p: sum(p[1:])))
    if all(p[0] != peak_index for p in kept):
        kept.append(points[peak_index])
        kept.sort(key=lambda p: p[0])
    return kept


def _phase_starts(phases: list[list[Any]]) -> list[list[Any]]:
    """Each change of phase once (a phase marked twice in a row, at the same event or not, is one)."""
    starts: list[list[Any]] = []
    for index, name in phases:
        if starts and starts[-1][1] == name:
            continue
        if starts and starts[-1][0] == index:
            starts[-1] = [index, name]
            continue
        starts.append([index, name])
    return starts[:512]


@contextmanager
def _grad_hooks_removed_after() -> Iterator[None]:
    """ModTracker's backward hooks, each removed when the recording ends. ModTracker registers a multi-grad hook on the
    inputs and outputs of every module's forward and drops the handle; torch's hook closure holds the grad_fns it
    hooks, so each hooked node holds itself, and with it the graph behind it down to the leaves' AccumulateGrad
    nodes, past the trial: the model's parameters never died (under --offload params FSDP2's 112,000 B of host
    shards of the test GPT stayed live into the next runner's trials). Removed, the cycles are gone."""
    from torch.distributed._tools import mod_tracker

    registered: list[Any] = []
    register = mod_tracker.register_multi_grad_hook

    def register_kept(*args: Any, **kwargs: Any) -> Any:
        handle = register(*args, **kwargs)
        registered.append(handle)
        return handle

    mod_tracker.register_multi_grad_hook = register_kept  # type: ignore[assignment]
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register
        for handle in registered:
            handle.remove()


def with_host_parts(
    breakdown: MemoryBreakdown, host_peak_bytes: int | None, host_parts: dict[str, int]
) -> MemoryBreakdown:
    """``breakdown`` with the host's peak of the same trial by part (autotune/measure/meters/host.py replays the
    host ledger's changes with each storage's part) where an offload gave the trial a host figure and the parts sum
    to it; as it was otherwise (no offload, or a host change the ledger did not see)."""
    if host_peak_bytes is None or sum(host_parts.values()) != host_peak_bytes:
        return breakdown
    return breakdown.model_copy(update={"host_peak_bytes": host_peak_bytes, "host_parts": dict(host_parts)})
