"""The wire contract: what a probe produces, the store keeps and the API serves.

Torch-free on purpose: the service image imports this module without torch installed.
Every model forbids unknown fields so that a client's typo is a 422 naming the field,
not a silently dropped value.
"""

from __future__ import annotations

import warnings
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from autotune.core import units
from autotune.core.loss_names import LOSS_PATTERN, canonical_loss
from autotune.core.policy_names import (
    MAX_POLICY_NAME_LENGTH,
    POLICY_NAMES,
    POLICY_PATTERN,
    canonical_wire_policy,
)
from autotune.core.split import DEFAULT_PLAN_POLICY, PlanPolicy, UnevenPlanWarning, micro_batches_text, split

__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "ATTENTION_NOTE",
    "OBJECTIVES",
    "OFFLOADS",
    "PRECISIONS",
    "SCHEMA_VERSION",
    "SOURCES",
    "STRATEGIES",
    "Device",
    "DeviceContext",
    "FINGERPRINT_PATTERN",
    "FINGERPRINT_SHOWN_CHARS",
    "FULL_FINGERPRINT_CHARS",
    "Fit",
    "LongestSeqLen",
    "MAX_SEQ_LEN",
    "MAX_SUGGEST_TARGET_BATCH",
    "MicroBatchCount",
    "Observation",
    "Offload",
    "Plan",
    "Precision",
    "PredictedParts",
    "Profile",
    "PipelineStages",
    "SingleStep",
    "Source",
    "Strategy",
    "SuggestQuery",
    "Suggestion",
    "Surface",
    "TagValue",
    "Throughput",
    "Trial",
    "shown_fingerprint",
]

SCHEMA_VERSION = 1
# bf16: autocast under ddp; under fsdp FSDP2's MixedPrecisionPolicy alone (torchtitan's way, no autocast).
# bf16-autocast: autocast on top of that policy under fsdp (accelerate's way); autocast alone under ddp.
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-autocast")
Precision = Literal["fp32", "bf16", "fp16", "bf16-autocast"]
TagValue = str | int | float | bool
# What one device holds: ddp (every replica the whole model) or fsdp (FSDP2, 1/N of it per rank).
STRATEGIES = ("ddp", "fsdp")
Strategy = Literal["ddp", "fsdp"]
# Where a profile's figures come from: real trials on the device, or fake-tensor trials only.
SOURCES = ("measured", "estimate")
Source = Literal["measured", "estimate"]
# Activation checkpointing (autotune/measure/policies.py): the named policies (none, every-2, full, op), and
# beyond them any every-K and op:OP/OP/... (autotune/core/policy_names.py's grammar). The wire keeps the
# canonical spelling: profiles are matched by it.
ACTIVATION_CHECKPOINTING = POLICY_NAMES
# canonical (run before the pattern) says in one line why a name is refused, where the pattern would print itself.
ActivationCheckpointing = Annotated[
    str, Field(pattern=POLICY_PATTERN, max_length=MAX_POLICY_NAME_LENGTH), BeforeValidator(canonical_wire_policy)
]
# What a recommendation optimizes: the largest micro-batch that fits (the fewest steps), or samples
# per second among the policies that hold the target.
OBJECTIVES = ("memory", "throughput")
Objective = Literal["memory", "throughput"]
# Offload (autotune/measure/offload.py): none; activations (the saved activations of the blocks to host memory,
# torch.autograd.graph.save_on_cpu); params (FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state
# on the host, the step on the CPU; --strategy fsdp only). The device's bytes decide m; the host's are reported.
OFFLOADS = ("none", "activations", "params")
Offload = Literal["none", "activations", "params"]

# Bounds keep hostile or corrupt uploads out of the database: no real card has 2**60 bytes.
MAX_BYTES = 2**60
MAX_MICRO_BATCH = 2**24
MAX_WORLD_SIZE = 2**20

NonNegBytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
PosBytes = Annotated[int, Field(gt=0, le=MAX_BYTES)]
MicroBatch = Annotated[int, Field(ge=1, le=MAX_MICRO_BATCH)]
ShortText = Annotated[str, Field(max_length=256)]


def _canonical_wire_loss(value: object) -> object:
    """A wire loss's canonical spelling when it is a string (autotune/core/loss_names.py), its refusal as a
    validation error; anything else is left for pydantic to refuse as not a string."""
    return canonical_loss(value) if isinstance(value, str) else value


