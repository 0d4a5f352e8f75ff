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
``torch.cuda.get_device_properties`` output, not measured here; a figure with no source is None.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ARCHITECTURES",
    "CARDS",
    "OUTSIDE_ALLOCATOR",
    "Architecture",
    "Card",
    "OutsideAllocator",
    "known_names",
    "lookup",
    "outside_allocator",
]

MiB = 2**20


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


ARCHITECTURES = {
    arch.compute_capability: arch
    for arch in (
        Architecture((7, 5), 1024, 16, 64 * 1024, 64 * 1024, 0),
        Architecture((8, 0), 2048, 32, 164 * 1024, 163 * 1024, 1024),
        Architecture((8, 6), 1536, 16, 100 * 1024, 99 * 1024, 1024),
        Architecture((8, 9), 1536, 24, 100 * 1024, 99 * 1024, 1024),
        Architecture((9, 0), 2048, 32, 228 * 1024, 227 * 1024, 1024),
    )
}


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


# Fields in order: short name, NVML name, NVML memory, totalGlobalMem, capability, SMs, L2, bus width, source.
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
)


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


def _normalise(name: str) -> str:
    return " ".join(name.strip().lower().split())


_BY_NAME: dict[str, Card] = {}
for _card in CARDS:
    _BY_NAME[_normalise(_card.short_name)] = _card
    _BY_NAME[_normalise(_card.nvml_name)] = _card


def known_names() -> list[str]:
    """The short names, in catalog order."""
    return [card.short_name for card in CARDS]


def lookup(name: str) -> Card:
    """The card called name: a short name (``h100``) or the name NVML reports
    (``NVIDIA H100 80GB HBM3``), in any case.

    Raises:
        ValueError: an unknown name, in one line that lists the known short names.

    >>> lookup("A100-80GB").nvml_name
    'NVIDIA A100-SXM4-80GB'
    >>> lookup("v100")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown card 'v100': known cards are h100, h100-pcie, h200, a100-80gb, ..., t4
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
