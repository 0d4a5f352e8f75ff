"""The depth shortcut's arithmetic (autotune/search/depth_template.py, depth_figures.py), torch-free: a trace of a
model of n blocks written out by hand (a forward whose blocks free their predecessor's output, a backward in the
mirrored order freeing what each block saved, an optimizer's state per block, a note naming the block it runs in),
learnt from its walks at 2, 3 and 4 blocks and made at depths no walk saw, against the trace written out at those
depths; and the refusals where the walks do not repeat."""

from __future__ import annotations

import pytest

from autotune.core.allocator import replay
from autotune.search.depth_figures import events_of, meter_figures, peak_label
from autotune.search.depth_template import NoRepetition, Walk, learn_template


class _Trace:
    """Builds a walk token by token, keeping each named allocation's index for the releases."""

    def __init__(self) -> None:
        self.tokens: list[tuple[object, ...]] = []
        self.refs: list[int] = []
        self.blocks: list[int | None] = []
        self.live: dict[str, int] = {}

    def alloc(self, name: str, nbytes: int, flag: str = "", stream: int = 0) -> None:
        self.live[name] = len(self.tokens)
        self.tokens.append(("A", nbytes, stream, flag, "activations"))
        self.refs.append(-1)
        self.blocks.append(None)

    def free(self, name: str) -> None:
        at = self.live.pop(name)
        flag = "s" if self.tokens[at][3] == "s" else ""  # a temporary's release is a temporary's
        self.tokens.append(("F", self.tokens[at][1], self.tokens[at][2], flag))
        self.refs.append(at)
        self.blocks.append(None)

    def mark(self, token: tuple[object, ...], block: int | None = None) -> None:
        self.tokens.append(token)
        self.refs.append(-1)
        self.blocks.append(block)

    def walk(self) -> Walk:
        return Walk(self.tokens, self.refs, self.blocks)


def model_trace(blocks: int, *, size_of_block: dict[int, int] | None = None, first: bool = False) -> Walk:
    """The hand-written trial of a model of ``blocks`` blocks (two micro-batches, one step); ``first``: the first
    trial, whose first forward also makes a buffer per block that the step releases (FSDP2's first iteration)."""
    sizes = size_of_block or {}
    t = _Trace()
    for i in range(blocks):
        t.alloc(f"w{i}", 1000, "h")
    t.alloc("embedding", 500, "h")
    t.mark(("H",))
    t.mark(("K", ""))
    for micro_batch in range(2):
        t.mark(("P", "forward"))
        t.alloc("x", 64)
        previous = "x"
        for i in range(blocks):
            t.mark(("T", "+", "Model.layers.{}"), i)
            if first and micro_batch == 0:
                t.alloc(f"buffer{i}", 48)
            t.alloc(f"saved{i}", sizes.get(i, 96))
            t.alloc(f"out{i}", 64)
            t.alloc("tmp", 32, "s")
            t.free("tmp")
            t.mark(("N", "c", "mm.default", False))
            t.free(previous)
            previous = f"out{i}"
            t.mark(("T", "-", "Model.layers.{}"), i)
        t.alloc("loss", 8)
        t.free(previous)
        t.mark(("P", "backward"))
        t.alloc("grad_loss", 64)
        above = "grad_loss"
        for i in reversed(range(blocks)):
            t.mark(("T", "+", "Model.layers.{}"), i)
            t.alloc(f"g{i}", 64)
            t.mark(("N", "c", "mm.default", True))
            t.free(f"saved{i}")
            t.free(above)
            if micro_batch == 0:
                t.alloc(f"grad_w{i}", 1000)
            above = f"g{i}"
        t.free(above)
        t.free("loss")
    t.mark(("K", "forward_backward"))
    t.mark(("P", "step"))
    for i in range(blocks):
        t.alloc(f"state{i}", 2000)
    for i in range(blocks):
        t.free(f"grad_w{i}")
    t.mark(("K", "step"))
    for i in range(blocks):
        t.free(f"state{i}")
        if first:
            t.free(f"buffer{i}")
    t.mark(("K", "tail"))
    return t.walk()