def _valid_mesh(value: dict[str, int | str]) -> dict[str, int | str]:
    """A mesh as Mesh.as_dict writes it (its refusal as a validation error)."""
    from autotune.core.errors import AutotuneError
    from autotune.core.mesh import Mesh

    try:
        Mesh.from_dict(value)
    except (AutotuneError, TypeError) as exc:
        raise ValueError(str(exc)) from None
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Device(_Model):
    """The device a profile was measured on (one entry per probed device)."""

    kind: Literal["cpu", "cuda"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    index: Annotated[int, Field(ge=0, le=1024)] | None = None
    total_bytes: NonNegBytes | None = None
    free_bytes: NonNegBytes | None = None
    uuid: ShortText | None = None
    driver_version: ShortText | None = None
    cuda_version: ShortText | None = None
    torch_version: ShortText | None = None
    compute_capability: ShortText | None = None


class Trial(_Model):
    """One measurement: the peak of a full accumulate-and-step cycle at one micro-batch size."""

    micro_batch: MicroBatch
    peak_bytes: NonNegBytes
    fits: bool
    oom: bool = False
    seconds: Annotated[float, Field(ge=0, le=1e7)] = 0.0
    # The peak of the forward/backward phases alone: affine in m from m=1, where the whole-trial
    # peak is flat while the optimizer step dominates. The search and the fit use it.
    forward_backward_bytes: NonNegBytes | None = None
    # CUDA only: max_memory_allocated beside the reserved figure, and memory outside the allocator.
    allocated_bytes: NonNegBytes | None = None
    outside_allocator_bytes: NonNegBytes | None = None
    # The optimizer step's peak (weights, gradients, optimizer state and the step's temporaries, no
    # activations): flat in m, so one trial anywhere gives the floor of every smaller m's peak.
    step_bytes: NonNegBytes | None = None
    # A fake-tensor trial (shapes and dtypes, no storage): a pre-search point or an estimate, never
    # a measurement on the device.
    fake: bool = False
    # Under --offload: the peak of what the trial held in host memory (saved activations packed to the host,
    # FSDP2's offloaded shards, gradients, optimizer state and the CPU step); None without offload.
    host_peak_bytes: NonNegBytes | None = None
    # The length a trial of a run over lengths ran at, on the copy handed to the progress line (at_length): a
    # label, never on the wire (a profile's trials are all at its seq_len).
    _seq_len: int | None = PrivateAttr(default=None)

    def at_length(self, seq_len: int | None) -> Trial:
        """A copy labelled with the length it ran at (:attr:`reported_length`), for the progress line."""
        labelled = self.model_copy()
        labelled._seq_len = seq_len
        return labelled

    @property
    def reported_length(self) -> int | None:
        """The length :meth:`at_length` labelled this copy with; None for every other trial."""
        return self._seq_len


class Fit(_Model):
    """forward_backward_bytes(m) ~= fixed_bytes + bytes_per_sample * m, least squares over the
    measured (non-OOM) trials. It is the affine part of memory: the whole-trial peak is
    max(this line, the optimizer step's peak), and the step's peak is at most the peak measured at
    the smallest micro-batch."""

    fixed_bytes: Annotated[float, Field(ge=-MAX_BYTES, le=MAX_BYTES)]
    bytes_per_sample: Annotated[float, Field(ge=0, le=MAX_BYTES)]


# (size, count): `count` micro-batches of `size` samples each, per replica and per update.
MicroBatchCount = tuple[MicroBatch, Annotated[int, Field(ge=1, le=MAX_MICRO_BATCH)]]


def _equal_micro_batches(micro_batch: int, accumulation_steps: int) -> list[MicroBatchCount]:
    return [(micro_batch, accumulation_steps)]


class Plan(_Model):
    """How to reach a target effective batch: the micro-batches of one update, on world_size replicas.

    ``micro_batches`` lists them as (size, count) pairs, largest first: one pair when all are equal
    (``micro_batch`` x ``accumulation_steps``), two for a balanced plan whose sizes differ by one
    (6 x 26 + 4 x 25 = 256 in 10 steps). ``micro_batch`` is the largest size, for the tools that know
    only one number. Left out (profiles from before balanced plans), it is the one equal pair.
    """

    micro_batch: MicroBatch
    accumulation_steps: Annotated[int, Field(ge=1, le=MAX_MICRO_BATCH)]
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
    effective_batch: Annotated[int, Field(ge=1, le=2**40)]
    target_batch: Annotated[int, Field(ge=1, le=2**40)]
    exact: bool
    max_micro_batch: MicroBatch
    note: Annotated[str, Field(max_length=1024)] = ""
    micro_batches: Annotated[list[MicroBatchCount], Field(max_length=64)] = Field(default_factory=list)

    @model_validator(mode="after")
    def _default_micro_batches(self) -> Plan:
        if not self.micro_batches:
            self.micro_batches = _equal_micro_batches(self.micro_batch, self.accumulation_steps)
        return self

    @property
    def deviation(self) -> int:
        return self.effective_batch - self.target_batch

    @property
    def uneven(self) -> bool:
        """Whether the micro-batches of an update differ in size (a balanced plan)."""
        return len({size for size, _ in self.micro_batches}) > 1


Seconds = Annotated[float, Field(ge=0, le=1e7)]


class PredictedParts(_Model):
    """What a predicted update's time is made of (autotune/core/step_time.py); the four parts add up to the
    update's seconds. ``recompute_seconds`` is the part of compute spent running checkpointed forwards again."""

    compute_seconds: Seconds
    exposed_communication_seconds: Seconds
    bubble_seconds: Seconds = 0.0
    optimizer_seconds: Seconds
    recompute_seconds: Seconds = 0.0


class Throughput(_Model):
    """A timed run on the device (autotune/measure/throughput.py), never the search's trials: warm-up first,
    then each micro-batch size of one update timed forward+backward, and the optimizer step. Or, on an estimate,
    the update's time predicted from the recorded fake step (``predicted``: autotune/core/step_time.py).

    ``micro_batches`` is one update per replica as (size, count) pairs (a plan's, or one micro-batch
    of m_max); ``seconds_per_update`` is the sum of count x ``micro_batch_seconds`` of each size plus
    ``step_seconds`` (the optimizer step) and ``per_update_seconds``; ``samples_per_second`` is the update's
    samples on ``world_size`` replicas over it.

    A prediction adds ``per_update_seconds`` (what an update costs once besides the optimizer step: a pipeline's
    bubble, the end of the last micro-batch's gradient reduction), ``tokens_per_second_per_gpu`` (the update's
    tokens over every GPU of the job, where the task's length is known), ``mfu`` (torchtitan's: the model FLOPs of
    those tokens per second over the card's dense peak, a fraction) and ``parts``.
    """

    micro_batch: MicroBatch
    samples_per_second: Annotated[float, Field(gt=0, le=1e12)]
    seconds_per_update: Annotated[float, Field(gt=0, le=1e7)]
    micro_batches: Annotated[list[MicroBatchCount], Field(min_length=1, max_length=64)]
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)] = 1
    # (size, median seconds of one forward+backward at that size) for each timed size.
    micro_batch_seconds: Annotated[
        list[tuple[MicroBatch, Annotated[float, Field(gt=0, le=1e7)]]], Field(min_length=1, max_length=64)
    ]
    step_seconds: Annotated[float, Field(ge=0, le=1e7)] = 0.0
    # Timed repeats of each size (after one warm-up update).
    repeats: Annotated[int, Field(ge=1, le=100_000)] = 1
    predicted: bool = False
    per_update_seconds: Seconds = 0.0
    tokens_per_second_per_gpu: Annotated[float, Field(gt=0, le=1e12)] | None = None
    mfu: Annotated[float, Field(ge=0, le=10)] | None = None
    parts: PredictedParts | None = None


