"""The step time an emulated estimate predicts: each operator of the recorded step against the card, each collective
against the fabric, with the overlap the strategy allows. Pure arithmetic, no torch (the records come from
autotune/core/step_records.py; the card's figures from autotune/core/cards.py).

**An operator** takes the longest of its FLOPs against the tensor cores' dense peak for its dtype at an achievable
fraction, its bytes against the memory's bandwidth at an achievable fraction, and the smallest time of a kernel
(:data:`CONSTANTS` says each figure and where it comes from):

- a matmul at the card's largest measured matmul share of the peak (its MAMF: stas00/ml-engineering's table; the
  H100 SXM reaches 794.5 of 989 TFLOPS, 80.3 %), times the share of the SMs its output tiles keep busy over its
  waves (NVIDIA's Matrix Multiplication Background User's Guide, "wave quantization": 128 x 128 tiles);
- an attention kernel at its family's published share: FlashAttention-2 reaches 50-73 % of the A100's peak (Dao,
  2023) and 35 % of the H100's (Shah et al., FlashAttention-3, 2024), cuDNN's 64 % of the H100's (631 TFLOPS in
  pytorch/pytorch#142132); a causal kernel computes half its scores;
- an elementwise kernel at 80 % of the memory's bandwidth, a reduction at 70 % (assumed: a copy reaches about 90 %);

**A collective** takes NCCL's Simple-protocol time (src/graph/tuning.cc: a base latency and a latency per step, the
bytes over the bus bandwidth): a ring of ``n`` ranks moves (n - 1) / n of the buffer (twice for an all-reduce); an
all-reduce over nodes may take the tree where it is faster. Inside an NVLink domain the bus runs at NVLink per GPU
times 370/450 (NCCL's maintainer: "with the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of
370GB/s" of the H100's 450 per direction, NVIDIA/nccl-tests#212); over nodes, NCCL runs a ring per NIC and splits
the buffer between them, so the bus runs at the group's GPUs on one node times their NICs' bandwidth at 94 % (46-48
GB/s of a 400 Gb/s NIC, NVIDIA/nccl-tests#290), at most the NVLink figure.

**Overlap** is a timeline of two streams, compute and communication, through the recorded order (an update's
micro-batches, then the optimizer step): an exposed collective stops compute until it ends; a prefetched one
(FSDP2's all-gather) may start as soon as the compute before it started, and the compute after it waits for it; a
deferred one (a reduce-scatter, DDP's buckets as backward fills them) waits for nothing and is waited for by the
optimizer step only. The parts add up to the update: compute, the communication the timeline leaves exposed, a
pipeline's bubble and the optimizer step.

    >>> from autotune.core.step_records import OpRecord, Segment, StepRecord
    >>> speed = CardSpeed(dense_flops={"bf16": 1e15}, memory_bytes_per_s=3e12, gemm_fraction=0.8, sm_count=132,
    ...                   capability_major=9)
    >>> mm = OpRecord(op="aten.mm.default", kind="gemm", dtype="bf16", phase="forward", flops=8 * 10**12,
    ...               bytes=2 * 3 * 8192 * 8192, shape=(1, 8192, 8192, 8192))
    >>> round(op_seconds(mm, speed), 4)  # 8 TFLOP at 80 % of 1 PFLOP/s, tiles 64 x 64 over 132 SMs: 0.97 busy
    0.0103
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autotune.core.step_records import CollectiveRecord, OpRecord, Segment, StepRecord

__all__ = [
    "CONSTANTS",
    "PRECISION_DTYPE",
    "CardSpeed",
    "Constant",
    "Fabric",
    "FigureOverrides",
    "Figures",
    "UpdateTime",
    "attention_fraction",
    "collective_seconds",
    "members_per_node",
    "op_seconds",
    "predict_update",
    "resolve_figures",
    "wave_efficiency",
]


@dataclass(frozen=True)
class Constant:
    """A figure of the model and where it comes from."""

    value: float
    source: str


CONSTANTS: dict[str, Constant] = {
    "gemm_fraction_default": Constant(
        0.80,
        "assumed for a card without a published MAMF: the MAMF table's NVIDIA cards read 80.3-86.9 % "
        "(stas00/ml-engineering, compute/accelerator/README.md)",
    ),
    "gemm_tile": Constant(
        128,
        "a 128 x 128 output tile per SM (NVIDIA, Matrix Multiplication Background User's "
        "Guide, 'tile and wave quantization')",
    ),
    "elementwise_fraction": Constant(
        0.80,
        "assumed: a device-to-device copy reaches about 90 % of the data sheet's bandwidth; torch's "
        "elementwise kernels a little less (bench/card_calibration.py checks it on a card)",
    ),
    "reduction_fraction": Constant(0.70, "assumed: a reduction reads its input once at a little less than a copy"),
    "kernel_floor_seconds": Constant(4e-6, "assumed: a kernel's launch and its smallest run (a few microseconds)"),
    "host_seconds_per_op": Constant(
        8e-6,
        "assumed: eager PyTorch's dispatch of one operator on the host (of the order of 10 us); a step of "
        "small kernels waits for the host",
    ),
    "nvlink_bus_fraction": Constant(
        370 / 450,
        "NCCL's effective NVLink bandwidth, 370 of the H100's 450 GB/s per direction "
        "(NVIDIA/nccl-tests#212, NCCL's maintainer)",
    ),
    "network_bus_fraction": Constant(
        47 / 50, "46-48 GB/s per 400 Gb/s NDR NIC in nccl-tests (NVIDIA/nccl-tests#290, NVIDIA)"
    ),
    "pcie_bus_fraction": Constant(0.80, "assumed: PCIe's protocol overhead, as NVLink's"),
    "ring_base_latency_seconds": Constant(8.4e-6, "NCCL src/graph/tuning.cc: baseLat, Ring/Simple"),
    "ring_nvlink_step_seconds": Constant(3.4e-6, "NCCL src/graph/tuning.cc: hwLat, NVLink Ring/Simple"),
    "ring_pcie_step_seconds": Constant(5.7e-6, "NCCL src/graph/tuning.cc: hwLat, PCI Ring/Simple"),
    "ring_network_step_seconds": Constant(9.6e-6, "NCCL src/graph/tuning.cc: hwLat, NET Ring/Simple"),
    "tree_nvlink_step_seconds": Constant(28e-6, "NCCL src/graph/tuning.cc: hwLat, NVLink Tree/Simple"),
    "tree_network_step_seconds": Constant(50e-6, "NCCL src/graph/tuning.cc: hwLat, NET Tree/Simple"),
    "tree_bus_fraction": Constant(0.9, "NCCL src/graph/tuning.cc: a tree's bus bandwidth at 0.9 of the ring's"),
}

# An attention kernel's share of the dense peak, by family and compute capability major (the module docstring).
_ATTENTION: dict[tuple[str, int], Constant] = {
    ("flash", 8): Constant(0.60, "FlashAttention-2 (Dao, 2023): 50-73 % of the A100's peak, forward and backward"),
    ("flash", 9): Constant(
        0.35,
        "FlashAttention-3 (Shah et al., 2024): FlashAttention-2 reaches 35 % of the "
        "H100's peak; torch's SDPA flash kernel read 329 of 989 TFLOPS on an H100 "
        "(pytorch/pytorch#142132)",
    ),
    ("cudnn", 9): Constant(
        0.64,
        "torch's SDPA cuDNN kernel read 631 of 989 TFLOPS on an H100 "
        "(pytorch/pytorch#142132, tritonbench, head dim 128)",
    ),
}
_EFFICIENT_SHARE = Constant(
    0.70,
    "assumed: the memory-efficient (xformers/cutlass) kernel at about 0.7 of FlashAttention-2's speed, as "
    "FlashAttention-2's paper compares them on the A100",
)


def attention_fraction(kernel: str | None, capability_major: int) -> Constant:
    """The share of the dense peak an attention kernel of ``kernel``'s family reaches on a card of this compute
    capability: the published figure of its family and architecture; the nearest architecture's otherwise
    (Blackwell takes Hopper's, Ada Ampere's), said as assumed; the memory-efficient kernel at 0.7 of flash's.

    >>> attention_fraction("flash", 9).value, attention_fraction("efficient", 8).value
    (0.35, 0.42)
    >>> attention_fraction("flash", 10).source.startswith("assumed")
    True
    """
    family = "flash" if kernel in (None, "efficient") else kernel
    major = 9 if capability_major >= 9 else 8
    found = _ATTENTION.get((family, major)) or _ATTENTION[("flash", major)]
    if capability_major not in (8, 9) or (family, major) not in _ATTENTION:
        found = Constant(found.value, f"assumed: {found.source}, taken for compute capability {capability_major}")
    if kernel == "efficient":
        return Constant(round(found.value * _EFFICIENT_SHARE.value, 4), f"{_EFFICIENT_SHARE.source}; {found.source}")
    return found


@dataclass(frozen=True)
class CardSpeed:
    """What an operator's time depends on: the dense peaks per dtype (FLOP/s), the memory's bandwidth (B/s), the
    card's matmul share of its peak, its SMs and its compute capability's major."""

    dense_flops: Mapping[str, float]
    memory_bytes_per_s: float
    gemm_fraction: float
    sm_count: int
    capability_major: int


@dataclass(frozen=True)
class Fabric:
    """What a collective's time depends on, per GPU and one direction (B/s): NVLink inside its domain of
    ``nvlink_gpus``, PCIe elsewhere in a node of ``gpus_per_node``, the network between nodes (None: not known, so
    no group may span nodes)."""

    nvlink_bytes_per_s: float | None
    nvlink_gpus: int
    pcie_bytes_per_s: float
    network_bytes_per_s: float | None
    gpus_per_node: int = 8


def wave_efficiency(batch: int, m: int, n: int, sm_count: int) -> float:
    """The share of the SMs a matmul's output tiles keep busy over its waves (NVIDIA's wave quantization): tiles of
    128 x 128, as many at once as there are SMs.

    >>> round(wave_efficiency(1, 16384, 4096, 132), 3)  # 4096 tiles in 32 waves of 132
    0.97
    >>> round(wave_efficiency(1, 128, 128, 132), 4)  # one tile: one SM of 132
    0.0076
    """
    tile = CONSTANTS["gemm_tile"].value
    work = batch * (m / tile) * (n / tile)
    waves = math.ceil(batch * math.ceil(m / tile) * math.ceil(n / tile) / sm_count)
    return min(1.0, work / (waves * sm_count)) if waves else 1.0


def op_seconds(op: OpRecord, speed: CardSpeed) -> float:
    """One call's time on the card (the module docstring).

    Raises:
        KeyError: the card has no dense peak for a matmul's or attention's dtype (the caller names it).
    """
    floor = CONSTANTS["kernel_floor_seconds"].value
    memory = speed.memory_bytes_per_s
    if op.kind == "gemm":
        batch, m, n, _ = op.shape or (1, 1 << 20, 1 << 20, 1)
        busy = speed.gemm_fraction * max(wave_efficiency(batch, m, n, speed.sm_count), 1e-3)
        compute = op.flops / (speed.dense_flops[op.dtype] * busy)
        return max(compute, op.bytes / (memory * CONSTANTS["elementwise_fraction"].value), floor)
    if op.kind == "attention":
        flops = op.flops / 2 if op.causal else op.flops
        share = attention_fraction(op.kernel, speed.capability_major).value
        compute = flops / (speed.dense_flops[op.dtype] * share)
        return max(compute, op.bytes / (memory * CONSTANTS["elementwise_fraction"].value), floor)
    fraction = CONSTANTS["reduction_fraction" if op.kind == "reduction" else "elementwise_fraction"].value
    return max(op.bytes / (memory * fraction), floor)


def members_per_node(group_size: int, stride: int, gpus_per_node: int) -> int:
    """How many of a group's ranks (``stride`` apart, the first at a node's first GPU) share its node.

    >>> members_per_node(8, 1, 8), members_per_node(16, 2, 8), members_per_node(4, 8, 8)
    (8, 4, 1)
    """
    if stride >= gpus_per_node:
        return 1
    return min(group_size, math.ceil(gpus_per_node / stride))


@dataclass(frozen=True)
class _Group:
    """A collective's group on the fabric: its bus bandwidth (B/s), ranks, nodes and NCCL's latencies per step."""

    bus: float
    ranks: int
    nodes: int
    intra_step: float
    inter_step: float
    tree_intra_step: float


def _group(collective: CollectiveRecord, fabric: Fabric) -> _Group:
    ranks = collective.group_size
    on_node = members_per_node(ranks, collective.stride, fabric.gpus_per_node)
    nodes = math.ceil(ranks / on_node)
    span_gpus = (on_node - 1) * collective.stride + 1  # the node's GPUs the group's ranks reach across
    nvlink = fabric.nvlink_bytes_per_s
    if nvlink is not None and span_gpus <= fabric.nvlink_gpus:
        intra = nvlink * CONSTANTS["nvlink_bus_fraction"].value
        step, tree_step = CONSTANTS["ring_nvlink_step_seconds"].value, CONSTANTS["tree_nvlink_step_seconds"].value
    else:
        intra = fabric.pcie_bytes_per_s * CONSTANTS["pcie_bus_fraction"].value
        step, tree_step = CONSTANTS["ring_pcie_step_seconds"].value, CONSTANTS["tree_nvlink_step_seconds"].value
    if nodes == 1:
        return _Group(intra, ranks, 1, step, step, tree_step)
    if fabric.network_bytes_per_s is None:
        raise KeyError("network")
    network = on_node * fabric.network_bytes_per_s * CONSTANTS["network_bus_fraction"].value
    return _Group(min(intra, network), ranks, nodes, step, CONSTANTS["ring_network_step_seconds"].value, tree_step)


def collective_seconds(collective: CollectiveRecord, fabric: Fabric) -> float:
    """A collective's time by NCCL's Simple-protocol model (the module docstring).

    >>> from autotune.core.step_records import CollectiveRecord
    >>> fabric = Fabric(nvlink_bytes_per_s=450e9, nvlink_gpus=8, pcie_bytes_per_s=64e9, network_bytes_per_s=50e9)
    >>> gather = CollectiveRecord(kind="all_gather", bytes=2**30, group_size=8, phase="forward", overlap="prefetched")
    >>> round(collective_seconds(gather, fabric) * 1e3, 3)  # 7/8 of 1 GiB at 370 GB/s, 8.4 + 7 x 3.4 us
    2.571
    >>> wide = gather.model_copy(update={"group_size": 64})  # 8 nodes: rings per NIC, min(370, 8 x 47) GB/s
    >>> round(collective_seconds(wide, fabric) * 1e3, 3)  # and 56 NVLink steps, 7 network steps of latency
    3.123

    Raises:
        KeyError: the group spans nodes and the fabric has no network figure (the caller names it).
    """
    if collective.group_size <= 1 or collective.bytes == 0:
        return 0.0
    group = _group(collective, fabric)
    ranks, nodes, size = group.ranks, group.nodes, float(collective.bytes)
    base = CONSTANTS["ring_base_latency_seconds"].value

    def ring(steps: int, inter_steps: int, moved: float) -> float:
        return base + (steps - inter_steps) * group.intra_step + inter_steps * group.inter_step + moved / group.bus

    if collective.kind in ("all_gather", "reduce_scatter"):
        return ring(ranks - 1, nodes - 1, (ranks - 1) / ranks * size)
    if collective.kind == "all_reduce":
        by_ring = ring(2 * (ranks - 1), 2 * (nodes - 1), 2 * (ranks - 1) / ranks * size)
        if nodes == 1:
            return by_ring
        tree_latency = 2 * (
            (ranks // nodes - 1) * group.tree_intra_step
            + math.log2(nodes) * CONSTANTS["tree_network_step_seconds"].value
        )
        return min(by_ring, tree_latency + 2 * size / (group.bus * CONSTANTS["tree_bus_fraction"].value))
    if collective.kind == "all_to_all":
        return ring(1, min(1, nodes - 1), (ranks - 1) / ranks * size)
    return ring(1, min(1, nodes - 1), size)  # broadcast (pipelined along a ring), send_recv


@dataclass
class _Timeline:
    """Two streams through the recorded order: compute and communication (the module docstring)."""

    speed: CardSpeed
    fabric: Fabric
    compute_at: float = 0.0
    comm_at: float = 0.0
    compute_seconds: float = 0.0
    recompute_seconds: float = 0.0
    host_bound_seconds: float = 0.0
    _op_seconds: dict[tuple[int, int], float] = field(default_factory=dict)

    def _op(self, record: StepRecord, index: int) -> float:
        key = (id(record), index)
        if key not in self._op_seconds:
            self._op_seconds[key] = op_seconds(record.ops[index], self.speed)
        return self._op_seconds[key]

    def _compute(self, record: StepRecord, segment: Segment) -> float:
        """A segment's compute: its kernels' time, or its host's dispatch where that is longer."""
        device = sum(self._op(record, index) * count for index, count in segment.ops)
        host = CONSTANTS["host_seconds_per_op"].value * sum(count for _, count in segment.ops)
        self.host_bound_seconds += max(0.0, host - device)
        return max(device, host)

    def run(self, record: StepRecord, segments: Sequence[Segment]) -> tuple[float, float]:
        """Run segments of record; the compute stream's (start, end) of their backward, for DDP's buckets."""
        backward = (math.inf, 0.0)
        for segment in segments:
            phase = record.ops[segment.ops[0][0]].phase if segment.ops else None
            seconds = self._compute(record, segment)
            for _ in range(segment.repeat):
                started = self.compute_at
                self.compute_at += seconds
                self.compute_seconds += seconds
                if phase == "recompute":
                    self.recompute_seconds += seconds
                if phase in ("backward", "recompute"):
                    backward = (min(backward[0], started), self.compute_at)
                if segment.collective is not None:
                    self._collective(segment.collective, started)
        return backward

    def _collective(self, collective: CollectiveRecord, segment_started: float) -> None:
        seconds = collective_seconds(collective, self.fabric)
        if collective.overlap == "exposed":
            start = max(self.compute_at, self.comm_at)
            self.compute_at = self.comm_at = start + seconds
        elif collective.overlap == "prefetched":
            self.comm_at = max(segment_started, self.comm_at) + seconds
            self.compute_at = max(self.compute_at, self.comm_at)
        else:
            self.comm_at = max(self.compute_at, self.comm_at) + seconds

    def buckets(self, record: StepRecord, backward: tuple[float, float]) -> None:
        """DDP's all-reduces, each launched when backward has filled its bucket (by bytes, evenly over backward)."""
        start, end = backward if backward[0] < math.inf else (self.compute_at, self.compute_at)
        total = sum(b.bytes for b in record.ddp_buckets) or 1
        filled = 0
        for bucket in record.ddp_buckets:
            filled += bucket.bytes
            ready = start + (end - start) * filled / total
            self.comm_at = max(ready, self.comm_at) + collective_seconds(bucket, self.fabric)

    @property
    def end(self) -> float:
        return max(self.compute_at, self.comm_at)


