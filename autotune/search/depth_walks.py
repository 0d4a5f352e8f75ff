"""Walks of a model cut to a few of its blocks: the model's repeated blocks found and checked identical, the task
whose model keeps the first d of them, and a fake trial of it recorded as tokens (autotune/search/depth_figures.py
says what each is) with what the trial itself read, to check the tokens against.

Call inside the strategy's process group and a frozen heap, as every fake trial runs.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed._tools.mod_tracker import ModTracker

from autotune.core.schemas import MemoryBreakdown, Trial
from autotune.measure.breakdown import BreakdownRecorder
from autotune.measure.meters.cpu import _StorageLedger
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.strategies import Strategy, shard_units
from autotune.measure.trial import TrialRunner, build_on_meta
from autotune.search.depth_template import Walk
from autotune.tasks.task import ProbeTask

__all__ = ["Blocks", "CutWalker", "RecordedWalk", "cut_task", "repeated_blocks"]

# The config keys that count a transformers model's layers (autotune/tasks/hf.py reads the same).
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "decoder_layers", "num_decoder_layers")
# What a block may differ in and still be the same block: its own index.
_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_number", "block_idx", "idx", "index"})


@dataclass(frozen=True)
class Blocks:
    """The model's repeated blocks: how many, the qualified name of the ModuleList holding them, their class."""

    count: int
    path: str
    kind: str


def repeated_blocks(task: ProbeTask) -> Blocks | str:
    """The blocks of the task's model (built on meta: no memory) when they are one ModuleList of identical
    modules (the same classes, parameter and buffer shapes and settings, but for their index), else why not."""
    model = build_on_meta(task)
    if model is None:
        return "its model cannot be built on the meta device"
    units = shard_units(model, task.shard_classes)
    if len(units) < 2:
        return "it has no repeated blocks (no nn.ModuleList of them)"
    owner = next(
        (
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, nn.ModuleList) and list(module.children()) == units
        ),
        None,
    )
    if owner is None:
        return "its blocks are not the children of one nn.ModuleList"
    first = _signature(units[0])
    for index, unit in enumerate(units[1:], start=1):
        if _signature(unit) != first:
            return f"its blocks differ (block {index} is not block 0's like: another structure, shape or setting)"
    layer_types = getattr(getattr(model, "config", None), "layer_types", None)
    if isinstance(layer_types, list | tuple) and len(set(map(str, layer_types))) > 1:
        return f"its config gives its layers several types ({', '.join(sorted(set(map(str, layer_types))))})"
    return Blocks(len(units), owner[0], type(units[0]).__name__)


def _signature(block: nn.Module) -> list[Any]:
    """What makes two blocks the same block: every submodule's name, class and plain settings (but an index),
    every parameter's and buffer's name, shape, dtype and whether it trains."""
    signature: list[Any] = []
    for name, module in block.named_modules():
        settings = sorted(
            (key, value)
            for key, value in vars(module).items()
            if not key.startswith("_")
            and key not in _INDEX_ATTRIBUTES
            and isinstance(value, bool | int | float | str | type(None))
        )
        signature.append((name, type(module).__name__, tuple(settings)))
    for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
        signature.append((name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad))
    return signature


@dataclass(frozen=True)
class _CutModel:
    """A model factory keeping the first ``depth`` of the ``count`` blocks under ``path`` (and a transformers
    config's layer count, on a copy of the config, so that what the model sizes by its config follows)."""

    factory: Any
    path: str
    count: int
    depth: int

    def __call__(self) -> nn.Module:
        model = self.factory()
        blocks = model.get_submodule(self.path)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) != self.count:
            raise RuntimeError(f"the model's {self.path} is not the {self.count} blocks it was")
        owner = model.get_submodule(self.path.rpartition(".")[0]) if "." in self.path else model
        setattr(owner, self.path.rpartition(".")[2], nn.ModuleList(list(blocks)[: self.depth]))
        config = getattr(model, "config", None)
        if config is not None:
            cut = copy.copy(config)
            for key in _LAYER_KEYS:
                if getattr(config, key, None) == self.count:
                    setattr(cut, key, self.depth)
            for module in model.modules():
                if getattr(module, "config", None) is config:
                    module.config = cut
        return model


def cut_task(task: ProbeTask, blocks: Blocks, depth: int) -> ProbeTask:
    """The task with its model cut to its first ``depth`` blocks."""
    factory = getattr(task.model, "factory", task.model)  # ProbeTask wraps it again for its weights' dtype
    return dataclasses.replace(task, model=_CutModel(factory, blocks.path, blocks.count, depth))