# A surface keeps the pieces that can be the largest (autotune/core/surface.py prunes them): a handful.
MAX_SURFACE_PIECES = 512
MAX_SEQ_LEN = 2**24
SeqLen = Annotated[int, Field(ge=1, le=MAX_SEQ_LEN)]
# A piece's integer coefficients of 1, m, L, m*L, L^2, m*L^2 over the surface's denominator; they can
# exceed 64 bits, which JSON carries exactly.
SurfacePiece = Annotated[list[int], Field(min_length=6, max_length=6)]


class LongestSeqLen(_Model):
    """The longest sequence that fits at ``micro_batch`` (multiple_of), read off the surface and
    confirmed: by real trials at it and one past it for a measurement, fake ones for an estimate.
    ``limited_by``: "memory" (the next length does not fit), "cap" (--max-seq-len reached) or
    "model" (the model refused the next length; ``note`` says how)."""

    micro_batch: MicroBatch
    seq_len: SeqLen
    peak_bytes: NonNegBytes
    limited_by: Literal["memory", "cap", "model"]
    cap: SeqLen
    note: Annotated[str, Field(max_length=1024)] = ""


class Surface(_Model):
    """The peak-memory surface over (m, L) of a sequence-aware probe (autotune/core/surface.py): the
    peak at (m, L) is max over ``pieces`` of (c · (1, m, L, mL, L², mL²)) // ``denominator``, plus
    ``offset_bytes`` (what the device's real trials showed above the fake surface; 0 on the CPU).
    ``covered``: the lengths it answers for (the measured ones and the longest that fits), inclusive.
    """

    denominator: Annotated[int, Field(gt=0)]
    pieces: Annotated[list[SurfacePiece], Field(min_length=1, max_length=MAX_SURFACE_PIECES)]
    sizes: tuple[MicroBatch, MicroBatch]
    lengths: tuple[SeqLen, SeqLen, SeqLen]
    covered: tuple[SeqLen, SeqLen]
    measured_lengths: Annotated[list[SeqLen], Field(min_length=1, max_length=256)]
    offset_bytes: NonNegBytes = 0
    # The traced point held out of the fit and predicted exactly by it: (m, L).
    held_out: tuple[MicroBatch, SeqLen] | None = None
    longest: LongestSeqLen | None = None

    @model_validator(mode="after")
    def _covered_in_order(self) -> Surface:
        if self.covered[0] > self.covered[1]:
            raise ValueError(f"covered lengths run from low to high, got {list(self.covered)}")
        return self


class PipelineStages(_Model):
    """What a pipeline-parallel profile (``--pp``) says of its stages (autotune/measure/pipeline/): each stage's
    peak at ``max_micro_batch`` (a rank's, with its V stages under interleaved 1F1B), the most loaded one, whose
    m_max the profile answers, the K micro-batches per step the stages ran, and the bubble
    (pp - 1) / (V K + pp - 1)."""

    microbatches: MicroBatch
    stage_peak_bytes: Annotated[list[NonNegBytes], Field(min_length=2, max_length=1024)]
    most_loaded_stage: Annotated[int, Field(ge=0, lt=1024)]
    bubble_fraction: Annotated[float, Field(ge=0, lt=1)]

    @model_validator(mode="after")
    def _most_loaded_is_the_largest(self) -> PipelineStages:
        peaks = self.stage_peak_bytes
        if self.most_loaded_stage >= len(peaks) or peaks[self.most_loaded_stage] != max(peaks):
            raise ValueError(f"most_loaded_stage {self.most_loaded_stage} is not the stage with the largest peak")
        return self


class SingleStep(_Model):
    """A job that does not accumulate (A = 1: one micro-batch, then the step): measured by trials of its own,
    whose forwards hold no gradient set (autotune/measure/trial.py), so it fits up to one gradient set more
    than the accumulating job of ``Profile.max_micro_batch``. Measured where the target can be met without
    accumulating (no target, or target / world size above the accumulating m_max and within the cap).

    ``max_micro_batch`` is the largest size whose single-step trial fits, searched up to ``cap`` (the
    profile's cap, or the target's size per replica: larger sizes would not be run without accumulating).
    ``trials`` are those single-step trials, apart from the profile's (accumulating) ones.
    """

    max_micro_batch: MicroBatch
    cap: MicroBatch
    trials: Annotated[list[Trial], Field(min_length=1, max_length=10_000)]