@dataclass(frozen=True)
class UpdateTime:
    """The predicted time of one update and its parts (they add up to ``seconds``).

    Attributes:
        micro_batches: the update's (size, count) per replica, in order.
        seconds: the update: its micro-batches' forward and backward, the communication left exposed, a pipeline's
            bubble, the optimizer step.
        compute_seconds: the kernels' time of every micro-batch (the host's where longer), recomputation included.
        recompute_seconds: of compute, the checkpointed forwards run again in backward.
        exposed_communication_seconds: what the collectives add past compute (the timeline's overhang).
        bubble_seconds: a pipeline's idle stages (0 without one).
        optimizer_seconds: the optimizer step (and its collectives).
        micro_batch_seconds: each size's one micro-batch that does not end an update, alone.
        per_update_seconds: what an update costs once besides the optimizer step (the bubble, the overhang of the
            last micro-batch's gradient reduction).
        host_bound_seconds: of compute, where the host's dispatch was longer than the kernels.
    """

    micro_batches: tuple[tuple[int, int], ...]
    seconds: float
    compute_seconds: float
    recompute_seconds: float
    exposed_communication_seconds: float
    bubble_seconds: float
    optimizer_seconds: float
    micro_batch_seconds: dict[int, float]
    per_update_seconds: float
    host_bound_seconds: float


