"""The fake search for what a CUDA card decides on: reserved bytes + the memory outside the allocator.

Each fake trial's allocations and frees (``CpuMeter.record_events``), after the cuBLAS workspaces, are
replayed in order through the caching allocator's model (autotune/core/allocator.py); the search policy
(autotune/search/boundary.py) then finds the step of the allocator's staircase that crosses the limit,
not the crossing of the live bytes' line. Two callers:

- an emulated card's child process (autotune/emulation/card_search.py): the estimate for ``--gpu``;
- the probe on a real card (autotune/orchestrate/probe.py): its real trials start from this m_max, so
  that two of them confirm it where the model holds.

The named allocation beside the trace (no fudge factor: the source makes it): two cuBLAS workspaces, one
per handle, the forward thread's and the autograd engine's backward thread's (ATen/cuda/CublasHandlePool.cpp,
``getChosenWorkspaceSize``: 32 MiB on compute capability 9.x and up, 4096 * 1024 * 2 + 16 * 1024 * 8 bytes
before; ``CUBLAS_WORKSPACE_CONFIG`` overrides), made through the caching allocator at each thread's first
matmul and kept for the process's life.

Call inside the strategy's process group and a frozen heap, as every fake trial runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from autotune.core.allocator import AllocatorConfig, replay
from autotune.core.schemas import Fit, MemoryBreakdown, Trial
from autotune.measure.breakdown import with_card_parts
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.strategies import Strategy
from autotune.measure.trial import TrialRunner
from autotune.search.boundary import NoFitError, find_max_micro_batch
from autotune.search.depth import CutWalks, DepthShortcut, SharedWalks, ShortcutUnavailable, Walked, plan_shortcut
from autotune.tasks.task import ProbeTask

__all__ = ["CUBLAS_HANDLES", "ReservedSearch", "cublas_workspace_bytes", "renumbered", "reserved_search"]

# cuBLAS handles whose workspaces a training step holds: the forward thread's and the backward's.
CUBLAS_HANDLES = 2


def cublas_workspace_bytes(capability_major: int, config: str | None = None) -> int:
    """The workspace of one cuBLAS handle on a card of this compute capability (CublasHandlePool.cpp).

    ``config``: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs, their products summed), None for
    the default.

    >>> cublas_workspace_bytes(9) // 2**20
    32
    >>> cublas_workspace_bytes(8)
    8519680
    >>> cublas_workspace_bytes(9, ":4096:2:16:8") == 4096 * 1024 * 2 + 16 * 1024 * 8
    True
    """
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if capability_major >= 9:
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def renumbered(
    held: Sequence[tuple[int, int]], events: Sequence[tuple[int, int]], streams: Mapping[int, int] | None = None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], dict[int, int]]:
    """A trace's keys as small integers, one per allocation in order: a storage's address can come back
    for another storage once freed, and traces then compare across runs. A release of a storage the
    recording never saw gets key 0, which no allocation has. ``streams`` (an allocation event's index in events ->
    its stream, where not the default: StorageEvents.streams) comes back keyed by the new numbers.

    >>> renumbered([(7000, 64)], [(9000, 512), (7000, -1), (9000, -1), (7000, 32), (5, -1)], {3: 77})
    ([(1, 64)], [(2, 512), (1, -1), (2, -1), (3, 32), (0, -1)], {3: 77})
    """
    ids: dict[int, int] = {}
    counter = 0
    on_streams = streams or {}
    out_streams: dict[int, int] = {}

    def allocate(key: int, index: int) -> int:
        nonlocal counter
        counter += 1
        ids[key] = counter
        if index in on_streams:
            out_streams[counter] = on_streams[index]
        return counter

    out_held = [(allocate(key, -1), nbytes) for key, nbytes in held]
    out_events = [
        (ids.pop(key, 0), nbytes) if nbytes < 0 else (allocate(key, index), nbytes)
        for index, (key, nbytes) in enumerate(events)
    ]
    return out_held, out_events, out_streams


@dataclass
class ReservedSearch:
    """m_max by reserved + outside bytes, every trial run (by size), the fit, and whether nothing fits."""

    max_micro_batch: int
    trials: dict[int, Trial] = field(default_factory=dict)
    fit: Fit | None = None
    no_fit: bool = False
    warnings: list[str] = field(default_factory=list)
    # With breakdown=True: each trial's figure broken down (MemoryBreakdown), by micro-batch, made when read.
    breakdowns: Breakdowns = field(default_factory=lambda: Breakdowns())


class Breakdowns(Mapping[int, MemoryBreakdown]):
    """Each trial's breakdown on the card, by micro-batch, made when first read: a profile keeps two of them (m_max's
    and the next size's), and a deep model's made from its walks (autotune/search/depth.py) costs seconds. A size
    whose breakdown comes to None (parts that do not sum to the figure) is not in it."""

    def __init__(self) -> None:
        self._made: dict[int, MemoryBreakdown | None] = {}
        self._pending: dict[int, Callable[[], MemoryBreakdown | None]] = {}

    def later(self, micro_batch: int, make: Callable[[], MemoryBreakdown | None]) -> None:
        self._made.pop(micro_batch, None)
        self._pending[micro_batch] = make

    def _get(self, micro_batch: int) -> MemoryBreakdown | None:
        if micro_batch in self._pending:
            self._made[micro_batch] = self._pending.pop(micro_batch)()
        return self._made.get(micro_batch)

    def __getitem__(self, micro_batch: int) -> MemoryBreakdown:
        made = self._get(micro_batch)
        if made is None:
            raise KeyError(micro_batch)
        return made

    def __contains__(self, micro_batch: object) -> bool:
        return isinstance(micro_batch, int) and self._get(micro_batch) is not None

    def __iter__(self) -> Iterator[int]:
        return iter([m for m in sorted({*self._made, *self._pending}) if m in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def reserved_search(
    task: ProbeTask,
    *,
    device_type: str,
    device_name: str,
    budget_bytes: int,
    limit_bytes: int,
    outside_bytes: int,
    workspace_bytes: Sequence[int],
    strategy: Strategy,
    max_micro_batch: int,
    multiple_of: int,
    alloc_conf: str | None = None,
    extra_sizes: Sequence[int] = (),
    hint: int | None = None,
    breakdown: bool = False,
    depth_shortcut: bool = False,
    shared_walks: SharedWalks | None = None,
) -> ReservedSearch:
    """The search on fake trials replayed through the caching allocator (the module docstring).

    ``budget_bytes`` is the card's memory (what the allocator may hold is that less ``outside_bytes``);
    ``limit_bytes`` the figure that still fits; ``hint`` a predicted m_max to start from. ``breakdown``: each
    trial's figure broken down (autotune/measure/breakdown.py), the live tensors' parts with the allocator's reserve
    and the memory outside it, into ``breakdowns``. ``depth_shortcut``: a model of identical blocks walked as a few
    of them and the rest repeated, the same bytes (autotune/search/depth.py); where the repetition cannot be shown,
    every block is walked, and a warning says why. ``shared_walks``: where the searches of other cards of this
    architecture keep the templates they made (and this one keeps its own), so that none walks a size twice.
    """
    search = _Search(
        config=AllocatorConfig.parse(alloc_conf),
        # The workspaces come first: each is made at its thread's first matmul, before the trial's peak.
        workspaces=[(-(i + 1), int(n)) for i, n in enumerate(workspace_bytes)],
        budget_bytes=budget_bytes,
        limit_bytes=limit_bytes,
        outside_bytes=outside_bytes,
        max_micro_batch=max_micro_batch,
        multiple_of=multiple_of,
        extra_sizes=extra_sizes,
        hint=hint,
    )
    # A sharded job (fsdp, tp) never holds its whole model: the fake model is built whole, then sharded
    # (TrialRunner._ensure_model). Built inside the first trial's recording, the whole model's storages went through
    # the allocator's model and stayed reserved, cached: Mixtral 8x7B's first trial under fsdp 8 read 99.37 GiB at
    # any size, the later ones ~33 GiB less. Built before, the trials start from the shards (``held``), as the real
    # job and the emulated child's trials (child.py) do.
    build_first = not strategy.describes_replicas and task.compile is None
    why_whole = ""
    if depth_shortcut:
        planned = plan_shortcut(task, strategy)
        if isinstance(planned, str):
            why_whole = planned
        else:
            walks = CutWalks(
                task,
                *planned,
                strategy=strategy,
                device_type=device_type,
                device_name=device_name,
                breakdown=breakdown,
                build_first=build_first,
                shared=shared_walks,
            )
            shortcut = DepthShortcut(walks, budget_bytes)
            try:
                found = search.run(shortcut.trial)
                found.warnings.extend([*walks.runner_warnings, *walks.unmodelled, shortcut.describe()])
                return found
            except ShortcutUnavailable as exc:
                why_whole = str(exc)
            finally:
                walks.close()
    found = _whole_walk(task, search, device_type, device_name, strategy, breakdown, build_first)
    if why_whole:
        found.warnings.append(f"depth: every block walked, {why_whole}")
    return found


def _whole_walk(
    task: ProbeTask,
    search: _Search,
    device_type: str,
    device_name: str,
    strategy: Strategy,
    breakdown: bool,
    build_first: bool,
) -> ReservedSearch:
    """The search with every trial the whole model's (``--full-walk``)."""
    meter = FakeMeter(search.budget_bytes, device_type, device_name)
    runner = TrialRunner(task, meter, limit_bytes=search.budget_bytes, strategy=strategy)
    live_breakdowns: dict[int, MemoryBreakdown] | None = {} if breakdown else None
    runner.breakdowns = live_breakdowns

    def walked(micro_batch: int) -> Walked:
        meter.release()
        with meter.record_events() as recorded:
            live = runner(micro_batch)
        held, events, streams = renumbered(recorded.held, recorded.events, recorded.streams)
        return Walked(live, held, events, streams, (live_breakdowns or {}).get(micro_batch))

    warnings: list[str] = []
    try:
        if build_first:
            runner.build()
        found = search.run(walked)
    finally:
        runner.close()
        warnings.extend(runner.warnings)
    # Each a sentence of autotune/measure/meters/temporaries.py: what no rule gives, or the bound a rule states.
    found.warnings.extend([*warnings, *sorted(meter.unmodelled)])
    return found