# What holds a trial's memory at its peak (autotune/measure/breakdown.py), in the order the datasheet lists them.
MEMORY_PARTS = (
    "trainable_parameters",
    "frozen_parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "activations",
    "inputs",
    "temporaries",
    # What the mesh adds: FSDP2's gathered parameters and its all-gather and reduce-scatter buffers.
    "collectives",
    # On a card (an emulated one's estimate): the caching allocator's reserve beyond the live tensors at the peak
    # (cached blocks, rounding, the cuBLAS workspaces), and the memory outside the allocator (the CUDA context, and
    # under --estimate-bound safe NCCL's bound). The parts added last, so that a timeline stored before them (its
    # points shorter) reads with 0 there.
    "allocator_reserve",
    "outside_allocator",
)
# A profile's note on the attention kernel its trials ran starts so (autotune/measure/trial.py, attention_line): the
# datasheet prints it as its own row, not as a warning.
ATTENTION_NOTE = "attention: "
# How the datasheet and the dashboard name each part.
MEMORY_PART_LABELS = {
    "trainable_parameters": "params (trained)",
    "frozen_parameters": "params (frozen)",
    "buffers": "buffers",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "inputs": "inputs",
    "temporaries": "temporaries",
    "collectives": "mesh buffers",
    "allocator_reserve": "allocator reserve",
    "outside_allocator": "outside allocator",
}
PHASES = ("model", "inputs", "forward", "backward", "step")
# The parts the first breakdowns had (trainable_parameters ... temporaries): a timeline point then was the event and
# these, 9 values; the parts after them came later.
_FIRST_PARTS = 8


def _parts_sum_to_peak(breakdown: MemoryBreakdown) -> MemoryBreakdown:
    unknown = sorted(set(breakdown.parts) - set(MEMORY_PARTS))
    if unknown:
        raise ValueError(f"unknown memory parts {unknown}: the parts are {', '.join(MEMORY_PARTS)}")
    if sum(breakdown.parts.values()) != breakdown.peak_bytes:
        raise ValueError(f"the parts sum to {sum(breakdown.parts.values())} bytes, not the peak {breakdown.peak_bytes}")
    if (breakdown.host_parts is None) != (breakdown.host_peak_bytes is None):
        raise ValueError("host_parts and host_peak_bytes go together (the host's peak under --offload, by part)")
    if breakdown.host_parts is not None:
        unknown = sorted(set(breakdown.host_parts) - set(MEMORY_PARTS))
        if unknown:
            raise ValueError(f"unknown host memory parts {unknown}: the parts are {', '.join(MEMORY_PARTS)}")
        if sum(breakdown.host_parts.values()) != breakdown.host_peak_bytes:
            raise ValueError(
                f"the host parts sum to {sum(breakdown.host_parts.values())} bytes, not the host's peak "
                f"{breakdown.host_peak_bytes}"
            )
    width = len(MEMORY_PARTS) + 1
    if any(len(point) != width for point in breakdown.timeline):
        raise ValueError(f"each timeline point is [event, {', '.join(MEMORY_PARTS)}]")
    return breakdown


class MemoryBreakdown(_Model):
    """One trial's peak by what holds it (``parts``: MEMORY_PARTS that hold bytes; they sum to ``peak_bytes``),
    where it happened (``peak_where``: the operator and the innermost module, forward or backward), and the step
    as a timeline: ``timeline`` points ``[event, bytes of each of MEMORY_PARTS]`` after the trial's ``event``-th
    allocation or release (thinned, every span's highest kept), ``phases`` ``[event, phase]`` where each phase
    began (PHASES)."""

    micro_batch: MicroBatch
    fits: bool
    peak_bytes: NonNegBytes
    parts: Annotated[dict[str, NonNegBytes], Field(max_length=len(MEMORY_PARTS))]
    peak_event: Annotated[int, Field(ge=0, le=2**40)]
    peak_where: Annotated[str, Field(max_length=256)] = ""
    events: Annotated[int, Field(ge=0, le=2**40)]
    timeline: Annotated[
        list[Annotated[list[Annotated[int, Field(ge=0, le=MAX_BYTES)]], Field(min_length=1, max_length=16)]],
        Field(max_length=600),
    ]
    phases: Annotated[
        list[tuple[Annotated[int, Field(ge=0, le=2**40)], Literal["model", "inputs", "forward", "backward", "step"]]],
        Field(max_length=512),
    ]
    # A pipeline's: the stage (the rank's pp coordinate) whose peak this is, its most loaded; None: no pipeline.
    stage: Annotated[int, Field(ge=0, le=MAX_WORLD_SIZE)] | None = None
    # Under --offload: the host's peak in the same trial (the stage's, for a pipeline) by part, summing to
    # host_peak_bytes (packed activations; FSDP2's offloaded shards, gradients, optimizer state and the CPU step's
    # temporaries). None: no offload, or a host the probe did not break down.
    host_peak_bytes: NonNegBytes | None = None
    host_parts: Annotated[dict[str, NonNegBytes], Field(max_length=len(MEMORY_PARTS))] | None = None

    @field_validator("timeline", mode="before")
    @classmethod
    def _before_collectives(cls, timeline: Any) -> Any:
        """A timeline stored before the last parts existed (the mesh's, the card's) has shorter points: those parts
        held 0. A point of 9 values (an event and the first eight parts) is padded; any other width is left to the
        width check."""
        width = len(MEMORY_PARTS) + 1
        if isinstance(timeline, list):
            return [
                [*p, *([0] * (width - len(p)))] if isinstance(p, list) and _FIRST_PARTS < len(p) < width else p
                for p in timeline
            ]
        return timeline