def _micro_batch_alone(record: StepRecord, speed: CardSpeed, fabric: Fabric) -> float:
    line = _Timeline(speed, fabric)
    line.run(record, record.other)
    return line.end


def predict_update(
    records: Mapping[int, StepRecord],
    micro_batches: Sequence[tuple[int, int]],
    speed: CardSpeed,
    fabric: Fabric,
    *,
    pipeline_stages: int = 1,
    virtual_stages: int = 1,
) -> UpdateTime:
    """The time of one update of ``micro_batches`` ((size, count) per replica, in order; the last one ends it) from
    the recorded steps at each size.

    A pipeline (``pipeline_stages`` ranks of stages, ``virtual_stages`` chunks each; the records are the most loaded
    stage's): its schedule leaves each rank idle for (stages - 1) / virtual_stages micro-batches' forward and
    backward (1F1B and GPipe: stages - 1; interleaved 1F1B: divided by V), the bubble.

    Raises:
        KeyError: a size without a record; a dtype the card has no peak for; a group over nodes without a network.
    """
    if any(record.stage is not None for record in records.values()):
        return _pipeline_update(records, micro_batches, speed, fabric, pipeline_stages, virtual_stages)
    order = [size for size, count in micro_batches for _ in range(count)]
    line = _Timeline(speed, fabric)
    for size in order[:-1]:
        line.run(records[size], records[size].other)
    last = records[order[-1]]
    line.buckets(last, line.run(last, last.last))
    forward_backward_end = line.end
    compute = line.compute_seconds
    exposed = forward_backward_end - compute
    bubble = 0.0
    if pipeline_stages > 1:
        bubble = (pipeline_stages - 1) / virtual_stages * forward_backward_end / len(order)
    line.compute_at = line.comm_at = forward_backward_end
    line.run(last, last.step)
    optimizer = line.end - forward_backward_end
    alone = {size: _micro_batch_alone(records[size], speed, fabric) for size in dict(micro_batches)}
    total = forward_backward_end + bubble + optimizer
    return UpdateTime(
        micro_batches=tuple((int(s), int(c)) for s, c in micro_batches),
        seconds=total,
        compute_seconds=compute,
        recompute_seconds=line.recompute_seconds,
        exposed_communication_seconds=exposed,
        bubble_seconds=bubble,
        optimizer_seconds=optimizer,
        micro_batch_seconds=alone,
        # Never below 0: the timeline of a whole update overlaps what a micro-batch alone leaves exposed.
        per_update_seconds=max(0.0, total - optimizer - sum(alone[size] * count for size, count in micro_batches)),
        host_bound_seconds=line.host_bound_seconds,
    )


