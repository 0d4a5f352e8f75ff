"""What an emulated card's figure does not model, bounded from above: ``--estimate-bound safe``.

An estimate below the card's figure is an OOM at launch; one above it costs a little throughput. Where a part
of a real process's memory is not modelled, the safe estimate adds a stated upper bound for it instead of
zero (the tight estimate adds nothing), and the datasheet names each part and its bytes. Torch-free.

The part bounded here is **NCCL's own buffers**: a job of more than one rank on a card talks through NCCL
communicators, whose buffers NCCL allocates itself (cudaMalloc or cuMem, outside PyTorch's caching allocator
and outside the CUDA context the catalog measures). Per communicator, from NCCL's source (``src/init.cc``
``computeBuffSizes``, ``src/include/device.h``, ``src/transport/nvls.cc``):

- each channel's connections hold a FIFO per protocol: LL (8 lines x 512 threads x 8 steps x 16 bytes =
  512 KiB), LL128 (120 elements x 640 threads x 8 steps x 8 bytes = 4,915,200 bytes) and Simple
  (``NCCL_BUFFSIZE``, 4 MiB); ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE`` and ``NCCL_BUFFSIZE`` override them;
- at most ``MAXCHANNELS`` = 64 channels (``NCCL_MAX_NCHANNELS`` caps them), each with two connections that
  hold buffers on this rank (a ring's, and a tree's or a peer's): 64 x 2 x 9,633,792 bytes = 1.15 GiB;
- NVLink SHARP on cards behind an NVSwitch (compute capability 9.0 and up, SXM: not PCIe, not the NVL pairs),
  unless ``NCCL_NVLS_ENABLE=0``: channels (16 on 9.x, 32 from 10.0) x 2 x ``NCCL_NVLS_CHUNKSIZE`` (128 KiB) x 8
  steps x the heads (the communicator's ranks on one node, at most 8), counted twice (the unicast buffer and
  the multicast one): 512 MiB on eight H100s.

A pipeline's stages send and receive between neighbours over a communicator per pair of ranks (torch's
``ProcessGroupNCCL`` makes one for each send/receive pair): two of them per stage. Measured against it: NCCL
held 1.06 GB per rank on eight H100s after its collectives were set up (NVIDIA/nccl issue 1685) and 544-688 MB
per communicator on four A100s (issue 964), under the bound's 1.65 and 1.15 GiB. A communicator whose ranks
span nodes, an all-to-all (NCCL then connects up to 32 channels to every peer: 4.34 GB per rank on eight H100s,
issue 1685) and collnet are not bounded here.

    >>> from autotune.core.cards import lookup
    >>> from autotune.core.mesh import Mesh
    >>> bound = unmodelled_bound(lookup("h100"), 8, Mesh(), {})
    >>> [(part.name, part.bytes) for part in bound.parts], bound.bytes == 1_233_125_376 + 512 * 2**20
    ([('NCCL buffers', 1233125376), ('NCCL NVLS buffers', 536870912)], True)
    >>> unmodelled_bound(lookup("h100"), 1, Mesh(), {}).bytes
    0
    >>> unmodelled_bound(lookup("a100-80gb"), 2, Mesh(), {"NCCL_MAX_NCHANNELS": "8"}).bytes == 8 * 2 * 9_633_792
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autotune.core.cards import Card
from autotune.core.mesh import Mesh

__all__ = ["BOUNDS", "BoundPart", "UnmodelledBound", "unmodelled_bound"]

# --estimate-bound: "safe" adds the bound of each part the figure does not model; "tight" adds none.
BOUNDS = ("safe", "tight")

_MiB = 1 << 20
_NCCL_STEPS = 8
_LL_BYTES = 8 * 512 * _NCCL_STEPS * 16  # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x steps x line
_LL128_BYTES = 120 * 640 * _NCCL_STEPS * 8  # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x steps x 8
_SIMPLE_BYTES = 4 * _MiB  # DEFAULT_BUFFSIZE
_MAX_CHANNELS = 64  # MAXCHANNELS
_CONNECTIONS = 2  # connections per channel that hold buffers on this rank
_NVLS_CHUNK_BYTES = 128 * 1024  # NCCL_NVLS_CHUNKSIZE's default
_NVLS_MAX_HEADS = 8  # the ranks of one node


@dataclass(frozen=True)
class BoundPart:
    """One unmodelled part: its name, its bound in bytes, and how the bound is made."""

    name: str
    bytes: int
    why: str


@dataclass(frozen=True)
class UnmodelledBound:
    """The parts a safe estimate adds, with their sum."""

    parts: tuple[BoundPart, ...]

    @property
    def bytes(self) -> int:
        return sum(part.bytes for part in self.parts)


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "").strip()
    try:
        value = int(text, 0) if text else default
    except ValueError:
        return default  # NCCL ignores what it cannot parse, and keeps its default
    return value if value >= 0 else default


def _communicators(world_size: int, mesh: Mesh) -> tuple[list[int], int]:
    """The ranks of each collective communicator one rank joins (one per parallel dimension over more than one
    rank: data, tensor, context), and the pipeline's send/receive pairs (two per stage, one with each
    neighbour; one where there are only two stages)."""
    data = world_size // mesh.model_parallel if world_size % mesh.model_parallel == 0 else 1
    groups = [size for size in (data, mesh.tp, mesh.cp) if size > 1]
    pairs = 0 if mesh.pp == 1 else (1 if mesh.pp == 2 else 2)
    return groups, pairs


def _nvls_capable(card: Card) -> bool:
    """Behind an NVSwitch, where NCCL sets up NVLink SHARP: SXM cards from compute capability 9.0 on (a PCIe
    card, or the NVL pairs' bridges, have no switch)."""
    name = f"{card.short_name} {card.nvml_name}".lower()
    return card.compute_capability >= (9, 0) and "pcie" not in name and "nvl" not in card.short_name


def unmodelled_bound(card: Card, world_size: int, mesh: Mesh, env: Mapping[str, str]) -> UnmodelledBound:
    """The stated bound of what a job of world_size ranks in mesh holds on card outside what the estimate
    models (the module docstring), under the NCCL settings of env (the job's environment)."""
    groups, pairs = _communicators(world_size, mesh)
    communicators = len(groups) + pairs
    if communicators == 0:
        return UnmodelledBound(())
    per_connection = (
        _env_int(env, "NCCL_LL_BUFFSIZE", _LL_BYTES)
        + _env_int(env, "NCCL_LL128_BUFFSIZE", _LL128_BYTES)
        + _env_int(env, "NCCL_BUFFSIZE", _SIMPLE_BYTES)
    )
    channels = min(_MAX_CHANNELS, _env_int(env, "NCCL_MAX_NCHANNELS", _env_int(env, "NCCL_MAX_NRINGS", _MAX_CHANNELS)))
    buffers = communicators * channels * _CONNECTIONS * per_connection
    parts = [
        BoundPart(
            "NCCL buffers",
            buffers,
            f"{communicators} communicator(s) x {channels} channels x {_CONNECTIONS} connections x "
            f"{per_connection:,} bytes (LL, LL128 and Simple FIFOs)",
        )
    ]
    if _nvls_capable(card) and env.get("NCCL_NVLS_ENABLE", "").strip() != "0" and groups:
        nvls_channels = 16 if card.compute_capability < (10, 0) else 32
        chunk = _env_int(env, "NCCL_NVLS_CHUNKSIZE", _NVLS_CHUNK_BYTES)
        heads = [min(size, _NVLS_MAX_HEADS) for size in groups]
        nvls = sum(nvls_channels * 2 * chunk * _NCCL_STEPS * h * 2 for h in heads)
        parts.append(
            BoundPart(
                "NCCL NVLS buffers",
                nvls,
                f"NVLink SHARP on {len(heads)} communicator(s): {nvls_channels} channels x 2 x {chunk:,} bytes x "
                f"{_NCCL_STEPS} steps x heads {heads}, unicast and multicast (NCCL_NVLS_ENABLE=0 turns it off)",
            )
        )
    return UnmodelledBound(tuple(parts))