class _MarkingLedger(_StorageLedger):
    """The storage ledger, with what the tokens need beside the events: which events a kernel's temporaries and a
    resize made, and the marks the meter and the recorder put between them."""

    def __init__(self) -> None:
        super().__init__()
        self.flags: dict[int, str] = {}  # event index -> "s" (a temporary), "r"/"p" (a resize's new/old bytes)
        self.marks: list[tuple[int, tuple[Any, ...]]] = []  # (events before it, mark token)
        self.block_of_mark: dict[int, int] = {}  # mark index -> the block it names

    def scratch(self, steps: list[tuple[str, int]]) -> None:
        before = len(self.events) if self.events is not None else 0
        super().scratch(steps)
        if self.events is not None:
            for index in range(before, len(self.events)):
                self.flags[index] = "s"

    def _resized(self, key: int, old_bytes: int, new_bytes: int) -> None:
        assert self.events is not None
        before = len(self.events)
        super()._resized(key, old_bytes, new_bytes)
        if len(self.events) == before + 2:
            self.flags[before], self.flags[before + 1] = "r", "p"

    def mark(self, token: tuple[Any, ...], block: int | None = None) -> None:
        if self.events is not None:
            if block is not None:
                self.block_of_mark[len(self.marks)] = block
            self.marks.append((len(self.events), token))


class _WalkMeter(FakeMeter):
    """The fake meter, marking each take of its peak and each change of whether its budget is enforced."""

    def __init__(self, budget_bytes: int, device_type: str, device_name: str | None) -> None:
        super().__init__(budget_bytes, device_type, device_name)
        self._ledger = _MarkingLedger()
        self._closing: str = ""

    @property
    def ledger(self) -> _MarkingLedger:
        assert isinstance(self._ledger, _MarkingLedger)
        return self._ledger

    def checkpoint(self, phase: str) -> None:
        self._closing = phase
        try:
            super().checkpoint(phase)
        finally:
            self._closing = ""

    def _take_peak(self) -> tuple[int, int | None]:
        self.ledger.mark(("K", self._closing))
        return super()._take_peak()

    @contextmanager
    def unbounded(self) -> Iterator[None]:
        self.ledger.mark(("E", False))
        try:
            with super().unbounded():
                yield
        finally:
            self.ledger.mark(("E", True))


class _WalkRecorder(BreakdownRecorder):
    """The breakdown's recorder, marking its phases, every note of a peak (its operator and whether the backward
    runs) and every change of the set of running modules it names the place of the peak by (ModTracker's
    ``parents``, which keeps the backward's stale entries: a label depends on all of them), each module's block
    index taken out of its name."""

    def __init__(self, ledger: _MarkingLedger, block_index: re.Pattern[str]) -> None:
        super().__init__()
        self._ledger = ledger
        self._block_index = block_index

    @contextmanager
    def recording(self, meter: Any) -> Iterator[None]:
        with super().recording(meter):
            tracker = self._tracker
            if tracker is not None:
                running = tracker.__dict__.pop("parents")
                tracker.__class__ = _WatchedTracker
                tracker._watcher = self
                tracker.parents = running
            yield

    def phase(self, name: str) -> None:
        super().phase(name)
        self._ledger.mark(("P", name))

    def note_peak(self, peak_bytes: int, what: Any) -> None:
        scratch = isinstance(what, str) and what.endswith("(the kernel's workspace)")
        op = getattr(what, "__name__", None) or str(what)
        backward = bool(self._tracker.is_bw) if self._tracker is not None else False
        self._ledger.mark(("N", "s" if scratch else "c", op, backward))
        super().note_peak(peak_bytes, what)

    def module_mark(self, change: str, name: str | None = None) -> None:
        """A module enters ("+") or leaves ("-") the running set, or the set is reset to {"Global"} ("0")."""
        if name is None:
            self._ledger.mark(("T", change))
            return
        found = self._block_index.findall(name)
        if not found:
            self._ledger.mark(("T", change, name))
            return
        self._ledger.mark(("T", change, self._block_index.sub("{}", name)), int(found[0]))


class _WatchedSet(set[str]):
    """ModTracker's running modules, each change told to the recorder."""

    def __init__(self, items: Any, watcher: _WalkRecorder) -> None:
        super().__init__(items)
        self.watcher = watcher

    def add(self, name: str) -> None:
        if name not in self:
            self.watcher.module_mark("+", name)
        super().add(name)

    def remove(self, name: str) -> None:
        self.watcher.module_mark("-", name)
        super().remove(name)


class _WatchedTracker(ModTracker):
    """A ModTracker whose ``parents`` (reset to {"Global"} after each backward) is always a :class:`_WatchedSet`."""

    _watcher: _WalkRecorder

    @property  # type: ignore[override]
    def parents(self) -> set[str]:
        return self.__dict__["_watched_parents"]  # type: ignore[no-any-return]

    @parents.setter
    def parents(self, running: set[str]) -> None:
        if set(running) != {"Global"}:
            raise RuntimeError(f"ModTracker's running modules were set to {sorted(running)}, not reset")
        self._watcher.module_mark("0")
        self.__dict__["_watched_parents"] = _WatchedSet(running, self._watcher)


class _PhaseMarks:
    """What a trial tells a breakdown's recorder, heard only for its phases: a walk without a breakdown still marks
    them, for the walks to be diffed phase by phase (autotune/search/depth_template.py)."""

    def __init__(self, ledger: _MarkingLedger) -> None:
        self._ledger = ledger

    def phase(self, name: str) -> None:
        self._ledger.mark(("P", name))

    def note_peak(self, peak_bytes: int, what: Any) -> None:
        pass

    def classify_model(self, model: nn.Module) -> None:
        pass

    def classify_gradients(self, model: nn.Module) -> None:
        pass

    def classify_optimizer(self, optimizer: Any) -> None:
        pass

    def classify(self, tensors: Any, part: str) -> None:
        pass