@dataclass(frozen=True)
class FigureOverrides:
    """The card's and the fabric's figures a user states (``autotune estimate --peak-tflops ...``), each replacing the
    catalog's: the dense peak at the job's precision (TFLOPS; the card's other peaks scaled by the same ratio), the
    memory's bandwidth (TB/s), NVLink per GPU one direction (GB/s), the network per GPU (Gb/s), GPUs per node."""

    peak_tflops: float | None = None
    memory_tbytes_per_s: float | None = None
    nvlink_gbytes_per_s: float | None = None
    network_gbits_per_s: float | None = None
    gpus_per_node: int | None = None

    def flags(self) -> list[str]:
        """The flags given, as the datasheet says them."""
        named = (
            ("--peak-tflops", self.peak_tflops),
            ("--memory-tbytes-per-s", self.memory_tbytes_per_s),
            ("--nvlink-gbytes-per-s", self.nvlink_gbytes_per_s),
            ("--network-gbits-per-s", self.network_gbits_per_s),
            ("--gpus-per-node", self.gpus_per_node),
        )
        return [f"{flag} {value:g}" for flag, value in named if value is not None]


# The dense peak a job's precision computes at (its matmuls' dtype).
PRECISION_DTYPE = {"bf16": "bf16", "bf16-autocast": "bf16", "fp16": "fp16", "fp32": "fp32"}