class Lever(_Model):
    """One change of the job's setup (``flags``, as the CLI spells it) and what it buys, by fake trials of the
    changed setup (autotune/orchestrate/levers.py): the peak at the job's micro-batch (``at_micro_batch``: its
    m_max, or the smallest size where none fits), the bytes that frees (negative: it costs), and the m_max under
    it (0: not even the smallest size fits). ``note``: why it was left out, or what it assumes."""

    flags: Annotated[str, Field(min_length=1, max_length=128)]
    at_micro_batch: MicroBatch
    peak_bytes: NonNegBytes | None = None
    freed_bytes: Annotated[int, Field(ge=-MAX_BYTES, le=MAX_BYTES)] | None = None
    max_micro_batch: Annotated[int, Field(ge=0, le=MAX_MICRO_BATCH)] | None = None
    note: Annotated[str, Field(max_length=512)] = ""


class Profile(_Model):
    """The datasheet of one job setup on one device model (docs/design.md, "Contracts")."""

    schema_version: Annotated[int, Field(ge=1, le=SCHEMA_VERSION)] = SCHEMA_VERSION
    fingerprint: Annotated[str, Field(pattern=r"^[0-9a-f]{16,128}$")]
    task: Annotated[str, Field(min_length=1, max_length=256)]
    device: Device
    devices: Annotated[list[Device], Field(max_length=1024)] = Field(default_factory=list)
    precision: Precision = "fp32"
    tags: Annotated[dict[ShortText, TagValue], Field(max_length=64)] = Field(default_factory=dict)
    budget_bytes: PosBytes
    headroom: Annotated[float, Field(ge=0, lt=1)] = 0.10
    max_micro_batch: MicroBatch
    micro_batch_cap: MicroBatch = 4096
    multiple_of: MicroBatch = 1
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)] = 1
    # fsdp: the figures are rank 0's of world_size ranks, and answer only for that world size.
    strategy: Strategy = "ddp"
    # The job's mesh (autotune/core/mesh.py, Mesh.as_dict: tp, pp, cp, the pipeline's schedule): the figures are
    # one rank's of it, world_size counts every rank and the plan's D is world_size / (tp x pp x cp). None: no
    # model parallelism.
    mesh: Annotated[dict[ShortText, int | str], Field(max_length=8), AfterValidator(_valid_mesh)] | None = None
    # Under --pp: each stage's peak at max_micro_batch, the most loaded stage, K and the bubble; None otherwise.
    pipeline: PipelineStages | None = None
    # estimate: fake trials only (`autotune estimate`); a measurement always wins over it.
    source: Source = "measured"
    # The memory policy the trials ran under; every policy has its own profile and m_max.
    activation_checkpointing: ActivationCheckpointing = "none"
    # Mixture of experts: the routing the fake trials assumed (1.0 balanced; the busiest expert's share of
    # tokens over a fair one, autotune.measure.meters.fake.routed_indices). Real trials route as the model
    # does. None for a dense model.
    moe_load_factor: Annotated[float, Field(ge=1, le=1e6)] | None = None
    # Timed runs after the search (at m_max, and at the plan's sizes): what objective=throughput ranks.
    throughput: Annotated[list[Throughput], Field(max_length=16)] | None = None
    # A sequence-aware task's length (its fingerprint leaves L out), and the surface its probe
    # measured: /suggest predicts other lengths within surface.covered from it. None for other tasks.
    seq_len: SeqLen | None = None
    surface: Surface | None = None
    # The real trials showed a size that fits above one that did not (cuDNN picks kernels per
    # shape): max_micro_batch is then the largest m below the first size that failed.
    non_monotone: bool = False
    # --offload (autotune/measure/offload.py): what went to host memory (None: nothing, as before offload
    # existed); the host bytes at max_micro_batch; --host-budget, above which a size counts as not fitting.
    offload: Offload | None = None
    host_peak_bytes: NonNegBytes | None = None
    host_budget_bytes: PosBytes | None = None
    # CUDA only (autotune/measure/fragmentation.py): whether PYTORCH_CUDA_ALLOC_CONF had expandable_segments
    # on, and reserved minus allocated at m_max (the allocator's gap); None elsewhere.
    expandable_segments: bool | None = None
    reserved_gap_bytes: NonNegBytes | None = None
    plan: Plan | None = None
    # A = 1 (no accumulation), where it applies: a plan with one step per update may use its m_max.
    single_step: SingleStep | None = None
    trials: Annotated[list[Trial], Field(min_length=1, max_length=10_000)]
    # The peak of m_max and of the size above it (or that failed), by what holds it (autotune/measure/breakdown.py).
    breakdown: (
        Annotated[list[Annotated[MemoryBreakdown, AfterValidator(_parts_sum_to_peak)]], Field(max_length=4)] | None
    ) = None
    # What each applicable change of the setup would buy (--levers), best first (autotune/orchestrate/levers.py).
    levers: Annotated[list[Lever], Field(max_length=32)] | None = None
    fit: Fit | None = None
    trial_count: Annotated[int, Field(ge=0, le=10_000)] = 0
    oom_count: Annotated[int, Field(ge=0, le=10_000)] = 0
    seconds: Annotated[float, Field(ge=0, le=1e7)] = 0.0
    # A compiled job (tag compile): the seconds its compilation took, within ``seconds`` and apart from every
    # trial's (docs/compile.md); None for an eager job.
    compile_seconds: Annotated[float, Field(ge=0, le=1e7)] | None = None
    warnings: Annotated[list[Annotated[str, Field(max_length=1024)]], Field(max_length=64)] = Field(
        default_factory=list
    )
    torch_version: ShortText | None = None
    autotune_version: ShortText | None = None
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def limit_bytes(self) -> int:
        """The largest peak that counts as fitting: budget x (1 - headroom)."""
        return units.limit_bytes(self.budget_bytes, self.headroom)

    @property
    def deciding_trials(self) -> list[Trial]:
        """The trials the profile's answer rests on: the real ones of a measurement (fake
        pre-search points only guided it), the fake ones of an estimate."""
        fake = self.source == "estimate"
        return [t for t in self.trials if t.fake == fake]

    @property
    def step_floor_bytes(self) -> int | None:
        """The optimizer step's share of the peak, flat in m: the step phase a deciding trial
        measured where one did; for profiles from before the step was recorded, the whole peak of
        the smallest measured trial (an upper bound of it)."""
        measured = [t for t in self.deciding_trials if not t.oom]
        steps = [t.step_bytes for t in measured if t.step_bytes is not None]
        if steps:
            return max(steps)
        return min(measured, key=lambda t: t.micro_batch).peak_bytes if measured else None

    def predicted_peak(self, micro_batch: int) -> float | None:
        """The whole-trial peak the fit predicts at micro_batch: the line, but never below the
        optimizer step's share (flat in m)."""
        if self.fit is None:
            return None
        line = self.fit.fixed_bytes + self.fit.bytes_per_sample * micro_batch
        return max(line, float(self.step_floor_bytes or 0))

    def peak_at(self, micro_batch: int) -> int | None:
        """The measured peak at micro_batch, if a fitting trial measured it."""
        for trial in self.deciding_trials:
            if trial.micro_batch == micro_batch and trial.fits:
                return trial.peak_bytes
        return None