@dataclass
class RecordedWalk:
    """One walk: its tokens, and what its trial read (to hold the tokens' figures to)."""

    walk: Walk
    trial: Trial
    breakdown: MemoryBreakdown | None
    seconds: float


class _Runner(TrialRunner):
    """A TrialRunner whose breakdown recorder marks the walk (:class:`_WalkRecorder`)."""

    walker: CutWalker

    def _recorder(self) -> Any:
        if super()._recorder() is None:  # none asked for, or a meter that records none
            return None
        recorder = _WalkRecorder(self.walker.meter.ledger, self.walker.block_index)
        self.walker.recorder = recorder
        return recorder


class CutWalker:
    """Fake trials of the task cut to ``depth`` blocks, on a meter of its own (its model stays built between
    trials, as the whole walk's does), each recorded as a :class:`RecordedWalk`.

    ``budget_bytes`` is where the whole walk's meter would refuse (the tokens carry the marks to find it); the cut's
    own meter never refuses, so that every walk is whole."""

    def __init__(
        self,
        task: ProbeTask,
        blocks: Blocks,
        depth: int,
        *,
        strategy: Strategy,
        device_type: str,
        device_name: str,
        breakdown: bool,
    ) -> None:
        self.depth = depth
        self.meter = _WalkMeter(1 << 62, device_type, device_name)
        self.block_index = re.compile(r"(?<=\." + re.escape(blocks.path) + r"\.)\d+(?=\.|\s|$)")
        self.recorder: _WalkRecorder | None = None
        self.runner = _Runner(cut_task(task, blocks, depth), self.meter, limit_bytes=1 << 62, strategy=strategy)
        self.runner.walker = self
        self.runner.breakdowns = {} if breakdown else None

    def build(self) -> None:
        """Build the cut model now (a sharded job's model is built before its first trial)."""
        self.runner.build()

    def close(self) -> None:
        """Drop the cut model: the next walk builds it inside its trial, as the whole walk's does after an OOM."""
        self.runner.close()

    def __call__(self, micro_batch: int) -> RecordedWalk:
        ledger = self.meter.ledger
        self.recorder = None
        self.meter.release()
        started = time.perf_counter()
        with self.meter.record_events() as recorded:
            ledger.flags, ledger.marks, ledger.block_of_mark = {}, [], {}
            if self.runner.breakdowns is None:
                self.meter.recorder = _PhaseMarks(ledger)
            try:
                trial = self.runner(micro_batch)
            finally:
                self.meter.recorder = None
        seconds = time.perf_counter() - started
        categories = self.recorder._categories() if self.recorder is not None else None
        breakdown = (self.runner.breakdowns or {}).get(micro_batch)
        walk = _tokens(recorded.held, recorded.events, recorded.streams, ledger, categories)
        ledger.flags, ledger.marks, ledger.block_of_mark = {}, [], {}
        return RecordedWalk(walk, trial, breakdown, seconds)


def _tokens(
    held: list[tuple[int, int]],
    events: list[tuple[int, int]],
    streams: dict[int, int],
    ledger: _MarkingLedger,
    categories: list[str] | None,
) -> Walk:
    """A recording as tokens (autotune/search/depth_figures.py): held storages, their end, then each event with the
    marks made before it; streams numbered in their order of first use."""
    tokens: list[tuple[Any, ...]] = []
    refs: list[int] = []
    blocks: list[int | None] = []
    alloc_at: dict[int, int] = {}  # live key -> its allocation token
    stream_index: dict[int, int] = {}
    serial = 0

    def allocation(key: int, nbytes: int, stream: int, flag: str) -> None:
        nonlocal serial
        alloc_at[key] = len(tokens)
        category = categories[serial] if categories is not None else ""
        serial += 1
        tokens.append(("A", nbytes, stream, flag, category))
        refs.append(-1)
        blocks.append(None)

    for key, nbytes in held:
        allocation(key, nbytes, 0, "h")
    tokens.append(("H",))
    refs.append(-1)
    blocks.append(None)
    marks = ledger.marks
    next_mark = 0
    for index, (key, nbytes) in enumerate([*events, (0, 0)]):
        while next_mark < len(marks) and marks[next_mark][0] <= index:
            tokens.append(marks[next_mark][1])
            refs.append(-1)
            blocks.append(ledger.block_of_mark.get(next_mark))
            next_mark += 1
        if index == len(events):
            break
        flag = ledger.flags.get(index, "")
        if nbytes >= 0:
            stream = streams.get(index)
            allocation(key, nbytes, stream_index.setdefault(stream, len(stream_index) + 1) if stream else 0, flag)
            continue
        at = alloc_at.pop(key, None)
        if at is None:
            tokens.append(("F0",))
            refs.append(-1)
        else:
            tokens.append(("F", tokens[at][1], tokens[at][2], flag))
            refs.append(at)
        blocks.append(None)
    return Walk(tokens, refs, blocks)