def test_the_walks_of_2_3_and_4_blocks_make_every_depth() -> None:
    template = learn_template([model_trace(2), model_trace(3), model_trace(4)], 2)
    for depth in (2, 5, 9, 33):
        made, written = template.expand(depth), model_trace(depth)
        assert made.tokens == written.tokens
        assert made.refs == written.refs  # every release frees the allocation it frees at that depth
        assert made.blocks == written.blocks  # every module mark names its block


def test_what_the_made_walk_reads_is_what_the_written_one_reads() -> None:
    template = learn_template([model_trace(2), model_trace(3), model_trace(4)], 2)
    made, written = template.expand(12), model_trace(12)
    assert meter_figures(made, 1 << 40) == meter_figures(written, 1 << 40)
    assert peak_label(made) == peak_label(written)
    trace_made, streams_made = events_of(made)[1], events_of(made)[2]
    trace_written, streams_written = events_of(written)[1], events_of(written)[2]
    assert replay(trace_made, streams=streams_made) == replay(trace_written, streams=streams_written)


def test_the_meter_figures_follow_the_meter() -> None:
    """Held bytes are live from the start; a temporary raises the peak, not the live bytes; each take of the peak
    closes its phase; an allocation past the budget stops the trial there."""
    t = _Trace()
    t.alloc("w", 100, "h")
    t.mark(("H",))
    t.mark(("K", ""))
    t.alloc("a", 50)
    t.alloc("s", 30, "s")
    t.free("s")
    t.mark(("K", "forward_backward"))
    t.alloc("b", 10)
    t.mark(("K", "step"))
    t.mark(("K", "tail"))
    figures = meter_figures(t.walk(), 1000)
    assert (figures.peak_bytes, figures.forward_backward_bytes, figures.step_bytes) == (180, 180, 160)
    crossed = meter_figures(t.walk(), 155)
    assert crossed.oom and crossed.peak_bytes == 180 and crossed.forward_backward_bytes is None


def test_blocks_that_differ_are_refused() -> None:
    """A block of the walks that saves more than the others: no template says that, and none is made."""
    with pytest.raises(NoRepetition):
        learn_template(
            [model_trace(2, size_of_block={1: 80}), model_trace(3, size_of_block={1: 80}), model_trace(4)], 2
        )


def test_a_template_takes_the_sizes_of_another_micro_batch() -> None:
    """The walk of 3 blocks at another size (every saved activation larger) gives the template at that size; one
    whose blocks save different sizes is refused (None)."""
    template = learn_template([model_trace(2), model_trace(3), model_trace(4)], 2)

    def bigger(blocks: int) -> Walk:
        return model_trace(blocks, size_of_block={i: 128 for i in range(blocks)})

    moved = template.at_sizes_of(bigger(3))
    assert moved is not None
    assert moved.expand(7).tokens == bigger(7).tokens and moved.expand(7).refs == bigger(7).refs
    assert template.at_sizes_of(model_trace(3, size_of_block={0: 128})) is None


def test_two_walks_and_a_template_of_another_start_make_every_depth() -> None:
    """The later trials' template from the walks of 2 and 3 blocks alone, the first trial's (learnt from three, one
    run more) settling what two walks leave open: which copy a release of the backward frees."""
    first = learn_template([model_trace(2, first=True), model_trace(3, first=True), model_trace(4, first=True)], 2)
    later = learn_template([model_trace(2), model_trace(3)], 2, prior=first)
    for depth in (4, 7, 20):
        made, written = later.expand(depth), model_trace(depth)
        assert (made.tokens, made.refs, made.blocks) == (written.tokens, written.refs, written.blocks)
    with pytest.raises(NoRepetition):  # two walks alone leave it open
        learn_template([model_trace(2), model_trace(3)], 2)