@dataclass(frozen=True)
class Figures:
    """A card's speed and the fabric around it, resolved from the catalog and the user's figures; or, where one
    the prediction needs is missing, ``missing``: which, in a line naming the flag that gives it."""

    speed: CardSpeed | None
    fabric: Fabric | None
    peak_flops: float | None
    missing: str | None = None
    assumed: tuple[str, ...] = ()


def resolve_figures(
    card_name: str,
    performance: object | None,
    *,
    sm_count: int,
    capability_major: int,
    precision: str,
    overrides: FigureOverrides = FigureOverrides(),
) -> Figures:
    """The figures a prediction for ``card_name`` at ``precision`` uses: the catalog's (``performance``: an
    autotune.core.cards.Performance, or None for a card it has none for) with the user's in their place.

    >>> from autotune.core.cards import lookup
    >>> h100 = lookup("h100")
    >>> found = resolve_figures("h100", h100.performance, sm_count=132, capability_major=9, precision="bf16")
    >>> found.peak_flops, found.speed.memory_bytes_per_s, found.fabric.network_bytes_per_s
    (989400000000000.0, 3350000000000.0, 50000000000.0)
    >>> a10g = resolve_figures("a10g", None, sm_count=80, capability_major=8, precision="bf16")
    >>> print(a10g.missing)  # doctest: +NORMALIZE_WHITESPACE
    the a10g's dense bf16 peak and memory bandwidth are not in the catalog (give --peak-tflops and
    --memory-tbytes-per-s)
    >>> slower = FigureOverrides(peak_tflops=835)
    >>> round(resolve_figures("h100", h100.performance, sm_count=132, capability_major=9, precision="bf16",
    ...                       overrides=slower).speed.dense_flops["fp8"] / 1e12, 1)
    1670.1
    """
    dtype = PRECISION_DTYPE.get(precision, "fp32")
    peaks: dict[str, float] = dict(getattr(performance, "dense_tflops", {}) or {})
    memory = overrides.memory_tbytes_per_s or getattr(performance, "memory_tbytes_per_s", None)
    if overrides.peak_tflops is not None:
        ratio = overrides.peak_tflops / peaks[dtype] if peaks.get(dtype) else None
        peaks = {name: value * ratio for name, value in peaks.items()} if ratio else peaks
        peaks[dtype] = overrides.peak_tflops
        if dtype in ("bf16", "fp16"):  # the tensor cores run both at one rate (every data sheet of the catalog)
            peaks.setdefault("fp16" if dtype == "bf16" else "bf16", overrides.peak_tflops)
    absent = []
    if dtype not in peaks:
        absent.append(f"dense {dtype} peak")
    if memory is None:
        absent.append("memory bandwidth")
    if absent:
        wanted = (("--peak-tflops", dtype not in peaks), ("--memory-tbytes-per-s", memory is None))
        flags = [flag for flag, gone in wanted if gone]
        verb = "is" if len(absent) == 1 else "are"
        where = "not in the catalog" if performance is None else f"not on the {card_name}'s data sheet"
        unknown = getattr(performance, "unknown", None)
        said = f"the {card_name}'s {' and '.join(absent)} {verb} {where}" + (f" ({unknown})" if unknown else "")
        return Figures(None, None, None, missing=f"{said} (give {' and '.join(flags)})")
    assumed = []
    gemm = getattr(performance, "gemm_fraction", None)
    if gemm is None:
        gemm = CONSTANTS["gemm_fraction_default"].value
        assumed.append(f"matmuls at {gemm:.0%} of the peak ({CONSTANTS['gemm_fraction_default'].source})")
    assert memory is not None  # absent otherwise
    speed = CardSpeed(
        dense_flops={name: value * 1e12 for name, value in peaks.items()},
        memory_bytes_per_s=memory * 1e12,
        gemm_fraction=gemm,
        sm_count=sm_count,
        capability_major=capability_major,
    )
    nvlink = overrides.nvlink_gbytes_per_s or getattr(performance, "nvlink_gbytes_per_s", None)
    network = overrides.network_gbits_per_s or getattr(performance, "network_gbits_per_s", None)
    fabric = Fabric(
        nvlink_bytes_per_s=None if nvlink is None else nvlink * 1e9,
        nvlink_gpus=getattr(performance, "nvlink_gpus", 1) if nvlink is not None else 1,
        pcie_bytes_per_s=getattr(performance, "pcie_gbytes_per_s", 32.0) * 1e9,
        network_bytes_per_s=None if network is None else network * 1e9 / 8,
        gpus_per_node=overrides.gpus_per_node or 8,
    )
    return Figures(speed, fabric, peaks[dtype] * 1e12, assumed=tuple(assumed))


