"""What a recorded fake step holds for its predicted time: each operator's FLOPs and bytes, each collective's size
and group, in the order they ran. Torch-free: the emulated child writes these (autotune/measure/op_counter.py),
the parent prices them (autotune/core/step_time.py).

A step is recorded as a table of operator kinds (:class:`OpRecord`: one op at one shape, dtype and phase, with its
FLOPs and bytes per call) and sequences of :class:`Segment` s: a bag of calls of the table's entries (index ->
calls), then at most one collective. The order of the segments is what the overlap of a collective with compute
depends on; inside a segment the order does not matter, so identical calls are counted, not listed. A segment that
repeats (a model's identical blocks) carries ``repeat``: a block's segments recorded once stand for all of them.

    >>> mm = OpRecord(op="aten.mm.default", kind="gemm", dtype="bf16", phase="forward", flops=2 * 64 * 32 * 16,
    ...               bytes=2 * (64 * 16 + 16 * 32 + 64 * 32), shape=(1, 64, 32, 16))
    >>> gather = CollectiveRecord(kind="all_gather", bytes=1 << 20, group_size=8, stride=1, dim="dp",
    ...                           phase="forward", overlap="prefetched")
    >>> block = Segment(ops=[(0, 3)], collective=gather, repeat=32)
    >>> record = StepRecord(micro_batch=2, ops=[mm], last=[block], other=[block], step=[])
    >>> record.flops("forward")  # 3 matmuls a block, 32 blocks
    6291456
    >>> record.collective_bytes()
    33554432
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "COLLECTIVE_KINDS",
    "NO_KERNEL_OPS",
    "PHASES",
    "REDUCTION_OPS",
    "CollectiveKind",
    "CollectiveRecord",
    "OpKind",
    "OpRecord",
    "Overlap",
    "Phase",
    "Segment",
    "StepRecord",
    "mesh_dim",
]

Phase = Literal["forward", "backward", "recompute", "step"]
PHASES: tuple[Phase, ...] = ("forward", "backward", "recompute", "step")
# gemm: a matmul (its FLOPs against the tensor cores); attention: a fused attention kernel (flash, memory-efficient,
# cuDNN); elementwise and reduction: kernels whose time is their bytes against the memory's bandwidth.
OpKind = Literal["gemm", "attention", "elementwise", "reduction"]
CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send_recv"]
COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "send_recv",
)
# What the job lets run beside compute: exposed (the next op waits for it: tensor parallel's, context parallel's,
# a pipeline's sends), prefetched (FSDP2's all-gather of the next unit, issued while this one computes), deferred
# (a gradient reduction nothing waits for until the optimizer step: FSDP2's reduce-scatter, DDP's buckets).
Overlap = Literal["exposed", "prefetched", "deferred"]

# Ops that launch no kernel: views (those whose schema does not say so too: _unsafe_view), metadata, allocation
# without a fill, the profiler's and c10d's bookkeeping. Their time is the host's dispatch, which the prediction
# leaves out.
NO_KERNEL_OPS = frozenset(
    {
        "aten.empty.memory_format",
        "aten.empty_strided.default",
        "aten.empty_like.default",
        "aten.detach.default",
        "aten._unsafe_view.default",
        "aten._reshape_alias.default",
        "aten.alias.default",
        "aten.lift_fresh.default",
        "aten._local_scalar_dense.default",
        "aten.set_.source_Storage",
        "aten.set_.source_Storage_storage_offset",
        "aten.resize_.default",
        "aten.record_stream.default",
        "aten.is_same_size.default",
        "aten._has_compatible_shallow_copy_type.default",
        "inductor.resize_storage_bytes_.default",
        "_c10d_functional.wait_tensor.default",
        "c10d.barrier.default",
    }
)

# Memory-bound kernels that reduce what they read (their time: a reduction's share of the bandwidth), by the ATen
# op's name without its overload.
REDUCTION_OPS = frozenset(
    {
        "sum", "mean", "norm", "linalg_vector_norm", "amax", "amin", "max", "min", "var", "var_mean", "std",
        "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "logsumexp", "cumsum",
        "prod", "argmax", "argmin", "all", "any", "nll_loss_forward", "_foreach_norm", "native_layer_norm",
        "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward", "native_group_norm",
        "native_group_norm_backward", "native_batch_norm", "native_batch_norm_backward",
    }
)  # fmt: skip

NonNegative = Annotated[int, Field(ge=0)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OpRecord(_Record):
    """One operator at one shape, dtype and phase: what one call of it costs.

    Attributes:
        op: the ATen overload (``aten.mm.default``).
        kind: gemm, attention, elementwise or reduction (the module docstring).
        dtype: what the tensor cores or the memory see: "bf16", "fp16", "fp32" (CUDA cores), "tf32", "fp8", or the
            dtype's name for a kernel that is memory-bound whatever its dtype.
        phase: forward, backward, recompute (a checkpointed forward run again inside backward), step (the optimizer).
        flops: torch's flop counter's count for one call (``torch.utils.flop_counter``: 2 per multiply-add; for an
            attention kernel the full L x L scores, whatever its mask).
        bytes: what one call reads and writes: its inputs' and outputs' bytes (a broadcast input counted once).
        shape: a matmul's (batch, m, n, k), for the tiles it runs in; None for other kinds.
        kernel: an attention kernel's family ("flash", "efficient", "cudnn"); None for other kinds.
        causal: an attention kernel with a causal mask, which computes half of its scores.
    """

    op: str
    kind: OpKind
    dtype: str
    phase: Phase
    flops: NonNegative
    bytes: NonNegative
    shape: tuple[int, int, int, int] | None = None
    kernel: str | None = None
    causal: bool = False


class CollectiveRecord(_Record):
    """One collective call of one rank.

    Attributes:
        kind: all_gather, reduce_scatter, all_reduce, all_to_all, broadcast or send_recv.
        bytes: the whole buffer in NCCL's convention: an all-gather's output, a reduce-scatter's input, an
            all-reduce's, an all-to-all's input, a send's.
        group_size: the ranks of its group.
        stride: the distance between consecutive ranks of its group (1: adjacent ranks, as a tp group in torchtitan's
            layout), which says how many of them share a node.
        dim: the mesh dimension it runs over (:func:`mesh_dim`).
        phase: where it ran (forward, backward, recompute, step).
        overlap: what the job lets it run beside (the module docstring).
    """

    kind: CollectiveKind
    bytes: NonNegative
    group_size: Annotated[int, Field(ge=1)]
    stride: Annotated[int, Field(ge=1)] = 1
    dim: str = "world"
    phase: Phase
    overlap: Overlap


class Segment(_Record):
    """A bag of op calls of one phase (indices into the step's op table, with their call counts), then at most one
    collective; the whole run ``repeat`` times in a row."""

    ops: list[tuple[int, int]] = Field(default_factory=list)
    collective: CollectiveRecord | None = None
    repeat: Annotated[int, Field(ge=1)] = 1

    def calls(self) -> int:
        """Op calls, repeats included."""
        return self.repeat * sum(count for _, count in self.ops)


class StepRecord(_Record):
    """One recorded fake step at one micro-batch size (autotune/measure/op_counter.py).

    Attributes:
        micro_batch: m.
        seq_len: L, where the task has one.
        ops: the table of op kinds the segments index.
        last: the micro-batch that ends an update: its forward and backward, with what synchronises the gradients.
        other: a micro-batch that does not end the update (under DDP's no_sync it reduces nothing).
        step: the optimizer step (and zero_grad).
        ddp_buckets: DDP's gradient all-reduces, one per bucket in the order backward fills them, which a fake trial
            does not run (it holds the buckets only): the prediction launches them behind the last micro-batch's
            backward.
        flops_per_token: the model FLOPs of one token, torchtitan's definition (6 x the non-embedding parameters +
            12 x layers x heads x head dim x L: here 3 x the forward attention FLOPs the flop counter counts, the
            same sum for a model whose attention is SDPA); None where the task's tokens are unknown.
        tokens_per_sample: L for a sequence-aware task (the tokens of one sample); None otherwise.
        notes: what the recording could not see, in lines.
    """

    micro_batch: Annotated[int, Field(ge=1)]
    seq_len: int | None = None
    ops: list[OpRecord]
    last: list[Segment]
    other: list[Segment]
    step: list[Segment]
    ddp_buckets: list[CollectiveRecord] = Field(default_factory=list)
    flops_per_token: float | None = None
    tokens_per_sample: int | None = None
    notes: list[str] = Field(default_factory=list)
    # A pipeline stage's record (``stage``: its index): ``last`` holds the rank's whole update, the schedule's
    # ``microbatches`` forwards and backwards in its order, and ``other`` nothing.
    stage: int | None = None
    microbatches: Annotated[int, Field(ge=1)] = 1

    def _calls(self, segments: Sequence[Segment]) -> Iterator[tuple[OpRecord, int]]:
        for segment in segments:
            for index, count in segment.ops:
                yield self.ops[index], count * segment.repeat

    def flops(self, phase: Phase | None = None, segments: Sequence[Segment] | None = None) -> int:
        """FLOPs of the last micro-batch and the step (or of ``segments``), of one phase or all."""
        chosen = [*self.last, *self.step] if segments is None else segments
        return sum(op.flops * calls for op, calls in self._calls(chosen) if phase is None or op.phase == phase)

    def collective_bytes(self, segments: Sequence[Segment] | None = None) -> int:
        """Bytes of the collectives of the last micro-batch and the step (or of ``segments``), DDP's buckets too."""
        chosen = [*self.last, *self.step] if segments is None else segments
        found = sum(s.collective.bytes * s.repeat for s in chosen if s.collective is not None)
        return found + (sum(b.bytes for b in self.ddp_buckets) if segments is None else 0)


def mesh_dim(group_size: int, stride: int, *, world_size: int, tp: int = 1, cp: int = 1, pp: int = 1) -> str:
    """The mesh dimension a group of ``group_size`` ranks, ``stride`` apart, runs over, in torchtitan's layout (pp,
    dp, cp, tp from the outermost: autotune/measure/layout.py): tp's ranks are adjacent, cp's tp apart, dp's tp x cp
    apart (FSDP2 over dp x cp, torchtitan's dp_shard_cp, is tp apart too), pp's dp x cp x tp apart.

    >>> mesh_dim(2, 1, world_size=8, tp=2), mesh_dim(4, 2, world_size=8, tp=2), mesh_dim(8, 1, world_size=8)
    ('tp', 'dp', 'world')
    >>> mesh_dim(8, 2, world_size=16, tp=2, cp=2), mesh_dim(4, 4, world_size=16, tp=2, cp=2)
    ('dp x cp', 'dp')
    >>> mesh_dim(2, 2, world_size=16, tp=2, cp=2)
    'cp'
    >>> mesh_dim(2, 8, world_size=16, pp=2, tp=2, cp=2)
    'pp'
    """
    dp = world_size // (tp * cp * pp)
    if group_size == world_size:
        return "world"
    named = [
        ("tp", tp, 1),
        ("cp", cp, tp),
        ("dp", dp, tp * cp),
        ("dp x cp", dp * cp, tp),
        ("pp", pp, tp * cp * dp),
    ]
    for name, size, step in named:
        if size > 1 and group_size == size and (stride == step or group_size == 1):
            return name
    return f"{group_size} ranks {stride} apart"