class DeviceContext(_Model):
    """What the store has measured of one card's memory outside the caching allocator (the CUDA context,
    loaded modules, library handles): over the measured CUDA profiles of that card, the median of each
    profile's decisive real trial (the fitting one at its largest micro-batch: a process loads more kernel
    modules as its shapes grow, and the boundary's figure is the one that decides), for an estimate to add
    to its reserved bytes (``autotune estimate --gpu NAME --server URL``); low and high span every real
    trial read."""

    device_name: Annotated[str, Field(min_length=1, max_length=256)]
    # The torch version (major.minor) the trials were asked for; None: every version the store holds.
    torch_version: ShortText | None = None
    outside_allocator_bytes: NonNegBytes
    low_bytes: NonNegBytes
    high_bytes: NonNegBytes
    trials: Annotated[int, Field(ge=1)]
    profiles: Annotated[int, Field(ge=1)]


class Observation(_Model):
    """A training job's report of what it really saw at some micro-batch."""

    micro_batch: MicroBatch
    peak_bytes: NonNegBytes | None = None
    oom: bool = False
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)] = 1
    note: Annotated[str, Field(max_length=1024)] = ""
    # The device model the job ran on (torch.cuda.get_device_name, "cpu"): checked against the
    # profile's when given (422 when it differs), not stored.
    device_name: ShortText | None = None


