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

import time
from dataclasses import dataclass

from autotune.core.schemas import MemoryBreakdown, Trial
from autotune.measure.breakdown import breakdown_of
from autotune.measure.strategies import Strategy
from autotune.search.depth_figures import events_of, meter_figures, peak_label, phases_of
from autotune.search.depth_template import NoRepetition, Template, learn_template
from autotune.search.depth_walks import Blocks, CutWalker, RecordedWalk, repeated_blocks
from autotune.tasks.task import ProbeTask

__all__ = ["BASE_DEPTH", "DepthShortcut", "ShortcutUnavailable", "Walked", "plan_shortcut"]

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
    breakdown: MemoryBreakdown | None


def plan_shortcut(task: ProbeTask, strategy: Strategy) -> tuple[Blocks, int] | str:
    """The task's repeated blocks and the period of their policy, where the shortcut can walk the task; else why
    not (the datasheet's words)."""
    if task.offload != "none":
        return f"--offload {task.offload}: the host's bytes are walked whole"
    found = repeated_blocks(task)
    if isinstance(found, str):
        return found
    step = _period(task.activation_checkpointing)
    if found.count < max(MIN_BLOCKS, BASE_DEPTH + 2 * step + 1):
        return f"{found.count} blocks: walking them all costs no more"
    return found, step


def _period(policy: str) -> int:
    """Blocks after which the policy's choice of blocks repeats (every-K checkpoints blocks 0, K, 2K, ...)."""
    if policy.startswith("every-"):
        return int(policy.split("-", 1)[1])
    return 1


class DepthShortcut:
    """Trials of the task at its full depth from walks of it cut to a, a + s and a + 2s blocks (the module
    docstring). ``build_first``: the whole walk builds its model before its first trial (a sharded job), so the cut
    walkers do too."""

    def __init__(
        self,
        task: ProbeTask,
        blocks: Blocks,
        step: int,
        *,
        strategy: Strategy,
        device_type: str,
        device_name: str,
        budget_bytes: int,
        breakdown: bool,
        build_first: bool,
    ) -> None:
        self.blocks, self.step, self.budget_bytes, self.breakdown = blocks, step, budget_bytes, breakdown
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
        if build_first:
            for walker in self.walkers.values():
                walker.build()
        self.templates: list[Template] = []
        self.learnt_at: list[int] = []  # the sizes a template was learnt at

    def describe(self) -> str:
        """The datasheet's line."""
        a, b, c = self.depths
        at = ", ".join(str(m) for m in self.learnt_at)
        return (
            f"depth: {self.blocks.count} identical {self.blocks.kind} blocks ({self.blocks.path}); each trial walked "
            f"{b} of them and the rest repeated from walks of {a}, {b} and {c} (at m = {at}), the same bytes as "
            f"walking all {self.blocks.count} (--full-walk walks them)"
        )

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

    def close(self) -> None:
        for walker in self.walkers.values():
            walker.close()

    def trial(self, micro_batch: int) -> Walked:
        """The trial at ``micro_batch`` as the whole walk would have run it.

        Raises:
            ShortcutUnavailable: the walks do not show the repetition here (the caller walks the whole model).
        """
        started = time.perf_counter()
        a, b, c = self.depths
        middle = self._walk(b, micro_batch)
        template = next((t for t in (t.at_sizes_of(middle.walk) for t in reversed(self.templates)) if t), None)
        if template is None:
            walks = [self._walk(a, micro_batch).walk, middle.walk, self._walk(c, micro_batch).walk]
            try:
                template = learn_template(walks, a, self.step)
            except NoRepetition as exc:
                raise ShortcutUnavailable(f"the walks of {a}, {b} and {c} blocks do not repeat: {exc}") from None
            self.learnt_at.append(micro_batch)
        self.templates.append(template)
        try:
            full = template.expand(self.blocks.count)
        except NoRepetition as exc:
            raise ShortcutUnavailable(str(exc)) from None
        figures = meter_figures(full, self.budget_bytes)
        if figures.crossed_before_measure:
            raise ShortcutUnavailable("the model alone crosses the card's memory before its trial")
        seconds = round(time.perf_counter() - started, 6)
        held, events, streams, categories = events_of(full)
        if figures.oom:
            # The whole walk's runner drops a model an OOM stopped mid-step and builds it again in the next trial.
            self.close()
            trial = Trial(micro_batch=micro_batch, peak_bytes=figures.peak_bytes, fits=False, oom=True, seconds=seconds)
            return Walked(trial, held, events, streams, None)
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
        if self.breakdown and any(categories):
            label = peak_label(full)
            parts = breakdown_of(held, events, categories, phases_of(full), label, micro_batch, fits, trial.peak_bytes)
        return Walked(trial, held, events, streams, parts)

    def _walk(self, depth: int, micro_batch: int) -> RecordedWalk:
        """The cut walk, its tokens held to what its trial read."""
        recorded = self.walkers[depth](micro_batch)
        walk, trial = recorded.walk, recorded.trial
        figures = meter_figures(walk, 1 << 62)
        read = (trial.peak_bytes, trial.forward_backward_bytes, trial.step_bytes)
        if trial.oom or (figures.peak_bytes, figures.forward_backward_bytes, figures.step_bytes) != read:
            raise ShortcutUnavailable(
                f"the walk of {depth} blocks at m = {micro_batch} reads {read}, its tokens "
                f"{(figures.peak_bytes, figures.forward_backward_bytes, figures.step_bytes)}"
            )
        if recorded.breakdown is not None:
            held, events, _, categories = events_of(walk)
            made = breakdown_of(
                held, events, categories, phases_of(walk), peak_label(walk), micro_batch, True, trial.peak_bytes
            )
            if made is None or made.model_dump() != recorded.breakdown.model_copy(update={"fits": True}).model_dump():
                raise ShortcutUnavailable(
                    f"the walk of {depth} blocks at m = {micro_batch}: its tokens break down otherwise than its trial"
                )
        return recorded