def _pipeline_update(
    records: Mapping[int, StepRecord],
    micro_batches: Sequence[tuple[int, int]],
    speed: CardSpeed,
    fabric: Fabric,
    stages: int,
    virtual_stages: int,
) -> UpdateTime:
    """One pipeline rank's update: its recorded replay of K micro-batches (forwards and backwards in the schedule's
    order, with its collectives), scaled to the plan's count of equal micro-batches, the schedule's bubble, and the
    optimizer step. The sends between stages are left out (a micro-batch's activation each way, overlapped by the
    schedule's other micro-batches)."""
    if len(micro_batches) != 1:
        raise ValueError(f"a pipeline's update is of equal micro-batches, got {list(micro_batches)}")
    ((size, count),) = micro_batches
    record = records[size]
    line = _Timeline(speed, fabric)
    line.run(record, record.last)
    scale = count / record.microbatches
    forward_backward = line.end * scale
    compute = line.compute_seconds * scale
    per_micro_batch = forward_backward / count
    bubble = (stages - 1) / virtual_stages * per_micro_batch
    before = line.end
    line.compute_at = line.comm_at = before
    line.run(record, record.step)
    optimizer = line.end - before
    return UpdateTime(
        micro_batches=((int(size), int(count)),),
        seconds=forward_backward + bubble + optimizer,
        compute_seconds=compute,
        recompute_seconds=line.recompute_seconds * scale,
        exposed_communication_seconds=forward_backward - compute,
        bubble_seconds=bubble,
        optimizer_seconds=optimizer,
        micro_batch_seconds={int(size): per_micro_batch},
        per_update_seconds=bubble,
        host_bound_seconds=line.host_bound_seconds * scale,
    )
