"""The card catalog: the CUDA cards an estimate can be for, with what their driver reports. Torch-free.

Each card is what a process on it would read: the name NVML and ``torch.cuda.get_device_name`` give,
the memory ``nvidia-smi``/NVML gives, compute capability, SM count, and the properties
``cudaGetDeviceProperties`` fills in, which the CUDA emulation (autotune/emulation/) serves to a CUDA
build of torch on a host without the card. Limits that follow from the architecture alone (threads,
blocks and shared memory per SM) come from the CUDA C++ Programming Guide's table of technical
specifications per compute capability; the rest from each card's data sheet, cited in its entry.

    >>> card = lookup("H200")
    >>> card.nvml_name, card.compute_capability, card.sm_count
    ('NVIDIA H200', (9, 0), 132)
    >>> card.memory_bytes // 2**20  # MiB, as nvidia-smi lists it
    143771
    >>> lookup("nvidia h100 80gb hbm3").short_name
    'h100'

What is measured and what is not: the H200's NVML memory and its memory outside the caching allocator
were measured by this project (``../shared/gpu-runs/2026-11-30-h200-gpu_check.log``). Every other
figure is the vendor's data sheet or a public listing of ``nvidia-smi`` and
``torch.cuda.get_device_properties`` output, not measured here; a figure with no source is None, and
an entry whose figure is assumed says which in ``Card.assumed``.

Memory is NVML's total in MiB as ``nvidia-smi --query-gpu=memory.total`` lists it with the 5xx drivers
(the V100s listed 16160 / 32510 MiB under older drivers, 16384 / 32768 MiB now), never the marketing GB:
an "80 GB" H100 reports 81559 MiB, a "94 GB" H100 NVL 95830 MiB, a "96 GB" GH200 97871 MiB.

The memory outside the caching allocator is measured on the H200 only; every other card takes the H200's
figure as a stand-in (:func:`outside_allocator_stand_in` says why and what differs).

A card the catalog lacks is described by its name and memory (``--gpu NAME --gpu-memory 96GiB``):
:func:`unlisted_card` takes everything else from the catalog's closest card and records which.

    >>> card = unlisted_card("NVIDIA H100 96GB HBM3", 96 * 2**30)
    >>> card.compute_capability, card.sm_count, card.assumed_from
    ((9, 0), 132, 'h100-96gb')
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from autotune.core.units import format_bytes

__all__ = [
    "ALIASES",
    "ARCHITECTURES",
    "CARDS",
    "OUTSIDE_ALLOCATOR",
    "PERFORMANCE",
    "Architecture",
    "Card",
    "OutsideAllocator",
    "Performance",
    "closest_card",
    "known_names",
    "lookup",
    "outside_allocator",
    "outside_allocator_stand_in",
    "resolve_card",
    "unlisted_card",
]

MiB = 2**20
KiB = 2**10


@dataclass(frozen=True)
class Architecture:
    """What every card of one compute capability shares (CUDA C++ Programming Guide, "Features and
    Technical Specifications", the table of technical specifications per compute capability)."""

    compute_capability: tuple[int, int]
    max_threads_per_sm: int
    max_blocks_per_sm: int
    shared_memory_per_sm_bytes: int
    # The most a block may opt in to (cudaFuncAttributeMaxDynamicSharedMemorySize): what flash attention
    # and cuDNN check before they pick a kernel.
    shared_memory_per_block_optin_bytes: int
    # Shared memory the system keeps per block (1 KiB from compute capability 8.0 on).
    reserved_shared_memory_per_block_bytes: int
    registers_per_sm: int = 65536
    # The same on every capability from 5.0 to 12.x.
    registers_per_block: int = 65536
    shared_memory_per_block_bytes: int = 48 * 1024
    max_threads_per_block: int = 1024
    warp_size: int = 32
    constant_memory_bytes: int = 64 * 1024
    # The most memory any card of the architecture ships (its largest data-sheet figure, rounded up to a GiB): an
    # unlisted card given more (--gpu-memory 1TiB) is no card at all, and its estimate would promise what none
    # holds.
    max_memory_bytes: int = 0
    # The least memory any device of the architecture presents to a process (its smallest card, or its smallest
    # MIG instance where the architecture has MIG: a slice is what torch sees there), the data sheet's decimal GB
    # rounded down to a GiB; and that device, for the refusal's line. Less (--gpu-memory 1KiB) is no card at all.
    min_memory_bytes: int = 0
    min_memory_device: str = ""


ARCHITECTURES = {
    arch.compute_capability: arch
    for arch in (
        # Volta: V100 32GB; TITAN V (12 GB HBM2).
        Architecture(
            (7, 0), 2048, 32, 96 * KiB, 96 * KiB, 0, max_memory_bytes=32 * 2**30,
            min_memory_bytes=11 * 2**30, min_memory_device="TITAN V, 12 GB",
        ),
        # Turing: Quadro RTX 8000; T400 (2 GB GDDR6).
        Architecture(
            (7, 5), 1024, 16, 64 * KiB, 64 * KiB, 0, max_memory_bytes=48 * 2**30,
            min_memory_bytes=1 * 2**30, min_memory_device="NVIDIA T400, 2 GB",
        ),
        # A100 80GB; the A100 40GB's MIG 1g.5gb instance (NVIDIA MIG User Guide, supported profiles).
        Architecture(
            (8, 0), 2048, 32, 164 * KiB, 163 * KiB, 1024, max_memory_bytes=80 * 2**30,
            min_memory_bytes=4 * 2**30, min_memory_device="A100 40GB MIG 1g.5gb, 5 GB",
        ),
        # GA10x: RTX A6000; GeForce MX570 (2 GB GDDR6).
        Architecture(
            (8, 6), 1536, 16, 100 * KiB, 99 * KiB, 1024, max_memory_bytes=48 * 2**30,
            min_memory_bytes=1 * 2**30, min_memory_device="GeForce MX570, 2 GB",
        ),
        # Ada: L40S; GeForce RTX 4050 Laptop GPU (6 GB GDDR6).
        Architecture(
            (8, 9), 1536, 24, 100 * KiB, 99 * KiB, 1024, max_memory_bytes=48 * 2**30,
            min_memory_bytes=5 * 2**30, min_memory_device="GeForce RTX 4050 Laptop GPU, 6 GB",
        ),
        # Hopper: GH200; the H100's MIG 1g.10gb instance (NVIDIA MIG User Guide, supported profiles).
        Architecture(
            (9, 0), 2048, 32, 228 * KiB, 227 * KiB, 1024, max_memory_bytes=144 * 2**30,
            min_memory_bytes=9 * 2**30, min_memory_device="H100 MIG 1g.10gb, 10 GB",
        ),
        # Blackwell: B300; the B200's MIG 1g.23gb instance (NVIDIA MIG User Guide, supported profiles).
        Architecture(
            (10, 0), 2048, 32, 228 * KiB, 227 * KiB, 1024, max_memory_bytes=288 * 2**30,
            min_memory_bytes=21 * 2**30, min_memory_device="B200 MIG 1g.23gb, 23 GB",
        ),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Performance:
    """What a step's predicted time needs of a card (autotune/core/step_time.py), each figure from the vendor's
    data sheet (``source``), none measured here.

    Attributes:
        dense_tflops: the peak of the tensor cores without sparsity, per dtype ("bf16", "fp16", "tf32", "fp8"), and
            of the CUDA cores for "fp32" (torch's default for a float32 matmul: ``allow_tf32`` is off); a dtype the
            card lacks (bf16 before Ampere) is absent. Data sheets print the sparse figure first: half of it.
        memory_tbytes_per_s: the memory's bandwidth, TB/s (10**12 bytes).
        nvlink_gbytes_per_s: NVLink per GPU, one direction, GB/s (data sheets print both directions: half of it);
            None where the card has none.
        nvlink_gpus: how many GPUs one NVLink domain joins (8 through NVSwitch, 2 over a bridge, 1 for none).
        pcie_gbytes_per_s: the host link per GPU, one direction, GB/s: what joins GPUs of a node outside an NVLink
            domain.
        network_gbits_per_s: the network per GPU of the vendor's reference system (DGX H100: a 400 Gb/s ConnectX-7
            per GPU), Gb/s; None where there is no reference system (a PCIe card): a job over nodes names it.
        gemm_fraction: the largest share of the bf16 peak a matmul reaches on the card (the Maximum Achievable
            Matmul FLOPS of stas00/ml-engineering, compute/accelerator/README.md, over the data sheet's peak);
            None where none was published for the card or its die.
        source: where the figures come from, in a line.
        assumed: what of the entry has no source of its own, in a line (None: every figure has one).
        unknown: why a figure is absent and what bounds it, where that is published (None: nothing is absent).
    """

    dense_tflops: dict[str, float]
    memory_tbytes_per_s: float
    nvlink_gbytes_per_s: float | None
    nvlink_gpus: int
    pcie_gbytes_per_s: float
    network_gbits_per_s: float | None
    gemm_fraction: float | None
    source: str
    assumed: str | None = None
    unknown: str | None = None


def _hopper_sxm(memory_tbytes_per_s: float, source: str, **more: object) -> Performance:
    """The SXM5 Hopper's peaks (H100 SXM5 and H200 data sheets: BF16/FP16 1,979, TF32 989, FP8 3,958 TFLOPS with
    sparsity; FP32 67), NVLink 4 through NVSwitch (900 GB/s both directions), PCIe Gen5 x16 (128 GB/s both)."""
    fields: dict[str, object] = {
        "dense_tflops": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp8": 1978.9, "fp32": 66.9},
        "memory_tbytes_per_s": memory_tbytes_per_s,
        "nvlink_gbytes_per_s": 450.0,
        "nvlink_gpus": 8,
        "pcie_gbytes_per_s": 64.0,
        "network_gbits_per_s": 400.0,
        "gemm_fraction": 794.5 / 989.4,
        "source": source,
    }
    fields.update(more)
    return Performance(**fields)  # type: ignore[arg-type]


_MAMF = "MAMF (stas00/ml-engineering, compute/accelerator/README.md, BF16 v2 table)"
# The figures per card short name. The network is the vendor's reference system's (DGX); a PCIe card has none.
PERFORMANCE: dict[str, Performance] = {
    "h100": _hopper_sxm(
        3.35,
        "NVIDIA H100 Tensor Core GPU data sheet (SXM5: 3.35 TB/s, NVLink 900 GB/s); DGX H100 data sheet (a 400 Gb/s "
        f"ConnectX-7 per GPU); {_MAMF}: H100 SXM 794.5 of 989 TFLOPS",
    ),
    "h200": _hopper_sxm(
        4.8,
        "NVIDIA H200 Tensor Core GPU data sheet (SXM: 4.8 TB/s, NVLink 900 GB/s); DGX H200 data sheet (a 400 Gb/s "
        f"ConnectX-7 per GPU); {_MAMF}: GH200 141 GB HBM3e (the H200's die and memory) 828.6 of 989 TFLOPS",
        gemm_fraction=828.6 / 989.4,
        assumed="the matmul share is the GH200 141 GB's, measured at 900 W where an H200 SXM draws 700 W",
    ),
    "h100-96gb": _hopper_sxm(
        2.4,
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (96 GB HBM2e at 2.4 TB/s, 8 GPUs fully connected "
        "with NVLink, 400 Gb/s per GPU, 500 W)",
        dense_tflops={},
        assumed="the NVLink figure is the SXM5's; the matmul share is the H100 SXM's (measured at 700 W)",
        unknown="torchtitan: its peak lies between the H100 NVL's 835 and the H100 SXM's 989 TFLOPS bf16, not known; "
        "--peak-tflops 835 and 989 bound it",
    ),
    "h100-pcie": Performance(
        {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp8": 1513.0, "fp32": 51.2}, 2.0, 300.0, 2, 64.0, None,
        794.5 / 989.4,
        "NVIDIA H100 Tensor Core GPU data sheet (PCIe: BF16 1,513 TFLOPS with sparsity, 2.0 TB/s, NVLink bridge "
        f"600 GB/s between two cards, PCIe Gen5 128 GB/s); {_MAMF}: the H100 SXM's share",
        assumed="the matmul share is the H100 SXM's",
    ),
    "h100-nvl": Performance(
        {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp8": 1670.5, "fp32": 60.0}, 3.9, 300.0, 2, 64.0, None,
        794.5 / 989.4,
        "NVIDIA H100 Tensor Core GPU data sheet (NVL: BF16 1,671 TFLOPS with sparsity, 3.9 TB/s, NVLink bridge "
        f"600 GB/s between two cards, PCIe Gen5 128 GB/s); {_MAMF}: the H100 SXM's share",
        assumed="the matmul share is the H100 SXM's",
    ),
    "gh200": Performance(
        {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp8": 1978.9, "fp32": 67.0}, 4.0, 450.0, 1, 64.0, None,
        828.6 / 989.4,
        "NVIDIA GH200 Grace Hopper Superchip data sheet (96 GB HBM3: 4 TB/s, BF16 1,979 TFLOPS with sparsity, "
        f"NVLink 900 GB/s); {_MAMF}: GH200 828.6 of 989 TFLOPS",
        assumed="one GPU per NVLink domain and no network: GH200 systems differ (--gpus-per-node, "
        "--network-gbits-per-s)",
    ),
    "a100-80gb": Performance(
        {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 2.039, 300.0, 8, 32.0, 200.0, 271.2 / 312.0,
        "NVIDIA A100 Tensor Core GPU data sheet (SXM 80 GB: BF16 312 TFLOPS, 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 "
        f"64 GB/s); DGX A100 data sheet (a 200 Gb/s ConnectX-6 per GPU); {_MAMF}: A100 SXM 271.2 of 312 TFLOPS",
    ),
    "a100-40gb": Performance(
        {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 1.555, 300.0, 8, 32.0, 200.0, 271.2 / 312.0,
        "NVIDIA A100 Tensor Core GPU data sheet (SXM 40 GB: BF16 312 TFLOPS, 1,555 GB/s, NVLink 600 GB/s, PCIe Gen4 "
        f"64 GB/s); DGX A100 data sheet (a 200 Gb/s ConnectX-6 per GPU); {_MAMF}: A100 SXM 271.2 of 312 TFLOPS",
    ),
    "a100-pcie-80gb": Performance(
        {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 1.935, 300.0, 2, 32.0, None, 252.9 / 312.0,
        "NVIDIA A100 Tensor Core GPU data sheet (PCIe 80 GB: BF16 312 TFLOPS, 1,935 GB/s, NVLink bridge 600 GB/s "
        f"between two cards, PCIe Gen4 64 GB/s); {_MAMF}: A100 PCIe 252.9 of 312 TFLOPS",
    ),
    "a100-pcie-40gb": Performance(
        {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 1.555, 300.0, 2, 32.0, None, 252.9 / 312.0,
        "NVIDIA A100 Tensor Core GPU data sheet (PCIe 40 GB: BF16 312 TFLOPS, 1,555 GB/s, NVLink bridge 600 GB/s "
        f"between two cards, PCIe Gen4 64 GB/s); {_MAMF}: A100 PCIe 252.9 of 312 TFLOPS",
    ),
    "l40s": Performance(
        {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp8": 733.0, "fp32": 91.6}, 0.864, None, 1, 32.0, None,
        None,
        "NVIDIA L40S data sheet (BF16 733 TFLOPS with sparsity, 864 GB/s, PCIe Gen4 x16 64 GB/s, no NVLink)",
    ),
    "l4": Performance(
        {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp8": 242.5, "fp32": 30.3}, 0.3, None, 1, 32.0, None, None,
        "NVIDIA L4 Tensor Core GPU data sheet (BF16 242 TFLOPS with sparsity, 300 GB/s, PCIe Gen4 x16, no NVLink)",
    ),
    "rtx-4090": Performance(
        {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp8": 330.3, "fp32": 82.6}, 1.008, None, 1, 32.0, None, None,
        "NVIDIA Ada Lovelace architecture white paper (RTX 4090: BF16 and FP16 with FP32 accumulate 165.2 TFLOPS "
        "dense, FP32 82.6, 1,008 GB/s GDDR6X, PCIe Gen4 x16, no NVLink)",
    ),
    "rtx-3090": Performance(
        {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}, 0.936, 56.25, 2, 32.0, None, None,
        "NVIDIA Ampere GA102 GPU architecture white paper (RTX 3090: BF16 and FP16 with FP32 accumulate 71 TFLOPS "
        "dense, FP32 35.6, 936 GB/s, NVLink bridge 112.5 GB/s between two cards, PCIe Gen4 x16)",
    ),
    "t4": Performance(
        {"fp16": 65.0, "fp32": 8.1}, 0.32, None, 1, 16.0, None, None,
        "NVIDIA T4 data sheet (mixed-precision FP16/FP32 65 TFLOPS, FP32 8.1, 320 GB/s, PCIe Gen3 x16; no BF16 "
        "tensor cores)",
    ),
    "v100-16gb": Performance(
        {"fp16": 125.0, "fp32": 15.7}, 0.9, 150.0, 8, 16.0, 50.0, None,
        "NVIDIA Tesla V100 data sheet (SXM2: tensor 125 TFLOPS, FP32 15.7, HBM2 900 GB/s, NVLink 300 GB/s); DGX-1 "
        "with V100 data sheet (4 x 100 Gb/s InfiniBand for 8 GPUs); no BF16 tensor cores",
    ),
    "v100-32gb": Performance(
        {"fp16": 125.0, "fp32": 15.7}, 0.9, 150.0, 8, 16.0, 50.0, None,
        "NVIDIA Tesla V100 data sheet (SXM2: tensor 125 TFLOPS, FP32 15.7, HBM2 900 GB/s, NVLink 300 GB/s); DGX-1 "
        "with V100 data sheet (4 x 100 Gb/s InfiniBand for 8 GPUs); no BF16 tensor cores",
    ),
    "v100-pcie-16gb": Performance(
        {"fp16": 112.0, "fp32": 14.0}, 0.9, None, 1, 16.0, None, None,
        "NVIDIA Tesla V100 data sheet (PCIe: tensor 112 TFLOPS, FP32 14, HBM2 900 GB/s, PCIe Gen3 32 GB/s); no BF16 "
        "tensor cores",
    ),
    "v100-pcie-32gb": Performance(
        {"fp16": 112.0, "fp32": 14.0}, 0.9, None, 1, 16.0, None, None,
        "NVIDIA Tesla V100 data sheet (PCIe: tensor 112 TFLOPS, FP32 14, HBM2 900 GB/s, PCIe Gen3 32 GB/s); no BF16 "
        "tensor cores",
    ),
    "b200": Performance(
        {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0, "fp8": 4500.0, "fp32": 75.0}, 8.0, 900.0, 8, 64.0, 400.0,
        None,
        "NVIDIA HGX B200 specifications (8 GPUs: FP16/BF16 36 PFLOPS, TF32 18, FP8 72 with sparsity, FP32 600 "
        "TFLOPS); DGX B200 data sheet (64 TB/s HBM3e over 8 GPUs, NVLink 5 1.8 TB/s per GPU, a 400 Gb/s ConnectX-7 "
        "per GPU)",
    ),
}
# The A10G is AWS's card: NVIDIA publishes no data sheet of its peaks, so it has none here (a prediction for it says
# which figure is missing and takes --peak-tflops).


@dataclass(frozen=True)
class Card:
    """One card as its driver reports it.

    Attributes:
        short_name: what ``--gpu`` takes ("h100", "a100-80gb").
        nvml_name: the name NVML and ``torch.cuda.get_device_name`` report: what ``/suggest`` matches.
        memory_bytes: total memory as NVML (``nvidia-smi --query-gpu=memory.total``) reports it.
        cuda_total_bytes: ``cudaDeviceProp.totalGlobalMem`` (torch's ``total_memory``): a few hundred
            MiB below NVML's, the driver's reservation, and it moves a little between drivers; the
            figure of one public listing, to the MiB, or None where none is known.
        compute_capability: (major, minor).
        sm_count: streaming multiprocessors.
        l2_cache_bytes: L2 cache.
        memory_bus_width_bits: the memory interface.
        source: where the card's figures come from, in a line.
        assumed: what of the entry has no source and is assumed, in a line (None: every figure has one).
        assumed_from: for a card the catalog lacks (:func:`unlisted_card`), the catalog card whose
            architecture, SMs, L2 and bus it takes; None for the catalog's own cards.
        performance: what a step's predicted time needs of the card (:class:`Performance`: dense peaks,
            bandwidths); None where the card is not one whose figures are known (a name the catalog lacks).
    """

    short_name: str
    nvml_name: str
    memory_bytes: int
    cuda_total_bytes: int | None
    compute_capability: tuple[int, int]
    sm_count: int
    l2_cache_bytes: int
    memory_bus_width_bits: int
    source: str
    assumed: str | None = None
    assumed_from: str | None = None
    performance: Performance | None = None

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES[self.compute_capability]

    @property
    def capability(self) -> str:
        """``"9.0"``: the compute capability as profiles write it."""
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    @property
    def device_total_bytes(self) -> int:
        """What ``torch.cuda.get_device_properties(...).total_memory`` reads on this card: the CUDA
        figure where one is known, else NVML's (a bound from above, by the driver's reservation)."""
        return self.cuda_total_bytes if self.cuda_total_bytes is not None else self.memory_bytes

    @property
    def resident_threads(self) -> int:
        """The threads the card can hold at once (SMs x threads per SM)."""
        return self.sm_count * self.architecture.max_threads_per_sm


_NVSMI = "NVML {} MiB from public nvidia-smi listings"

# Fields in order: short name, NVML name, NVML memory, totalGlobalMem, capability, SMs, L2, bus width, source.
# The cards of the first catalog first (the order `autotune gpus` lists and errors name them in), then the rest.
CARDS: tuple[Card, ...] = (
    Card(
        "h100", "NVIDIA H100 80GB HBM3", 81559 * MiB, 81089 * MiB, (9, 0), 132, 50 * MiB, 5120,
        "NVIDIA H100 Tensor Core GPU data sheet and architecture white paper (SXM5: 132 SMs, 50 MB L2, "
        "5120-bit HBM3); NVML 81559 MiB and total_memory 81089 MiB from public listings (torch 2.7, CUDA 12.8)",
    ),
    Card(
        "h100-pcie", "NVIDIA H100 PCIe", 81559 * MiB, 81008 * MiB, (9, 0), 114, 50 * MiB, 5120,
        "NVIDIA H100 Tensor Core GPU data sheet and architecture white paper (PCIe: 114 SMs, 50 MB L2, "
        "5120-bit HBM2e); NVML 81559 MiB and total_memory 81008 MiB from public listings",
    ),
    Card(
        "h200", "NVIDIA H200", 143771 * MiB, 143156 * MiB, (9, 0), 132, 60 * MiB, 6144,
        "NVIDIA H200 Tensor Core GPU data sheet (141 GB HBM3e, 6144-bit, 132 SMs); NVML 143771 MiB "
        "measured here (gpu-runs 2026-11-30); total_memory 143156 MiB and L2 60 MB from a public listing",
    ),
    Card(
        "a100-80gb", "NVIDIA A100-SXM4-80GB", 81920 * MiB, None, (8, 0), 108, 40 * MiB, 5120,
        "NVIDIA A100 Tensor Core GPU data sheet and architecture white paper (108 SMs, 40 MB L2, "
        "5120-bit HBM2e); NVML 81920 MiB from public listings; total_memory not known",
    ),
    Card(
        "a100-40gb", "NVIDIA A100-SXM4-40GB", 40960 * MiB, 40536 * MiB, (8, 0), 108, 40 * MiB, 5120,
        "NVIDIA A100 Tensor Core GPU data sheet and architecture white paper (108 SMs, 40 MB L2, "
        "5120-bit HBM2); NVML 40960 MiB and total_memory 40536 MiB from public listings",
    ),
    Card(
        "l40s", "NVIDIA L40S", 46068 * MiB, 45589 * MiB, (8, 9), 142, 96 * MiB, 384,
        "NVIDIA L40S data sheet and Ada Lovelace architecture white paper (142 SMs, 96 MB L2, 384-bit "
        "GDDR6); NVML 46068 MiB and total_memory 45589 MiB from public listings",
    ),
    Card(
        "l4", "NVIDIA L4", 23034 * MiB, None, (8, 9), 58, 48 * MiB, 192,
        "NVIDIA L4 Tensor Core GPU data sheet and Ada Lovelace architecture white paper (58 SMs, 48 MB L2, "
        "192-bit GDDR6); NVML 23034 MiB from public listings; total_memory not known",
    ),
    Card(
        "a10g", "NVIDIA A10G", 23028 * MiB, 22587 * MiB, (8, 6), 80, 6 * MiB, 384,
        "AWS EC2 G5 (A10G, GA102: 80 SMs, 6 MB L2, 384-bit GDDR6) and the NVIDIA Ampere GA102 white paper; "
        "NVML 23028 MiB and total_memory 22587 MiB from public listings",
    ),
    Card(
        "rtx-4090", "NVIDIA GeForce RTX 4090", 24564 * MiB, 24563 * MiB, (8, 9), 128, 72 * MiB, 384,
        "NVIDIA Ada Lovelace architecture white paper (RTX 4090: 128 SMs, 72 MB L2, 384-bit GDDR6X); "
        "NVML 24564 MiB and total_memory 24563 MiB from public listings",
    ),
    Card(
        "t4", "Tesla T4", 15360 * MiB, 15109 * MiB, (7, 5), 40, 4 * MiB, 256,
        "NVIDIA T4 data sheet and Turing architecture white paper (40 SMs, 4 MB L2, 256-bit GDDR6); "
        "NVML 15360 MiB and total_memory 15109 MiB from public listings",
    ),
    Card(
        "h100-nvl", "NVIDIA H100 NVL", 95830 * MiB, None, (9, 0), 132, 50 * MiB, 6144,
        "NVIDIA H100 Tensor Core GPU data sheet (H100 NVL: 94 GB HBM3, 3.9 TB/s) and architecture white paper "
        "(GH100, 50 MB L2); " + _NVSMI.format(95830),
        assumed="132 SMs and the 6144-bit bus (six HBM3 stacks, 94 of 96 GB enabled) from public listings, "
        "not the data sheet",
    ),
    Card(
        "h100-96gb", "NVIDIA H100 96GB", 97871 * MiB, None, (9, 0), 132, 50 * MiB, 6144,
        "the H100 of Meta's Grand Teton hosts that torchtitan's benchmarks ran on (torchtitan docs/performance.md: "
        "96 GB HBM2e, 2.4 TB/s, 500 W); no NVIDIA H100 data sheet lists 96 GB: the one that does is the "
        "NVIDIA GH200 Grace Hopper Superchip data sheet (96 GB HBM3), whose NVML figure this entry takes",
        assumed="the NVML name and memory: the memory is the GH200 96 GB's 97871 MiB (the same six 16 GB stacks), "
        "the name a placeholder no card is known to report; SMs, L2 and bus as the H100 SXM5 with six stacks",
    ),
    Card(
        "gh200", "NVIDIA GH200 480GB", 97871 * MiB, None, (9, 0), 132, 60 * MiB, 6144,
        "NVIDIA GH200 Grace Hopper Superchip data sheet (96 GB HBM3 with 480 GB LPDDR5X; 132 SMs); "
        + _NVSMI.format(97871) + " (the HBM only: the Grace memory is the host's)",
        assumed="L2 60 MB as the H200's public listing (the GH100 die's full L2)",
    ),
    Card(
        "b200", "NVIDIA B200", 183359 * MiB, None, (10, 0), 148, 126 * MiB, 8192,
        "NVIDIA DGX B200 data sheet (1,440 GB HBM3e over 8 GPUs: 180 GB each, 8 TB/s) and the Blackwell "
        "architecture technical brief; " + _NVSMI.format(183359),
        assumed="148 SMs, 126 MB L2 and the 8192-bit bus from public listings of torch's device properties, "
        "not the data sheet",
    ),    Card(
        "a100-pcie-80gb", "NVIDIA A100 80GB PCIe", 81920 * MiB, None, (8, 0), 108, 40 * MiB, 5120,
        "NVIDIA A100 Tensor Core GPU data sheet and architecture white paper (PCIe 80 GB: 108 SMs, 40 MB L2, "
        "5120-bit HBM2e); " + _NVSMI.format(81920),
    ),
    Card(
        "a100-pcie-40gb", "NVIDIA A100-PCIE-40GB", 40960 * MiB, None, (8, 0), 108, 40 * MiB, 5120,
        "NVIDIA A100 Tensor Core GPU data sheet and architecture white paper (PCIe 40 GB: 108 SMs, 40 MB L2, "
        "5120-bit HBM2); " + _NVSMI.format(40960),
    ),
    Card(
        "rtx-3090", "NVIDIA GeForce RTX 3090", 24576 * MiB, None, (8, 6), 82, 6 * MiB, 384,
        "NVIDIA Ampere GA102 GPU architecture white paper (GeForce RTX 3090: 82 SMs, 6 MB L2, 384-bit GDDR6X); "
        + _NVSMI.format(24576),
    ),
    # Volta: NVIDIA Tesla V100 GPU Accelerator data sheet (SXM2 and PCIe: 16 or 32 GB HBM2, 80 SMs), Volta
    # architecture white paper (6 MB L2, 4096-bit HBM2).
    Card(
        "v100-16gb", "Tesla V100-SXM2-16GB", 16384 * MiB, None, (7, 0), 80, 6 * MiB, 4096,
        "NVIDIA Tesla V100 data sheet and Volta architecture white paper (SXM2 16 GB: 80 SMs, 6 MB L2, 4096-bit "
        "HBM2); " + _NVSMI.format(16384) + " (drivers 570-580; older drivers list 16160 MiB)",
    ),
    Card(
        "v100-32gb", "Tesla V100-SXM2-32GB", 32768 * MiB, None, (7, 0), 80, 6 * MiB, 4096,
        "NVIDIA Tesla V100 data sheet and Volta architecture white paper (SXM2 32 GB: 80 SMs, 6 MB L2, 4096-bit "
        "HBM2); " + _NVSMI.format(32768) + " (drivers 570-580; older drivers list 32510 MiB)",
    ),
    Card(
        "v100-pcie-16gb", "Tesla V100-PCIE-16GB", 16384 * MiB, None, (7, 0), 80, 6 * MiB, 4096,
        "NVIDIA Tesla V100 data sheet and Volta architecture white paper (PCIe 16 GB: 80 SMs, 6 MB L2, 4096-bit "
        "HBM2); " + _NVSMI.format(16384) + " (drivers 575-580)",
    ),
    Card(
        "v100-pcie-32gb", "Tesla V100-PCIE-32GB", 32768 * MiB, None, (7, 0), 80, 6 * MiB, 4096,
        "NVIDIA Tesla V100 data sheet and Volta architecture white paper (PCIe 32 GB: 80 SMs, 6 MB L2, 4096-bit "
        "HBM2); " + _NVSMI.format(32768) + " (drivers 575-580; older drivers list 32510 MiB)",
    ),
)

CARDS = tuple(dataclasses.replace(card, performance=PERFORMANCE.get(card.short_name)) for card in CARDS)

# Other names people write for a catalog card (lower case, spaces as in _normalise).
ALIASES: dict[str, str] = {
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "h100-sxm-80gb": "h100",
    "h100-96gb-hbm2e": "h100-96gb",
    "a100-sxm-80gb": "a100-80gb",
    "a100-sxm-40gb": "a100-40gb",
    "v100-sxm2-16gb": "v100-16gb",
    "v100-sxm2-32gb": "v100-32gb",
    "4090": "rtx-4090",
    "3090": "rtx-3090",
    "geforce rtx 4090": "rtx-4090",
    "geforce rtx 3090": "rtx-3090",
    "grace hopper": "gh200",
}


@dataclass(frozen=True)
class OutsideAllocator:
    """Device memory a process holds outside the caching allocator (the CUDA context, loaded modules,
    library handles), on one card with one torch and one CUDA version.

    Attributes:
        bytes: the figure an estimate adds to the allocator's reserved bytes.
        low_bytes, high_bytes: the range seen where it was measured (both ``bytes`` where one figure is known).
        measured: whether this project measured it on the card (False: taken from elsewhere, see source).
        source: where it comes from, in a line.
    """

    bytes: int
    low_bytes: int
    high_bytes: int
    measured: bool
    source: str


# (short name, torch major.minor, CUDA major.minor) -> what is known. Every other combination is not.
OUTSIDE_ALLOCATOR: dict[tuple[str, str, str], OutsideAllocator] = {
    ("h200", "2.11", "13.0"): OutsideAllocator(
        bytes=876 * MiB,
        low_bytes=742 * MiB,
        high_bytes=877 * MiB,
        measured=True,
        source="H200, torch 2.11.0+cu130, 2026-11-30 (../shared/gpu-runs): 742 MiB in a fresh process (m = 1), "
        "growing as larger shapes load more kernel modules, and 875-877 MiB at every trial from m = 1195 on "
        "(the card's figure less the allocator model's reserved bytes, at 9 sizes); an estimate decides at "
        "its boundary, so it adds the figure there",
    ),
}
# The one card the memory outside the allocator was measured on: every other card's stand-in.
_MEASURED_OUTSIDE = ("h200", "2.11", "13.0")


def _normalise(name: str) -> str:
    return " ".join(name.strip().lower().split())


_BY_NAME: dict[str, Card] = {}
for _card in CARDS:
    _BY_NAME[_normalise(_card.short_name)] = _card
    _BY_NAME[_normalise(_card.nvml_name)] = _card
for _alias, _short in ALIASES.items():
    _BY_NAME[_normalise(_alias)] = _BY_NAME[_short]


def known_names() -> list[str]:
    """The short names, in catalog order."""
    return [card.short_name for card in CARDS]


def lookup(name: str) -> Card:
    """The card called name: a short name (``h100``), an alias (``h100-sxm``) or the name NVML reports
    (``NVIDIA H100 80GB HBM3``), in any case.

    Raises:
        ValueError: an unknown name, in one line that lists the known short names.

    >>> lookup("A100-80GB").nvml_name
    'NVIDIA A100-SXM4-80GB'
    >>> lookup("H100-SXM").short_name
    'h100'
    >>> lookup("p100")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown card 'p100': known cards are h100, h100-pcie, h200, ..., v100-pcie-32gb
    """
    card = _BY_NAME.get(_normalise(name))
    if card is None:
        raise ValueError(f"unknown card {name!r}: known cards are {', '.join(known_names())}")
    return card


def _major_minor(version: str) -> str:
    """``"2.11.0+cu130"`` -> ``"2.11"``; ``"13.0"`` -> ``"13.0"``."""
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def outside_allocator(card: Card | str, torch_version: str, cuda_version: str) -> OutsideAllocator | None:
    """What is known of the memory outside the caching allocator for card with this torch and CUDA
    (matched on major.minor), or None where nothing is.

    >>> outside_allocator("h200", "2.11.0+cu130", "13.0").bytes // 2**20
    876
    >>> outside_allocator("h100", "2.13.0", "13.0") is None
    True
    """
    short = lookup(card).short_name if isinstance(card, str) else card.short_name
    return OUTSIDE_ALLOCATOR.get((short, _major_minor(torch_version), _major_minor(cuda_version)))


def outside_allocator_stand_in(card: Card) -> OutsideAllocator:
    """The figure outside the allocator an estimate assumes for a card nothing was measured on: the H200's,
    said to be a stand-in, with what differs on this card.

    What the figure holds: the CUDA context (the driver's own allocations, among them the local memory it
    keeps for every thread the card can hold at once, which grows with SMs x threads per SM), the kernel
    modules torch loads lazily as shapes need them (SASS for this architecture: sizes differ per compute
    capability) and cuBLAS's and cuDNN's handles. None of it is published per card, and only the H200 was
    measured here, so the H200's figure stands in; the source line names the card's resident threads
    against the H200's, the part known to scale with the card.

    >>> stand_in = outside_allocator_stand_in(lookup("v100-16gb"))
    >>> stand_in.bytes // 2**20, stand_in.measured
    (876, False)
    >>> "163840 resident threads against the H200's 270336" in stand_in.source
    True
    >>> "against" in outside_allocator_stand_in(lookup("h100")).source  # the H200's capability and threads
    False
    """
    measured = OUTSIDE_ALLOCATOR[_MEASURED_OUTSIDE]
    h200 = lookup(_MEASURED_OUTSIDE[0])
    if card.short_name == h200.short_name:
        return measured
    # What differs from the H200, said only where it does (an H100 has the H200's capability and threads).
    differ = []
    if card.capability != h200.capability:
        differ.append(f"compute capability {card.capability} against the H200's {h200.capability}")
    if card.resident_threads != h200.resident_threads:
        differ.append(
            f"{card.resident_threads} resident threads against the H200's {h200.resident_threads}, each with the "
            "driver's per-thread local memory"
        )
    why = (
        f"the context and the modules differ per card ({', and '.join(differ)})"
        if differ
        else f"its compute capability ({card.capability}) and resident threads ({card.resident_threads}) are the "
        "H200's, so the context should be close, but its modules and driver are not measured"
    )
    return OutsideAllocator(
        bytes=measured.bytes,
        low_bytes=measured.low_bytes,
        high_bytes=measured.high_bytes,
        measured=False,
        source=(
            f"assumed: the H200's figure (torch {_MEASURED_OUTSIDE[1]}, CUDA {_MEASURED_OUTSIDE[2]}), not measured "
            f"on a {card.short_name}: {why}"
        ),
    )


# The words in a card's name that say its family, and the family's name (the catalog's short names start with it).
_FAMILY_WORDS: dict[str, tuple[str, ...]] = {
    "v100": ("v100", "v100s"),
    "t4": ("t4",),
    "a100": ("a100", "a800"),
    "a10g": ("a10g", "a10"),
    "rtx-3090": ("3090", "3090 ti"),
    "l4": ("l4",),
    "l40s": ("l40s", "l40"),
    "rtx-4090": ("4090", "4090 d"),
    "h100": ("h100", "h800"),
    "gh200": ("gh200",),
    "h200": ("h200",),
    "b200": ("b200",),
}


def _family(name: str) -> str | None:
    """The catalog family a card's name belongs to (``"NVIDIA H100 96GB"`` -> ``"h100"``), or None."""
    text = _normalise(name)
    for family, words in _FAMILY_WORDS.items():
        if any(re.search(rf"(?<![0-9a-z]){re.escape(word)}(?![0-9a-z])", text) for word in words):
            return family
    return None


def _family_of(card: Card) -> str:
    return max((family for family in _FAMILY_WORDS if card.short_name.startswith(family)), key=len)


def closest_card(name: str, memory_bytes: int) -> Card:
    """The catalog card whose semantics a card called name with memory_bytes takes: among the cards of the
    family its name names (``H100 96GB`` -> the H100s), of the form its name says (PCIe or not: the SMs
    differ), the one whose memory is nearest.

    Raises:
        ValueError: a name of no family the catalog knows, in one line naming the families.

    >>> closest_card("NVIDIA A100 80GB PCIe (MIG 3g.40gb)", 40 * 2**30).short_name
    'a100-pcie-40gb'
    >>> closest_card("Tesla V100S-PCIE-32GB", 32 * 2**30).short_name
    'v100-pcie-32gb'
    """
    family = _family(name)
    if family is None:
        raise ValueError(
            f"card {name!r}: no catalog family in its name, so no architecture to assume (families: "
            f"{', '.join(_FAMILY_WORDS)}); name one of them in it, e.g. 'H100 96GB'"
        )
    pcie = "pcie" in _normalise(name)
    members = [card for card in CARDS if _family_of(card) == family]
    return min(
        members,
        key=lambda card: (("pcie" in card.short_name) != pcie, abs(card.memory_bytes - memory_bytes)),
    )


def _closest_within_architecture(name: str, memory_bytes: int) -> Card:
    """:func:`closest_card`, where a device of its architecture can have memory_bytes (ValueError otherwise)."""
    like = closest_card(name, memory_bytes)
    architecture = like.architecture
    most, least = architecture.max_memory_bytes, architecture.min_memory_bytes
    if most and memory_bytes > most:
        raise ValueError(
            f"card {name!r} with {format_bytes(memory_bytes)}: no card of its architecture (compute capability "
            f"{like.capability}, like the {like.short_name}) ships more than {most // 2**30} GiB"
        )
    if memory_bytes < least:
        raise ValueError(
            f"card {name!r} with {format_bytes(memory_bytes)}: no device of its architecture (compute capability "
            f"{like.capability}, like the {like.short_name}) has less than {least // 2**30} GiB (the smallest: "
            f"{architecture.min_memory_device})"
        )
    return like


def unlisted_card(name: str, memory_bytes: int) -> Card:
    """A card the catalog lacks, by its name and memory (``--gpu NAME --gpu-memory 96GiB``): the memory as
    given, read as NVML's total and as CUDA's ``total_memory``; compute capability, SMs, L2 and bus from
    :func:`closest_card`, recorded in ``assumed_from`` and ``assumed`` so a datasheet can say which
    architecture was assumed.

    Raises:
        ValueError: memory_bytes not positive, more or less than any device of the architecture presents, or a
            name of no family the catalog knows.

    >>> card = unlisted_card("RTX 4090 D", 24 * 2**30)
    >>> card.short_name, card.compute_capability, card.memory_bytes // 2**20, card.assumed_from
    ('rtx-4090-d', (8, 9), 24576, 'rtx-4090')
    """
    if memory_bytes <= 0:
        raise ValueError(f"card {name!r}: memory must be positive, got {memory_bytes} bytes")
    like = _closest_within_architecture(name, memory_bytes)
    short = re.sub(r"[^0-9a-z]+", "-", _normalise(name).removeprefix("nvidia ")).strip("-")
    if short in _BY_NAME:  # never the short name of a catalog card it is not
        short = f"{short}-{memory_bytes // MiB}mib"
    return dataclasses.replace(
        like,
        short_name=short,
        nvml_name=" ".join(name.split()),
        memory_bytes=memory_bytes,
        cuda_total_bytes=None,
        source=f"not in the catalog: the name and {memory_bytes // MiB} MiB as given",
        assumed=(
            f"the architecture of the catalog's {like.short_name} ({like.nvml_name}: compute capability "
            f"{like.capability}, {like.sm_count} SMs, L2 and bus); the memory given is read as NVML's and CUDA's total"
        ),
        assumed_from=like.short_name,
        # A card of another name is another chip as far as anyone has published: its peaks are not the like's.
        performance=None,
    )


def resolve_card(name: str, memory_bytes: int | None = None) -> Card:
    """The card ``--gpu NAME [--gpu-memory BYTES]`` names: the catalog's card without a memory; with one, the
    catalog's card where the memory is its own, else the card described by name and memory
    (:func:`unlisted_card`: a 96 GB H100 is not the 80 GB one).

    Raises:
        ValueError: an unknown name without a memory (one line listing the known cards), or what
            :func:`unlisted_card` raises.

    >>> resolve_card("h100").short_name
    'h100'
    >>> card = resolve_card("h100", 64 * 2**30)
    >>> card.nvml_name, card.short_name, card.assumed_from
    ('NVIDIA H100 80GB HBM3 with 64 GiB', 'h100-80gb-hbm3-with-64-gib', 'h100')
    >>> card.performance == lookup("h100").performance  # the same chip with other memory: its peaks stand
    True
    >>> resolve_card("RTX 4090 D", 24 * 2**30).performance is None  # another chip: none are known
    True
    >>> resolve_card("NVIDIA H100 NVL", 95830 * 2**20).short_name
    'h100-nvl'
    """
    if memory_bytes is None:
        return lookup(name)
    known = _BY_NAME.get(_normalise(name))
    if known is not None and memory_bytes in (known.memory_bytes, known.cuda_total_bytes):
        return known
    if known is None:
        return unlisted_card(name, memory_bytes)
    # The catalog's name with another memory: a card of that name the catalog does not describe, the same chip (its
    # peaks and bandwidths are the catalog card's).
    _closest_within_architecture(name, memory_bytes)  # refused under the name given, before one is made up
    other = unlisted_card(f"{known.nvml_name} with {memory_bytes / 2**30:g} GiB", memory_bytes)
    return dataclasses.replace(other, performance=known.performance)