class Suggestion(_Model):
    """What a job gets before launch: the plan and where it came from."""

    micro_batch: MicroBatch
    accumulation_steps: Annotated[int, Field(ge=1)]
    world_size: Annotated[int, Field(ge=1)]
    effective_batch: Annotated[int, Field(ge=1)]
    target_batch: Annotated[int, Field(ge=1)]
    exact: bool
    source: Literal["measured", "predicted", "probed", "estimated"]
    profile_id: int | None = None
    fingerprint: str | None = None
    device_name: str | None = None
    max_micro_batch: MicroBatch
    peak_bytes: NonNegBytes | None = None
    budget_bytes: PosBytes | None = None
    # A sequence-aware job: its length, and the plan in tokens (tokens_per_update = effective_batch x
    # seq_len); target_tokens when the job asked for tokens per update rather than sequences.
    seq_len: SeqLen | None = None
    target_tokens: Annotated[int, Field(ge=1)] | None = None
    tokens_per_micro_batch: Annotated[int, Field(ge=1)] | None = None
    tokens_per_update: Annotated[int, Field(ge=1)] | None = None
    strategy: Strategy = "ddp"
    warnings: list[str] = Field(default_factory=list)
    # The plan's micro-batches as (size, count) pairs (Plan.micro_batches); micro_batch is the largest.
    micro_batches: list[MicroBatchCount] = Field(default_factory=list)
    # Every micro-batch size is a multiple of this (the profile's --multiple-of).
    multiple_of: MicroBatch = 1
    # The memory policy the job must run under for this plan to fit (full: gradient checkpointing).
    activation_checkpointing: ActivationCheckpointing = "none"
    # objective=throughput: the timed samples per second of this plan (None: not timed).
    samples_per_second: Annotated[float, Field(gt=0)] | None = None
    # One step per update (A = 1) from the profile's single-step figure (Profile.single_step), above the
    # accumulating max_micro_batch; False: planned from max_micro_batch (autotune.core.plan.plan_with_single_step).
    single_step: bool = False
    # The setup the answering profile was measured under (autotune/core/setup.py): its mesh as Mesh.label writes
    # it (world_size above is D, the replicas), and the host budget it was measured within under offload.
    mesh: Annotated[str, Field(max_length=256)] = ""
    host_budget_bytes: PosBytes | None = None

    @model_validator(mode="after")
    def _default_micro_batches(self) -> Suggestion:
        if not self.micro_batches:
            self.micro_batches = _equal_micro_batches(self.micro_batch, self.accumulation_steps)
        return self

    @classmethod
    def from_plan(cls, plan: Plan, **where: object) -> Suggestion:
        """The plan's numbers plus where they came from (source, profile_id, device_name, ...)."""
        return cls.model_validate(
            {
                "micro_batch": plan.micro_batch,
                "accumulation_steps": plan.accumulation_steps,
                "world_size": plan.world_size,
                "effective_batch": plan.effective_batch,
                "target_batch": plan.target_batch,
                "exact": plan.exact,
                "micro_batches": list(plan.micro_batches),
                **where,
            }
        )

    @property
    def uneven(self) -> bool:
        """Whether the micro-batches of an update differ in size (a balanced plan)."""
        return len({size for size, _ in self.micro_batches}) > 1

    def equal_plan(self, *, warn: str | None = None) -> tuple[int, int, int]:
        """(micro_batch, accumulation_steps, effective_batch) with equal micro-batches.

        The suggestion itself when its micro-batches are equal; for a balanced plan, the best equal
        one (``autotune.core.split.split(..., policy="divisor")`` on the same m_max, T, D and multiple_of),
        with an :class:`autotune.core.split.UnevenPlanWarning` naming the balanced plan when ``warn`` names
        the tool that cannot run it.
        """
        if not self.uneven:
            return self.micro_batch, self.accumulation_steps, self.effective_batch
        [(micro, steps)], _ = split(
            self.max_micro_batch,
            self.target_batch,
            self.world_size,
            multiple_of=self.multiple_of,
            policy="divisor",
        )
        effective = micro * steps * self.world_size
        if warn is not None:
            balanced = micro_batches_text(self.micro_batches, self.world_size)
            exact = "" if effective == self.target_batch else f", target {self.target_batch}"
            warnings.warn(
                f"{warn} runs equal micro-batches only: using {micro} x {steps}"
                f" x {self.world_size} = {effective} ({steps} steps{exact}) "
                f"instead of the balanced plan {balanced}; autotune.loop.accumulate.PlanBatchSampler with "
                "Accumulator runs the balanced one",
                UnevenPlanWarning,
                stacklevel=3,
            )
        return micro, steps, effective

    def as_hf_training_args(self) -> dict[str, int | bool]:
        """Keyword arguments for transformers.TrainingArguments.

        The Trainer runs equal micro-batches only: a balanced plan becomes the best equal one, with
        an UnevenPlanWarning that names the balanced plan.
        """
        micro, steps, _ = self.equal_plan(warn="transformers' Trainer")
        args: dict[str, int | bool] = {"per_device_train_batch_size": micro, "gradient_accumulation_steps": steps}
        if self.activation_checkpointing != "none":  # the Trainer checkpoints every layer or none
            args["gradient_checkpointing"] = True
        if self.activation_checkpointing not in ("none", "full"):
            # Every layer holds no more than the plan's policy does: the plan still fits, with more recomputation.
            warnings.warn(
                f"transformers' Trainer checkpoints every layer or none: gradient_checkpointing=True (every "
                f"layer) stands in for {self.activation_checkpointing!r}, which holds more; the plan fits, "
                "recomputing more than it needs",
                stacklevel=2,
            )
        return args

    def as_lightning(self) -> dict[str, int]:
        """Trainer(accumulate_grad_batches=...) and the DataLoader batch_size (equal micro-batches:
        a balanced plan becomes the best equal one, with an UnevenPlanWarning)."""
        micro, steps, _ = self.equal_plan(warn="Lightning's Trainer")
        return {"accumulate_grad_batches": steps, "batch_size": micro}

    def as_deepspeed(self) -> dict[str, int]:
        """The three batch keys of a DeepSpeed config (DeepSpeed checks they multiply out; equal
        micro-batches only: a balanced plan becomes the best equal one, with an UnevenPlanWarning)."""
        micro, steps, effective = self.equal_plan(warn="DeepSpeed")
        return {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": steps,
            "train_batch_size": effective,
        }


# A profile's fingerprint as /suggest and the profile list take it: hex, as autotune.tasks.fingerprint writes it,
# whole or its first FINGERPRINT_SHOWN_CHARS digits and more (a prefix the server resolves).
FINGERPRINT_PATTERN = r"^[0-9a-f]{16,128}$"
# What autotune.tasks.fingerprint writes: a SHA-256, in hex.
FULL_FINGERPRINT_CHARS = 64
# The form every listing shows (the datasheet, `autotune profiles ls`, the dashboard) and /suggest takes: the
# first 16 hex digits, 64 bits (a clash between two setups of one store is not to be expected below ~4 billion
# fingerprints; the server refuses a prefix several start with, naming them).
FINGERPRINT_SHOWN_CHARS = 16


def shown_fingerprint(fingerprint: str) -> str:
    """The fingerprint as listings show it and /suggest takes it back.

    >>> shown_fingerprint("923454115ee1139d" + "0" * 48)
    '923454115ee1139d'
    """
    return fingerprint[:FINGERPRINT_SHOWN_CHARS]
# Effective batches beyond this cannot be represented in a Plan once rounded to the nearest plan.
MAX_SUGGEST_TARGET_BATCH = 2**40 - 2**30


