"""The depth shortcut: a card's fake trials of a model of identical blocks at the cost of a few of its blocks.

A fake trial costs the Python dispatch of its ops, so the whole walk of a model costs as its depth (Llama 3.1 70B's
80 blocks). Its trace does not need it: the blocks are identical, and so is what each does to the trace (docs/
depth.md). At each size the card's search asks for, the model cut to a + s blocks is walked (autotune/search/
depth_walks.py); at the first size, and wherever that walk's sequence is not the template's but for its sizes, the
cuts to a and a + 2s blocks are walked too and the template learnt again (autotune/search/depth_template.py). The
template made at the model's depth is the whole walk's trace, to the byte: the caching allocator's model replays it
as it replays the whole walk's, and the meter's figures and the breakdown are read from it as the meter and the
breakdown's recorder read them (autotune/search/depth_figures.py). Each walk's own tokens are first held to what its
trial read (its peaks, its breakdown), so a rule of the meter the tokens miss shows as a refusal, not as a figure.

Where the repetition cannot be shown (blocks that differ, a CNN; walks that do not repeat as the rules say; an
offload, whose host bytes the tokens do not carry; a pipeline's stages), :class:`ShortcutUnavailable` says why, and
the search walks the whole model: ``--full-walk`` asks for that anyway, to check the shortcut against it.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autotune.core.schemas import MemoryBreakdown, Trial
from autotune.measure.breakdown import breakdown_of
from autotune.measure.strategies import Strategy
from autotune.search.depth_figures import events_of, meter_figures, peak_label, phases_of
from autotune.search.depth_template import NoRepetition, Template, Walk, learn_template
from autotune.search.depth_walks import Blocks, CutWalker, RecordedWalk, repeated_blocks
from autotune.tasks.task import ProbeTask

__all__ = ["BASE_DEPTH", "CutWalks", "DepthShortcut", "SharedWalks", "ShortcutUnavailable", "Walked", "plan_shortcut"]

# The shallowest cut: 2 blocks and the two walks after it (3 and 4) are where Llama, GPT-2 and Mixtral's traces
# repeat (the first and last blocks differ from the middle ones: FSDP2's prefetch, the embedding's output).
BASE_DEPTH = 2
# Below this many blocks the whole walk costs no more than the three cut walks a first size needs.
MIN_BLOCKS = 8


class ShortcutUnavailable(Exception):
    """The shortcut cannot stand in for the whole walk here: why, in one line (the datasheet says it)."""


@dataclass
class Walked:
    """One trial as the whole walk would have recorded it: the trial the runner returns, the recording (held
    storages, events, each allocation's stream by key) and the breakdown the runner's recorder gives (None: none
    asked for, or none to give)."""

    trial: Trial
    held: list[tuple[int, int]]
    events: list[tuple[int, int]]
    streams: dict[int, int]
    # The breakdown, or how to make it when it is read (it costs seconds for a deep model's walk).
    breakdown: MemoryBreakdown | Callable[[], MemoryBreakdown | None] | None


def plan_shortcut(task: ProbeTask, strategy: Strategy) -> tuple[Blocks, int] | str:
    """The task's repeated blocks and the period of their policy, where the shortcut can walk the task; else why
    not (the datasheet's words; empty where the model has too few blocks for the shortcut to pay)."""
    if task.offload != "none":
        return f"--offload {task.offload}: the host's bytes are walked whole"
    if getattr(strategy, "measures_buckets", False):
        # DDP's reducer holds every gradient in its buckets (FakeReplicas: one flat bucket per dtype at first), whose
        # size grows with the depth rather than repeating with the blocks.
        return "DDP's gradient buckets hold the whole model's gradients, not a block's"
    found = repeated_blocks(task)
    if isinstance(found, str):
        return found
    step = _period(task.activation_checkpointing)
    if found.count < max(MIN_BLOCKS, BASE_DEPTH + 2 * step + 1):
        return ""  # too few blocks for the shortcut to pay: nothing to say
    return found, step


def _period(policy: str) -> int:
    """Blocks after which the policy's choice of blocks repeats (every-K checkpoints blocks 0, K, 2K, ...)."""
    if policy.startswith("every-"):
        return int(policy.split("-", 1)[1])
    return 1


# Where a trial starts, as the whole walk's runner holds its model: built before the trial and never trained
# (a sharded job's first trial: FSDP2's first iteration initialises what the later ones reuse), trained (steady),
# or to be built inside the trial (a replicated job's first trial, and any trial after an OOM dropped the model).
FRESH, STEADY, REBUILT = "fresh", "steady", "rebuilt"


@dataclass(frozen=True)
class SharedWalks:
    """Where the templates of one task, setup and length on cards of one architecture are kept across processes (a
    folder the caller made for one run over several cards, and the key of this search in it: the walks never read
    the card's memory, so a card with more of it asks the same walks)."""

    folder: Path
    key: str

    def path(self, start: str, micro_batch: int) -> Path:
        return self.folder / f"{self.key}-{start}-{micro_batch}.pickle"

    def load(self, start: str, micro_batch: int) -> Template | None:
        path = self.path(start, micro_batch)
        if not path.is_file():
            return None
        with path.open("rb") as made:
            template: Template = pickle.load(made)  # written by this run's own children (the caller's folder)
        return template

    def save(self, start: str, micro_batch: int, template: Template) -> None:
        path = self.path(start, micro_batch)
        written = path.with_suffix(".part")
        with written.open("wb") as out:
            pickle.dump(template, out, protocol=pickle.HIGHEST_PROTOCOL)
        written.replace(path)


class CutWalks:
    """The model cut to a, a + s and a + 2s blocks (:class:`CutWalker` each, holding its model between walks) and
    the templates learnt from them, by (the trial's start, micro-batch), with ``shared`` where other cards' searches
    keep theirs. ``build_first``: the whole walk builds its model before its first trial (a sharded job)."""

    def __init__(
        self,
        task: ProbeTask,
        blocks: Blocks,
        step: int,
        *,
        strategy: Strategy,
        device_type: str,
        device_name: str,
        breakdown: bool,
        build_first: bool,
        shared: SharedWalks | None = None,
    ) -> None:
        self.blocks, self.step, self.breakdown, self.build_first = blocks, step, breakdown, build_first
        self.shared = shared
        base = BASE_DEPTH + (blocks.count - BASE_DEPTH) % step
        self.depths = (base, base + step, base + 2 * step)
        self.walkers = {
            depth: CutWalker(
                task,
                blocks,
                depth,
                strategy=strategy,
                device_type=device_type,
                device_name=device_name,
                breakdown=breakdown,
            )
            for depth in self.depths
        }
        self.first = FRESH if build_first else REBUILT  # where the whole walk's first trial starts
        self.state = dict.fromkeys(self.depths, REBUILT)  # each walker's model, as it is now
        self.templates: dict[tuple[str, int], Template] = {}
        self._shapes: dict[str, list[Template]] = {}  # the templates of each start, the latest last
        self._proven: dict[str, Template] = {}  # of each start, the latest learnt from three walks
        self.learnt_at: list[tuple[str, int]] = []

    def close(self) -> None:
        for depth, walker in self.walkers.items():
            walker.close()
            self.state[depth] = REBUILT

    def template(self, start: str, micro_batch: int) -> Template:
        """The template of a trial at ``micro_batch`` that starts as ``start`` says (the cache's, else the middle
        walk carried from a template of that start, else the three walks learnt from).

        Raises:
            ShortcutUnavailable: the walks do not show the repetition (or a walk's tokens do not read its trial).
        """
        known = self.templates.get((start, micro_batch))
        if known is None and self.shared is not None:
            known = self.shared.load(start, micro_batch)
        if known is not None:
            self.templates[(start, micro_batch)] = known
            return known
        a, b, c = self.depths
        middle = self._walk(b, start, micro_batch)
        shapes = self._shapes.setdefault(start, [])
        template = next((t for t in (t.at_sizes_of(middle) for t in reversed(shapes)) if t is not None), None)
        if template is None:
            template = self._learnt(start, micro_batch, middle)
            self.learnt_at.append((start, micro_batch))
        shapes.append(template)
        del shapes[:-4]  # a few recent ones to carry from: sizes change the fixed part rarely
        self.templates[(start, micro_batch)] = template
        if self.shared is not None:
            self.shared.save(start, micro_batch, template)
        return template

    def _learnt(self, start: str, micro_batch: int, middle: Walk) -> Template:
        """A template learnt at this size: from the walks of a and a + s blocks where a template learnt from three
        (the latest of this start, else of another) settles what two leave open, else from the three walks."""
        a, b, c = self.depths
        shallow = self._walk(a, start, micro_batch)
        prior = self._proven.get(start) or next(iter(self._proven.values()), None)
        if prior is not None:
            try:
                return learn_template([shallow, middle], a, self.step, prior=prior)
            except NoRepetition:
                pass  # the three walks settle it
        walks = [shallow, middle, self._walk(c, start, micro_batch)]
        try:
            self._proven[start] = learn_template(walks, a, self.step)
        except NoRepetition as exc:
            raise ShortcutUnavailable(f"the walks of {a}, {b} and {c} blocks do not repeat: {exc}") from None
        return self._proven[start]

    def _walk(self, depth: int, start: str, micro_batch: int) -> Walk:
        """The cut walk of a trial that starts as ``start`` says (the walker's model brought there first), its
        tokens held to what its trial read."""
        walker = self.walkers[depth]
        if self.state[depth] != start:
            if start == STEADY:  # a trial at this size, not recorded, makes the model a trained one
                walker(micro_batch)
            else:
                walker.close()
                if start == FRESH:
                    walker.build()
        recorded = walker(micro_batch)
        self.state[depth] = STEADY
        _check(recorded, depth, micro_batch)
        return recorded.walk

    @property
    def runner_warnings(self) -> list[str]:
        """The cut trials' own warnings (the attention kernel they ran, ...), each once."""
        seen: list[str] = []
        for walker in self.walkers.values():
            seen.extend(w for w in walker.runner.warnings if w not in seen)
        return seen

    @property
    def unmodelled(self) -> list[str]:
        """What the kernels' temporaries leave out (autotune/measure/meters/temporaries.py), as the whole walk's
        meter says it."""
        return sorted({line for walker in self.walkers.values() for line in walker.meter.unmodelled})


def _check(recorded: RecordedWalk, depth: int, micro_batch: int) -> None:
    """A cut walk's tokens read as its trial read (its peaks, its breakdown): else ShortcutUnavailable."""
    walk, trial = recorded.walk, recorded.trial
    figures = meter_figures(walk, 1 << 62)
    read = (trial.peak_bytes, trial.forward_backward_bytes, trial.step_bytes)
    made = (figures.peak_bytes, figures.forward_backward_bytes, figures.step_bytes)
    if trial.oom or made != read:
        raise ShortcutUnavailable(f"the walk of {depth} blocks at m = {micro_batch} reads {read}, its tokens {made}")
    if recorded.breakdown is not None:
        held, events, _, categories = events_of(walk)
        label = peak_label(walk)
        parts = breakdown_of(held, events, categories, phases_of(walk), label, micro_batch, True, trial.peak_bytes)
        if parts is None or parts.model_dump() != recorded.breakdown.model_copy(update={"fits": True}).model_dump():
            raise ShortcutUnavailable(
                f"the walk of {depth} blocks at m = {micro_batch}: its tokens break down otherwise than its trial"
            )


class DepthShortcut:
    """One search's trials of the task at its full depth, made from :class:`CutWalks` (the module docstring), under
    the card's ``budget_bytes``: the trials start as the whole walk's runner's would (the first one fresh or built
    inside it, the next ones steady, the one after an OOM built inside it again)."""

    def __init__(self, walks: CutWalks, budget_bytes: int) -> None:
        self.walks, self.budget_bytes = walks, budget_bytes
        self.start = walks.first

    def describe(self) -> str:
        """The datasheet's line."""
        walks = self.walks
        a, b, c = walks.depths
        count = walks.blocks.count
        at = ", ".join(str(m) for _, m in walks.learnt_at)
        blocks = f"depth: {count} identical {walks.blocks.kind} blocks ({walks.blocks.path}); "
        same = f", the same bytes as walking all {count} (--full-walk walks them)"
        if not at:
            return f"{blocks}every trial repeated from walks of {a}, {b} and {c} that another card's search made{same}"
        walked = f"each trial walked {b} of them and the rest repeated from walks of {a}, {b} and {c} (at m = {at})"
        return f"{blocks}{walked}{same}"

    def trial(self, micro_batch: int) -> Walked:
        """The trial at ``micro_batch`` as the whole walk would have run it.

        Raises:
            ShortcutUnavailable: the walks do not show the repetition here (the caller walks the whole model).
        """
        started = time.perf_counter()
        template = self.walks.template(self.start, micro_batch)
        depth = self.walks.blocks.count
        try:
            full = template.expand(depth)
        except NoRepetition as exc:
            raise ShortcutUnavailable(str(exc)) from None
        figures = meter_figures(full, self.budget_bytes)
        if figures.crossed_before_measure:
            raise ShortcutUnavailable("the model alone crosses the card's memory before its trial")
        seconds = round(time.perf_counter() - started, 6)
        held, events, streams, categories = events_of(full)
        if figures.oom:
            # The whole walk's runner drops a model an OOM stopped mid-step and builds it in the next trial.
            self.start = REBUILT
            trial = Trial(micro_batch=micro_batch, peak_bytes=figures.peak_bytes, fits=False, oom=True, seconds=seconds)
            return Walked(trial, held, events, streams, None)
        self.start = STEADY
        fits = figures.peak_bytes <= self.budget_bytes
        trial = Trial(
            micro_batch=micro_batch,
            peak_bytes=figures.peak_bytes,
            fits=fits,
            seconds=seconds,
            forward_backward_bytes=figures.forward_backward_bytes,
            step_bytes=figures.step_bytes,
        )
        parts = None
        if self.walks.breakdown and any(categories):
            peak = trial.peak_bytes

            def parts() -> MemoryBreakdown | None:
                again = template.expand(depth)
                held, events, _, categories = events_of(again)
                label = peak_label(again)
                return breakdown_of(held, events, categories, phases_of(again), label, micro_batch, fits, peak)

        return Walked(trial, held, events, streams, parts)