@dataclass
class _Search:
    """The search's bounds and the card's figures, run over trials that come recorded (:meth:`run`)."""

    config: AllocatorConfig
    workspaces: list[tuple[int, int]]
    budget_bytes: int
    limit_bytes: int
    outside_bytes: int
    max_micro_batch: int
    multiple_of: int
    extra_sizes: Sequence[int]
    hint: int | None

    def run(self, walked: Callable[[int], Walked]) -> ReservedSearch:
        """The search, each trial ``walked(m)`` replayed through the allocator's model."""
        found = ReservedSearch(max_micro_batch=0)

        def trial(micro_batch: int) -> Trial:
            found.trials[micro_batch] = result = self._on_card(walked(micro_batch), found)
            return result

        try:
            searched = find_max_micro_batch(
                trial,
                limit_bytes=self.limit_bytes,
                max_micro_batch=self.max_micro_batch,
                multiple_of=self.multiple_of,
                hint=self.hint,
                far_extrapolation=1e9,  # fake trials: an overshoot costs no device
            )
            found.max_micro_batch, found.fit = searched.max_micro_batch, searched.fit
        except NoFitError:
            found.no_fit = True
        for size in self.extra_sizes:
            if size not in found.trials:
                trial(int(size))
        return found

    def _on_card(self, walked: Walked, found: ReservedSearch) -> Trial:
        """A recorded trial's figure on the card: reserved bytes by the allocator's model + the outside bytes."""
        live, micro_batch = walked.trial, walked.trial.micro_batch
        if live.oom:  # live bytes alone crossed the card's memory: no replay can fit
            return live.model_copy(update={"fake": True, "fits": False})
        trace = [*self.workspaces, *walked.held, *((k, n) for k, n in walked.events if k != 0)]
        peaks = replay(trace, self.config, self.budget_bytes - self.outside_bytes, streams=walked.streams)
        if peaks.oom:
            return Trial(micro_batch=micro_batch, peak_bytes=self.budget_bytes + 1, fits=False, oom=True, fake=True)
        figure = peaks.peak_reserved_bytes + self.outside_bytes
        result = Trial(
            micro_batch=micro_batch,
            peak_bytes=figure,
            fits=figure <= self.limit_bytes,
            step_bytes=live.step_bytes,
            allocated_bytes=peaks.peak_allocated_bytes,
            outside_allocator_bytes=self.outside_bytes,
            seconds=live.seconds,
            fake=True,
            host_peak_bytes=live.host_peak_bytes,  # --offload: the host's bytes (autotune/measure/offload.py)
        )
        live_parts, reserved, fits = walked.breakdown, peaks.peak_reserved_bytes, result.fits
        outside = self.outside_bytes
        if live_parts is not None:

            def on_card() -> MemoryBreakdown | None:
                parts = live_parts() if callable(live_parts) else live_parts
                if parts is None:
                    return None
                return with_card_parts(parts, reserved_bytes=reserved, outside_bytes=outside, fits=fits)

            found.breakdowns.later(micro_batch, on_card)
        return result