class SuggestQuery(BaseModel):
    """GET /suggest's query: one job's setup and what it asks for, in one place.

    The server reads it as its query model (FastAPI validates it and writes it into OpenAPI), keeps its
    answers under it (frozen: hashable, the cache key), and computes from it; ``TunerClient.suggest``
    sends it. A new dimension of the question is one field here. Unknown query parameters are ignored
    (a newer client's question still reaches an older server), as they were before this model.
    """

    model_config = ConfigDict(frozen=True)

    fingerprint: Annotated[
        str,
        Field(
            pattern=FINGERPRINT_PATTERN,
            description="the profile's fingerprint, or its first 16 or more hex digits as listings show it (one "
            "stored fingerprint must start with them)",
        ),
    ]
    device_name: Annotated[str, Field(min_length=1, max_length=256)]
    target_batch: Annotated[
        int | None,
        Field(ge=1, le=MAX_SUGGEST_TARGET_BATCH, description="sequences (samples) per update; or target_tokens"),
    ] = None
    seq_len: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_SEQ_LEN,
            description="the job's sequence length (required for a sequence-aware setup; a length nobody "
            "measured is predicted from the memory surface that covers it)",
        ),
    ] = None
    target_tokens: Annotated[
        int | None,
        Field(ge=1, le=2**50, description="tokens per update instead of target_batch (needs seq_len)"),
    ] = None
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)] = 1
    budget_bytes: Annotated[int | None, Field(gt=0, le=MAX_BYTES)] = None
    headroom: Annotated[float | None, Field(ge=0, lt=1)] = None
    strategy: Annotated[
        Strategy, Field(description="ddp (every rank holds the whole model) or fsdp (sharded over world_size)")
    ] = "ddp"
    plan: Annotated[
        PlanPolicy,
        Field(
            description="balanced (the fewest steps: micro-batches within one of each other, listed in "
            "micro_batches) or divisor (equal micro-batches)"
        ),
    ] = DEFAULT_PLAN_POLICY
    # The memory policy: its grammar and canonical spelling are ActivationCheckpointing's (above).
    activation_checkpointing: Annotated[
        ActivationCheckpointing,
        Field(
            description="the job's memory policy: none, every-K (K >= 2), full, op or op:OP/OP/... "
            "(objective memory answers from it)"
        ),
    ] = "none"
    objective: Annotated[
        Objective,
        Field(
            description="memory (the job's policy, the fewest steps) or throughput (the stored policy whose "
            "plan is timed fastest; the answer says which)"
        ),
    ] = "memory"
    # The job's mesh as Mesh.label writes it (autotune/core/mesh.py). The fingerprint carries it too, so only
    # profiles of the same mesh match; here it gives the plan its D: world_size counts every rank.
    mesh: Annotated[
        str,
        Field(
            max_length=256,
            description="the job's mesh, e.g. tp=2 or tp=2,pp=2,pp_schedule=1f1b ('' for none): world_size counts "
            "every rank, and the plan's replicas are world_size / (tp x pp x cp)",
        ),
    ] = ""

    # What the job keeps on the host, and the host memory it may use (--host-budget): a profile measured within
    # another host budget (or none) answers another job. offload and compile are in the fingerprint too; None
    # here takes the fingerprint's, a value must be the profile's.
    host_budget_bytes: Annotated[
        int | None,
        Field(gt=0, le=MAX_BYTES, description="the job's host budget under offload (profiles measured within it)"),
    ] = None
    offload: Annotated[
        Offload | None, Field(description="the job's offload: none, activations or params (default: the profile's)")
    ] = None
    compile: Annotated[
        str | None,
        Field(
            max_length=64,
            description="the job's torch.compile mode (default: the profile's); an estimate of a compiled job ran "
            "the eager step, which the answer says",
        ),
    ] = None
    # How the job's causal LM computes its loss (autotune/core/loss_names.py), in the fingerprint too (the tag
    # lm_loss); canonical before the pattern, so "chunked" asks for TRL's chunked:256.
    lm_loss: Annotated[
        str | None,
        Field(
            max_length=32,
            pattern=LOSS_PATTERN,
            description="the job's loss: plain, chunked:N (TRL's chunked NLL, N tokens per chunk) or fused-linear "
            "(Liger's fused linear cross entropy) (default: the profile's)",
        ),
        BeforeValidator(_canonical_wire_loss),
    ] = None

    @model_validator(mode="after")
    def _mesh_divides_the_world(self) -> SuggestQuery:
        from autotune.core.compositions import Dimensions, composition_refusal
        from autotune.core.errors import AutotuneError
        from autotune.core.mesh import Mesh

        try:
            mesh = Mesh.parse(self.mesh)
            mesh.validate(self.world_size)
        except AutotuneError as exc:
            raise ValueError(str(exc)) from None
        # The composition table refuses a query as the CLI refuses the job (autotune/core/compositions.py), over what
        # the query states: a field it leaves to the profile (offload, compile: None) takes the value no rule reads.
        stated = Dimensions.of(self.strategy, self.world_size, mesh, offload=self.offload or "none")
        refusal = composition_refusal(stated.replace(compile=self.compile, lm_loss=self.lm_loss or "plain"))
        if refusal is not None:
            raise ValueError(refusal)
        return self

    @property
    def data_parallel(self) -> int:
        """D: the data-parallel replicas the plan holds the target over (world_size over the mesh)."""
        from autotune.core.mesh import Mesh

        return Mesh.parse(self.mesh).data_parallel(self.world_size)
