"""PyTorch's CUDA caching allocator, as arithmetic: the peaks a trace of allocations would read on a card.

A trial's allocation trace (every request and free, in order) goes through the rules of
``c10/cuda/CUDACachingAllocator.cpp`` and gives what ``torch.cuda.max_memory_reserved()`` and
``max_memory_allocated()`` would read after it. Each rule below names the function of that file (or of
``c10/core/AllocatorConfig.{h,cpp}``, where recent torch keeps the options) that it follows. A hand-derived
case: 1000 bytes round to a 1024-byte block cut from a new 2 MiB small-pool segment; 3 MiB take a 20 MiB
large-pool segment (requests under 10 MiB do) and leave 17 MiB free beside them; the small block is freed
(its segment stays cached), and 12 MiB fit in the 17 MiB: 22 MiB reserved at most, 3 + 12 MiB allocated:

    >>> peaks = replay([(0, 1000), (1, 3 << 20), (0, FREE), (2, 12 << 20)])
    >>> peaks.peak_reserved_bytes == 22 << 20, peaks.peak_allocated_bytes == 15 << 20, peaks.segments
    (True, True, 2)

Modelled: block rounding (``round_size``, with ``roundup_power2_divisions`` in both its forms), the two
pools and their segment sizes (``get_pool``, ``get_allocation_size``), best fit by (size, address)
(``get_free_block``, with the ``max_split_size_mb`` and ``max_non_split_rounding_mb`` limits), splitting
(``should_split``) and merging on free (``free_block`` / ``try_merge_blocks``), new segments and what happens
when they do not fit under a limit (``alloc_block``, ``garbage_collect_cached_blocks``,
``release_available_cached_blocks``, ``release_cached_blocks``), ``empty_cache``, and
``expandable_segments:True`` (``find_expandable_block``, ``map_block``, ``unmap_block``). Requests of 0
bytes allocate nothing (``NativeCachingAllocator::allocate`` hands out nullptr).

Streams: a block belongs to the stream its segment was made for, and a free block serves only requests made
on that stream (``BlockComparatorSize`` orders blocks by stream first; ``get_free_block``,
``release_available_cached_blocks`` and ``find_expandable_block`` match it), so memory freed on one stream stays
reserved while another stream asks for more: FSDP2's all-gather and reduce-scatter streams hold pools of their
own beside the default stream's. A request names its stream (0, the default, unless the trace says otherwise).
Not modelled: one device only, ``record_stream``'s delayed frees (FSDP2 keeps references instead), cross-stream
events and CUDA-graph private pools; ``backend:cudaMallocAsync`` is another
allocator altogether. Where the real allocator's addresses would break a tie between equal sizes, the model
puts older segments first (cudaMalloc's addresses are not knowable in advance). Memory outside the
allocator (the CUDA context, cuBLAS workspaces) is the caller's to add. Torch-free, on the floor that the
server and the client may import.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

__all__ = [
    "FREE",
    "AllocatorConfig",
    "AllocatorOutOfMemory",
    "AllocatorPeaks",
    "CachingAllocator",
    "replay",
]

# An event (key, FREE) frees what key holds.
FREE = -1

_MiB = 1 << 20
# The constants at the top of CUDACachingAllocator.cpp (c10/core/AllocatorConfig.h in recent torch).
_MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of it
_SMALL_SIZE = 1 * _MiB  # kSmallSize: the largest request of the small pool
_SMALL_BUFFER = 2 * _MiB  # kSmallBuffer: the small pool's segments (and its expandable pages)
_MIN_LARGE_ALLOC = 10 * _MiB  # kMinLargeAlloc: large requests under it share a large-buffer segment
_ROUND_LARGE = 2 * _MiB  # kRoundLarge: larger requests get a segment of their own, rounded to it
_LARGE_BUFFER = 20 * _MiB  # kLargeBuffer: the large pool's shared segments (and its expandable pages)
_SIZE_MAX = 2**64 - 1  # max_split_size's "unlimited" (std::numeric_limits<size_t>::max())
_ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: one division count per power of two, 1 MiB .. 32 GiB+

_ENV = "PYTORCH_CUDA_ALLOC_CONF"

# Block states. A block is a run of addresses inside one segment; every address of a segment is in one block.
_ALLOCATED = 0
_FREE = 1
_UNMAPPED = 2  # expandable segments only: address space with no physical pages behind it

# Model addresses: bit 60 says the small pool, bit 61 an expandable segment, bits 52-59 the stream's index
# (0: the default stream); the low 52 bits are offsets. Segments never touch (a gap follows each), so "the
# block at my end address" is always my own segment's.
_SMALL_BIT = 1 << 60
_EXPANDABLE_BIT = 1 << 61
_STREAM_SHIFT = 52
_MAX_STREAMS = 256
_OFFSET_MASK = (1 << _STREAM_SHIFT) - 1
_ADDRESS_MASK = (1 << 64) - 1
_SEGMENT_GAP = _MIN_BLOCK
# The address space of an expandable segment when no card size is given (the source reserves 1 1/8 of the
# card's memory): large enough that it never runs out.
_UNLIMITED_CARD_BYTES = 1 << 46


@dataclass(frozen=True)
class AllocatorConfig:
    """The options of ``PYTORCH_CUDA_ALLOC_CONF`` that decide where memory goes (c10/core/AllocatorConfig.h).

    ``max_split_size_bytes``: blocks this large or larger are never split and never serve smaller requests
    (default: unlimited). ``max_non_split_rounding_bytes``: how much larger than an oversize request a cached
    oversize block may be and still serve it. ``roundup_power2_divisions``: 16 division counts, one per power
    of two from 1 MiB (the first also covers everything below, the last everything above); 0 or 1 rounds to
    512 bytes only. ``garbage_collection_threshold``: the share of the memory fraction past which cached
    blocks are freed before a new segment (only with a memory fraction). ``large_segment_size_bytes``: the
    large pool's shared segment and expandable page (kLargeBuffer, 20 MiB, unless a newer torch's
    ``large_segment_size_mb`` says otherwise).
    """

    max_split_size_bytes: int = _SIZE_MAX
    max_non_split_rounding_bytes: int = _LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * _ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    large_segment_size_bytes: int = _LARGE_BUFFER

    def __post_init__(self) -> None:
        divisions = self.roundup_power2_divisions
        if len(divisions) != _ROUNDUP_INTERVALS or any(d < 0 or d & (d - 1) for d in divisions):
            raise ValueError(
                f"roundup_power2_divisions: expected {_ROUNDUP_INTERVALS} counts, each 0 or a power of 2, "
                f"got {divisions!r}"
            )
        if self.large_segment_size_bytes <= _SMALL_SIZE:
            raise ValueError(f"large_segment_size: must exceed 1 MiB, got {self.large_segment_size_bytes} bytes")
        if self.max_split_size_bytes < max(_LARGE_BUFFER, self.large_segment_size_bytes):
            raise ValueError(
                f"max_split_size: must be at least 20 MiB and the large segment size, "
                f"got {self.max_split_size_bytes} bytes"
            )
        if self.max_non_split_rounding_bytes < _LARGE_BUFFER:
            raise ValueError(
                f"max_non_split_rounding: must be at least 20 MiB, got {self.max_non_split_rounding_bytes}"
            )
        if self.garbage_collection_threshold != 0.0 and not 0.0 < self.garbage_collection_threshold < 1.0:
            raise ValueError(
                f"garbage_collection_threshold: must be in (0, 1), got {self.garbage_collection_threshold}"
            )

    @classmethod
    def parse(cls, text: str | None) -> AllocatorConfig:
        """The config a ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) string sets.

        Tokens and checks follow ``AcceleratorAllocatorConfig::parseArgs`` and ``CUDAAllocatorConfig::parseArgs``:
        ``key:value`` pairs split by commas, list values in brackets, spaces ignored, later keys winning. Keys
        that change nothing this model counts (``release_lock_on_cudamalloc``, the pinned-memory options) are
        checked and ignored.

        Raises:
            ValueError: one line naming the key, for an unknown key, a malformed or out-of-range value, or
                ``backend:cudaMallocAsync`` (a different allocator, not modelled).

        >>> AllocatorConfig.parse("max_split_size_mb:128, expandable_segments:True").max_split_size_bytes >> 20
        128
        """
        return _parse_config(text or "")

    def divisions_for(self, size_bytes: int) -> int:
        """The division count for a block of size_bytes (``AllocatorConfig::roundup_power2_divisions(size)``)."""
        index = max(0, size_bytes.bit_length() - 1 - 20)  # log2(size) - log2(1 MiB), clamped to the table
        return self.roundup_power2_divisions[min(index, _ROUNDUP_INTERVALS - 1)]

    def round_size(self, nbytes: int) -> int:
        """The block size a request of nbytes gets (``round_size``, ``roundup_power2_next_division``)."""
        if nbytes < _MIN_BLOCK:
            return _MIN_BLOCK
        divisions = self.divisions_for(nbytes)
        if divisions > 1 and nbytes > _MIN_BLOCK * divisions:
            if nbytes & (nbytes - 1) == 0:
                return nbytes
            floor = 1 << (nbytes.bit_length() - 1)
            step = floor >> (divisions.bit_length() - 1)  # the power of two split into `divisions` equal steps
            if step == 0:
                return floor << 1
            return -(-nbytes // step) * step
        return -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK


def _tokenize(text: str) -> list[str]:
    """``ConfigTokenizer``: ',', ':', '[' and ']' are tokens of their own, whitespace is dropped."""
    tokens: list[str] = []
    word: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if word:
                tokens.append("".join(word))
                word = []
            tokens.append(ch)
        elif not ch.isspace():
            word.append(ch)
    if word:
        tokens.append("".join(word))
    return tokens


def _bad(key: str, why: str) -> ValueError:
    return ValueError(f"{_ENV}: {key}: {why}")


def _size_t(key: str, token: str) -> int:
    if not token.isdigit():
        raise _bad(key, f"expected a non-negative integer, got {token!r}")
    return int(token)


def _bool(key: str, token: str) -> bool:
    if token not in ("True", "False"):
        raise _bad(key, f"expected True or False, got {token!r}")
    return token == "True"


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _divisions(key: str, value: str | list[str]) -> tuple[int, ...]:
    """``parseRoundUpPower2Divisions``: one count for every interval, or ``[MiB:count,...,>:count]`` where
    MiB is a power of two naming the interval [MiB, 2 MiB), the first entry also fills the intervals below
    it and ``>`` fills those after the last one named."""
    if isinstance(value, str):
        count = _size_t(key, value)
        if not _power_of_two(count):
            raise _bad(key, f"the divisions must be a power of 2, got {count}")
        return (count,) * _ROUNDUP_INTERVALS
    table = [0] * _ROUNDUP_INTERVALS
    last_index = 0
    first = True
    pairs = [t for t in value if t != ","]
    if len(pairs) % 3 or any(pairs[i + 1] != ":" for i in range(0, len(pairs), 3)):
        raise _bad(key, f"expected [MiB:count,...], got [{''.join(value)}]")
    for i in range(0, len(pairs), 3):
        boundary, count = pairs[i], _size_t(key, pairs[i + 2])
        if count != 0 and not _power_of_two(count):
            raise _bad(key, f"the divisions must be 0 or a power of 2, got {count}")
        if boundary == ">":
            for j in range(last_index + 1, _ROUNDUP_INTERVALS):
                table[j] = count
            continue
        mib = _size_t(key, boundary)
        if not _power_of_two(mib):
            raise _bad(key, f"the intervals must be powers of 2 (MiB), got {mib}")
        index = min(mib.bit_length() - 1, _ROUNDUP_INTERVALS - 1)
        if first:
            table[:index] = [count] * index
            first = False
        table[index] = count
        last_index = index
    return tuple(table)


# Keys torch accepts that move no device memory in this model, with the kind of value each takes.
_IGNORED_BOOL_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_use_background_threads",
        "graph_capture_record_stream_reuse",
    }
)
_IGNORED_SIZE_KEYS = frozenset({"pinned_num_register_threads", "pinned_reserve_segment_size_mb"})


def _parse_config(text: str) -> AllocatorConfig:
    tokens = _tokenize(text)
    fields: dict[str, object] = {}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in ",:[]":
            raise ValueError(f"{_ENV}: expected a key, got {key!r} in {text!r}")
        if i + 1 >= len(tokens) or tokens[i + 1] != ":":
            raise _bad(key, "expected ':' and a value")
        i += 2
        if i >= len(tokens) or tokens[i] in ",:]":
            raise _bad(key, "expected a value")
        value: str | list[str]
        if tokens[i] == "[":
            try:
                close = tokens.index("]", i)
            except ValueError:
                raise _bad(key, "a list without its closing ']'") from None
            value = tokens[i + 1 : close]
            i = close + 1
        else:
            value = tokens[i]
            i += 1
        _set_option(key, value, fields)
        if i < len(tokens):
            if tokens[i] != ",":
                raise _bad(key, f"expected ',' after the value, got {tokens[i]!r}")
            i += 1
    try:
        return AllocatorConfig(**fields)  # type: ignore[arg-type]
    except ValueError as err:
        raise ValueError(f"{_ENV}: {err}") from None


def _set_option(key: str, value: str | list[str], fields: dict[str, object]) -> None:
    """One key of the config into the dataclass's fields (the checks of ``parseMaxSplitSize`` and its kin)."""
    if key == "roundup_power2_divisions":
        fields["roundup_power2_divisions"] = _divisions(key, value)
        return
    if isinstance(value, list):
        raise _bad(key, "takes a single value, not a list")
    if key == "max_split_size_mb":
        mib = _size_t(key, value)
        if mib < _LARGE_BUFFER // _MiB:
            raise _bad(key, f"too small, must be >= {_LARGE_BUFFER // _MiB}, got {mib}")
        fields["max_split_size_bytes"] = min(mib * _MiB, _SIZE_MAX)
    elif key == "max_non_split_rounding_mb":
        mib = _size_t(key, value)
        if mib < _LARGE_BUFFER // _MiB:
            raise _bad(key, f"too small, must be >= {_LARGE_BUFFER // _MiB}, got {mib}")
        fields["max_non_split_rounding_bytes"] = mib * _MiB
    elif key == "large_segment_size_mb":
        mib = _size_t(key, value)
        if mib < 2:
            raise _bad(key, f"must be at least 2 (a large segment holds more than 1 MiB), got {mib}")
        fields["large_segment_size_bytes"] = mib * _MiB
    elif key == "garbage_collection_threshold":
        try:
            share = float(value)
        except ValueError:
            raise _bad(key, f"expected a number, got {value!r}") from None
        if not 0.0 < share < 1.0:
            raise _bad(key, f"must be in (0.0, 1.0), got {value}")
        fields["garbage_collection_threshold"] = share
    elif key == "expandable_segments":
        fields["expandable_segments"] = _bool(key, value)
    elif key == "backend":
        if value == "cudaMallocAsync":
            raise _bad(key, "cudaMallocAsync is another allocator; this model follows the native one")
        if value != "native":
            raise _bad(key, f"expected native or cudaMallocAsync, got {value!r}")
    elif key in _IGNORED_BOOL_KEYS:
        _bool(key, value)
    elif key in _IGNORED_SIZE_KEYS:
        _size_t(key, value)
    else:
        raise ValueError(f"{_ENV}: unknown key {key!r}")


class AllocatorOutOfMemory(Exception):
    """No block fits, no segment fits under the limit, and releasing the cache did not help: where the
    real allocator raises ``torch.OutOfMemoryError``. ``requested_bytes`` is the request as made,
    ``allocation_bytes`` the segment it tried to get (``get_allocation_size``), and ``reserved_bytes`` and
    ``allocated_bytes`` the allocator's figures at that moment (after it released what it could)."""

    def __init__(self, requested_bytes: int, allocation_bytes: int, reserved_bytes: int, allocated_bytes: int) -> None:
        super().__init__(
            f"out of memory: tried to allocate {allocation_bytes} bytes (a request of {requested_bytes}) "
            f"with {reserved_bytes} reserved, of which {allocated_bytes} allocated"
        )
        self.requested_bytes = requested_bytes
        self.allocation_bytes = allocation_bytes
        self.reserved_bytes = reserved_bytes
        self.allocated_bytes = allocated_bytes


@dataclass(frozen=True)
class AllocatorPeaks:
    """What a replayed trace leaves: the peaks (``max_memory_reserved``, ``max_memory_allocated``, and the
    requested bytes before rounding), the figures at the end, the segments held at the end (cudaMalloc'd ones
    plus expandable ones with pages mapped), how many segments were made and freed (``num_device_alloc``,
    ``num_device_free``: cudaMalloc/cudaFree, or page maps/unmaps), and, where the trace ran out of memory,
    the index of the event that failed and its request (the replay stops there)."""

    peak_reserved_bytes: int
    peak_allocated_bytes: int
    peak_requested_bytes: int
    reserved_bytes: int
    allocated_bytes: int
    segments: int
    device_allocs: int
    device_frees: int
    oom: bool = False
    oom_event: int | None = None
    oom_request_bytes: int | None = None


class _Pool:
    """One of the two pools (``BlockPool``): its free blocks by (size, address), its unmapped ranges."""

    __slots__ = ("small", "free", "unmapped", "next_segment", "next_expandable", "page_bytes", "clock", "gc_base")

    def __init__(self, small: bool, page_bytes: int, stream: int = 0, clock: list[int] | None = None) -> None:
        self.small = small
        # Free (mapped) blocks as size << 64 | address: one int each, so bisect finds the smallest block
        # that fits, ties broken by address, as BlockComparatorSize orders the set.
        self.free: list[int] = []
        self.unmapped: list[int] = []  # unmapped block addresses, ordered (BlockComparatorAddress)
        base = (_SMALL_BIT if small else 0) | stream << _STREAM_SHIFT
        self.next_segment = base
        self.next_expandable = base | _EXPANDABLE_BIT
        self.page_bytes = page_bytes  # the expandable segment's page (find_expandable_block)
        # get_free_blocks_call_count: one count per BlockPool, which every stream's blocks of this kind share.
        self.clock = clock if clock is not None else [0]
        self.gc_base: dict[int, int] = {}  # address -> the count when the block went into `free`


class CachingAllocator:
    """One device's caching allocator (``DeviceCachingAllocator``), replaying requests and frees.

    Args:
        config: the options (``AllocatorConfig.parse`` reads them from the environment's string).
        limit_bytes: the card's memory the allocator can get (cudaMalloc fails past it); None for no limit.
        memory_fraction: as ``torch.cuda.set_per_process_memory_fraction``: the allocator may hold at most
            this share of limit_bytes, and ``garbage_collection_threshold`` applies only with it.

    ``malloc(key, nbytes)`` and ``free(key)`` name allocations by caller's keys; ``allocated_bytes`` counts
    blocks as torch's stats do (the block's size after rounding, or the whole block where it was not split).
    """

    def __init__(
        self,
        config: AllocatorConfig = AllocatorConfig(),
        limit_bytes: int | None = None,
        *,
        memory_fraction: float | None = None,
    ) -> None:
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        if memory_fraction is not None:
            if limit_bytes is None:
                raise ValueError("memory_fraction needs limit_bytes (the card's memory it is a share of)")
            if not 0.0 <= memory_fraction <= 1.0:
                raise ValueError(f"memory_fraction must be in [0, 1], got {memory_fraction}")
        self.config = config
        self.limit_bytes = limit_bytes
        # setMemoryFraction: allowed_memory_maximum, and set_fraction, which gates garbage collection.
        self._allowed: int | None = None
        if memory_fraction is not None and limit_bytes is not None:
            self._allowed = int(memory_fraction * limit_bytes)
        self._gc = self._allowed is not None and config.garbage_collection_threshold > 0.0
        self._expandable = config.expandable_segments
        self._max_split = config.max_split_size_bytes
        self._non_split_rounding = config.max_non_split_rounding_bytes
        self._plain_rounding = not any(d > 1 for d in config.roundup_power2_divisions)
        self._large = _Pool(False, config.large_segment_size_bytes)
        self._small = _Pool(True, _SMALL_BUFFER)
        # Each stream's pools (large, small), by the stream's index: the default stream's are the two above.
        self._pools: dict[int, tuple[_Pool, _Pool]] = {0: (self._large, self._small)}
        card = limit_bytes if limit_bytes else _UNLIMITED_CARD_BYTES
        self._card_bytes = card
        # Every block: start -> size, start -> state, end -> start (to find the block before a block).
        self._size: dict[int, int] = {}
        self._state: dict[int, int] = {}
        self._start_of_end: dict[int, int] = {}
        self._live: dict[int, tuple[int, int]] = {}  # key -> (block address or -1 for 0 bytes, requested bytes)
        self._expandable_segments: dict[int, int] = {}  # base address -> address-space bytes
        self._reserved = 0
        self._allocated = 0
        self._requested = 0
        self._peak_reserved = 0
        self._peak_allocated = 0
        self._peak_requested = 0
        self._segments = 0  # cudaMalloc'd segments held
        self.device_allocs = 0
        self.device_frees = 0
        self.alloc_retries = 0

    # --- the figures torch.cuda.memory_stats() reads -------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        """``memory_reserved()``: segments held (mapped pages, for expandable segments)."""
        return self._reserved

    @property
    def allocated_bytes(self) -> int:
        """``memory_allocated()``: the sizes of the blocks handed out."""
        return self._allocated

    @property
    def requested_bytes(self) -> int:
        """The bytes requested by live allocations, before rounding (``requested_bytes`` in the stats)."""
        return self._requested

    @property
    def peak_reserved_bytes(self) -> int:
        """``max_memory_reserved()`` since the start or the last ``reset_peaks``."""
        return self._peak_reserved

    @property
    def peak_allocated_bytes(self) -> int:
        """``max_memory_allocated()`` since the start or the last ``reset_peaks``."""
        return self._peak_allocated

    @property
    def peak_requested_bytes(self) -> int:
        """The peak of requested bytes since the start or the last ``reset_peaks``."""
        return self._peak_requested

    @property
    def segments(self) -> int:
        """Segments held: cudaMalloc'd ones, and expandable ones with pages mapped (one whose map failed
        keeps its address space, as in the source, but holds no memory)."""
        held = self._segments
        for base, space in self._expandable_segments.items():
            held += self._state[base] != _UNMAPPED or self._size[base] != space
        return held

    @property
    def cached_free_bytes(self) -> int:
        """Reserved but in no allocation, counted block by block over both pools' free blocks (slow: for
        checks; it equals ``reserved_bytes - allocated_bytes`` whenever the books are right)."""
        return sum(key >> 64 for pool in self._all_pools() for key in pool.free)

    def _all_pools(self) -> list[_Pool]:
        """Every stream's large pool, then every stream's small pool (``release_cached_blocks``' order)."""
        return [pools[0] for pools in self._pools.values()] + [pools[1] for pools in self._pools.values()]

    def _stream_pools(self, stream: int) -> tuple[_Pool, _Pool]:
        pools = self._pools.get(stream)
        if pools is None:
            if not 0 <= stream < _MAX_STREAMS:
                raise ValueError(f"stream index must be in [0, {_MAX_STREAMS}), got {stream}")
            large = _Pool(False, self.config.large_segment_size_bytes, stream, self._large.clock)
            pools = (large, _Pool(True, _SMALL_BUFFER, stream, self._small.clock))
            self._pools[stream] = pools
        return pools

    def reset_peaks(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()`` (``resetPeakStats``): peaks restart from the current figures."""
        self._peak_reserved = self._reserved
        self._peak_allocated = self._allocated
        self._peak_requested = self._requested

    def peaks(self) -> AllocatorPeaks:
        """The figures now, as a replay reports them."""
        return AllocatorPeaks(
            peak_reserved_bytes=self._peak_reserved,
            peak_allocated_bytes=self._peak_allocated,
            peak_requested_bytes=self._peak_requested,
            reserved_bytes=self._reserved,
            allocated_bytes=self._allocated,
            segments=self.segments,
            device_allocs=self.device_allocs,
            device_frees=self.device_frees,
        )

    # --- malloc ---------------------------------------------------------------------------------------------

    def malloc(self, key: int, nbytes: int, stream: int = 0) -> None:
        """Allocate nbytes under key (``DeviceCachingAllocator::malloc``), on the stream of that index.

        Raises:
            AllocatorOutOfMemory: nothing fits under the limit, even after releasing the cache.
            ValueError: key is live already, or nbytes is negative.
        """
        if key in self._live:
            raise ValueError(f"key {key} is allocated already")
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"nbytes must be >= 0, got {nbytes}")
            self._live[key] = (-1, 0)  # allocate(): size 0 gets nullptr, and its free is a no-op
            return
        if self._plain_rounding:
            size = -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK
        else:
            size = self.config.round_size(nbytes)
        # get_pool: the stream's own blocks (the comparator's first key)
        pools = self._pools[0] if stream == 0 else self._stream_pools(stream)
        pool = pools[1] if size <= _SMALL_SIZE else pools[0]
        addr = self._get_free_block(pool, size)
        if addr < 0:
            addr = self._new_block(pool, size, nbytes)
        # alloc_found_block
        block = self._size[addr]
        self._state[addr] = _ALLOCATED  # before the split, so the remainder does not merge back into it
        if self._should_split(pool, block, size):
            self._size[addr] = size
            self._start_of_end[addr + size] = addr
            self._place_free(pool, addr + size, block - size)
            block = size
        self._live[key] = (addr, nbytes)
        self._allocated += block
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        self._requested += nbytes
        if self._requested > self._peak_requested:
            self._peak_requested = self._requested

    def _allocation_size(self, size: int) -> int:
        """``get_allocation_size``: the segment a request of size bytes asks cudaMalloc for."""
        if size <= _SMALL_SIZE:
            return _SMALL_BUFFER
        if size < _MIN_LARGE_ALLOC:
            return self._large.page_bytes
        return -(-size // _ROUND_LARGE) * _ROUND_LARGE

    def _should_split(self, pool: _Pool, block: int, size: int) -> bool:
        """``should_split``: what is left must be worth a block of its own. In the large pool a remainder of
        1 MiB or less stays with the allocation, and a request of max_split_size or more is never split."""
        remaining = block - size
        if pool.small or self._expandable:
            return remaining >= _MIN_BLOCK
        return size < self._max_split and remaining > _SMALL_SIZE

    def _get_free_block(self, pool: _Pool, size: int) -> int:
        """``get_free_block``: the smallest free block of the pool that fits (ties by address), taken out of
        the pool; -1 when there is none or the max_split_size rules refuse it."""
        if self._gc:
            pool.clock[0] += 1  # the block ages garbage collection reads are counted in these calls
        free = pool.free
        i = bisect_left(free, size << 64)
        if i == len(free):
            return -1
        key = free[i]
        if self._expandable:
            # A block whose end touches unmapped space counts, for best fit, as the size it could grow to:
            # move on to the next larger blocks while they are "smaller" that way.
            grow = self._expandable_size(key)
            while i + 1 < len(free):
                grow_next = self._expandable_size(free[i + 1])
                if grow_next >= grow:
                    break
                i += 1
                key = free[i]
                grow = grow_next
        block = key >> 64
        if size < self._max_split and block >= self._max_split:
            return -1  # an oversize block does not serve a request it would have to be split for
        if size >= self._max_split and block >= size + self._non_split_rounding:
            return -1  # an oversize request takes an oversize block only within max_non_split_rounding
        del free[i]
        pool.gc_base.pop(key & _ADDRESS_MASK, None)
        return key & _ADDRESS_MASK

    def _expandable_size(self, key: int) -> int:
        addr = key & _ADDRESS_MASK
        size = key >> 64
        after = addr + size
        if self._state.get(after) == _UNMAPPED:
            return size + self._size[after]
        return size

    def _new_block(self, pool: _Pool, size: int, nbytes: int) -> int:
        """The steps of malloc once no cached block fits: garbage collection (with a memory fraction and a
        threshold), a new segment (``alloc_block``), and on failure ``release_available_cached_blocks`` and
        ``release_cached_blocks``, each followed by another try; then out of memory."""
        alloc_size = self._allocation_size(size)
        if self._gc:
            self._garbage_collect_cached_blocks()
        addr = self._alloc_block(pool, size, alloc_size)
        if addr < 0 and self._release_available_cached_blocks(pool, size):
            addr = self._alloc_block(pool, size, alloc_size)
        if addr < 0:
            self._release_cached_blocks()
            self.alloc_retries += 1
            addr = self._alloc_block(pool, size, alloc_size)
        if addr < 0:
            raise AllocatorOutOfMemory(nbytes, alloc_size, self._reserved, self._allocated)
        return addr

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> int:
        """``alloc_block``: a new segment of alloc_size (or pages of the expandable segment for size), or -1
        where it would pass the memory fraction or the card."""
        if self._allowed is not None and self._reserved + alloc_size > self._allowed:
            return -1  # checked against alloc_size even where expandable pages would map less
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size)
        if self.limit_bytes is not None and self._reserved + alloc_size > self.limit_bytes:
            return -1  # cudaMalloc: cudaErrorMemoryAllocation
        addr = pool.next_segment
        pool.next_segment += alloc_size + _SEGMENT_GAP
        self._size[addr] = alloc_size
        self._state[addr] = _FREE
        self._start_of_end[addr + alloc_size] = addr
        self._segments += 1
        self.device_allocs += 1
        self._add_reserved(alloc_size)
        return addr

    def _add_reserved(self, nbytes: int) -> None:
        self._reserved += nbytes
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved

    # --- free -----------------------------------------------------------------------------------------------

    def free(self, key: int) -> None:
        """Free what key holds (``DeviceCachingAllocator::free`` then ``free_block``): the block goes back to
        its pool, merged with free neighbours of its segment (``try_merge_blocks``). Segments stay reserved.

        Raises:
            ValueError: key holds nothing.
        """
        try:
            addr, nbytes = self._live.pop(key)
        except KeyError:
            raise ValueError(f"key {key} is not allocated") from None
        self._requested -= nbytes
        if addr < 0:
            return
        size = self._size[addr]
        self._allocated -= size
        pools = self._pools[(addr >> _STREAM_SHIFT) & (_MAX_STREAMS - 1)]
        pool = pools[1] if addr & _SMALL_BIT else pools[0]
        self._place_free(pool, addr, size)

    def _place_free(self, pool: _Pool, addr: int, size: int) -> None:
        """A free mapped block at [addr, addr + size) into the pool, merged with free neighbours."""
        addr, size = self._merge(pool, addr, size, _FREE)
        key = size << 64 | addr
        insort(pool.free, key)
        if self._gc:
            pool.gc_base[addr] = pool.clock[0]  # insert_into_blocks: the block's age starts now

    def _merge(self, pool: _Pool, addr: int, size: int, state: int) -> tuple[int, int]:
        """``try_merge_blocks`` with both neighbours: the run [addr, addr + size) joins the blocks before and
        after it that are in the same state (free with free, unmapped with unmapped), taking them out of
        their lists; the merged block's entries are written, the list entry is the caller's."""
        sizes = self._size
        states = self._state
        ends = self._start_of_end
        before = ends.get(addr)
        if before is not None and states[before] == state:
            before_size = sizes[before]
            self._unlist(pool, before, before_size, state)
            del ends[addr]
            sizes.pop(addr, None)
            states.pop(addr, None)
            addr = before
            size += before_size
        after = addr + size
        if states.get(after) == state:
            after_size = sizes.pop(after)
            del states[after]
            self._unlist(pool, after, after_size, state)
            ends.pop(after, None)
            size += after_size
        sizes[addr] = size
        states[addr] = state
        ends[addr + size] = addr
        return addr, size

    def _unlist(self, pool: _Pool, addr: int, size: int, state: int) -> None:
        if state == _FREE:
            free = pool.free
            del free[bisect_left(free, size << 64 | addr)]
            pool.gc_base.pop(addr, None)
        else:
            unmapped = pool.unmapped
            del unmapped[bisect_left(unmapped, addr)]

    def _drop(self, addr: int) -> int:
        """Forget the block at addr (its list entry is the caller's); returns its size."""
        size = self._size.pop(addr)
        del self._state[addr]
        del self._start_of_end[addr + size]
        return size

    def _whole_segment(self, addr: int, size: int) -> bool:
        """``!block->prev && !block->next``: the block is its segment."""
        return addr not in self._start_of_end and addr + size not in self._size

    # --- releasing the cache --------------------------------------------------------------------------------

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()`` (``emptyCache`` -> ``release_cached_blocks``): every segment that is
        wholly free goes back to the card; expandable segments give back their wholly free pages."""
        self._release_cached_blocks()

    def _release_block(self, pool: _Pool, addr: int, size: int) -> None:
        """``release_block``: cudaFree a wholly free segment."""
        self._unlist(pool, addr, size, _FREE)
        self._drop(addr)
        self._reserved -= size
        self._segments -= 1
        self.device_frees += 1

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks`` / ``release_blocks``, the large pool first: wholly free segments are
        freed; free blocks of expandable segments unmap their whole pages, and a segment left with no mapped
        page goes (``release_expandable_segment``)."""
        for pool in self._all_pools():
            to_unmap = []
            for key in list(pool.free):
                addr = key & _ADDRESS_MASK
                size = key >> 64
                if addr & _EXPANDABLE_BIT:
                    to_unmap.append(addr)
                elif self._whole_segment(addr, size):
                    self._release_block(pool, addr, size)
            for addr in to_unmap:
                unmapped = self._unmap_block(pool, addr)
                if unmapped is not None and self._whole_segment(unmapped, self._size[unmapped]):
                    self._unlist(pool, unmapped, self._size[unmapped], _UNMAPPED)
                    self._drop(unmapped)
                    del self._expandable_segments[unmapped]

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: with a max_split_size, free the smallest oversize block of the
        pool that is at least max(size, max_split_size), or else the largest oversize blocks until that many
        bytes are freed. Oversize blocks are never split, so each is a whole segment. Expandable segments
        have no such blocks to free (the source would assert there): skipped."""
        if self._max_split == _SIZE_MAX or self._expandable:
            return False
        wanted = max(size, self._max_split)
        free = pool.free
        i = bisect_left(free, wanted << 64)
        if i < len(free):
            key = free[i]
            self._release_block(pool, key & _ADDRESS_MASK, key >> 64)
            return True
        released = 0
        while released < wanted and free and (free[-1] >> 64) >= self._max_split:
            key = free[-1]
            released += key >> 64
            self._release_block(pool, key & _ADDRESS_MASK, key >> 64)
        return released >= wanted

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: past garbage_collection_threshold of the allowed memory, free
        wholly free large-pool segments, the ones unused for at least the average age first, pass after pass,
        until the excess is reclaimed or nothing more can go."""
        assert self._allowed is not None  # garbage collection is on only with a memory fraction
        threshold = int(self.config.garbage_collection_threshold * self._allowed)
        if self._reserved <= threshold:
            return
        target = self._reserved - threshold
        large = [pools[0] for pools in self._pools.values()]  # every stream's large blocks
        total_age = 0
        count = 0
        for pool in large:
            for key in pool.free:
                addr = key & _ADDRESS_MASK
                if self._whole_segment(addr, key >> 64):
                    total_age += pool.clock[0] - pool.gc_base[addr]
                    count += 1
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for pool in large:
                for key in list(pool.free):
                    addr = key & _ADDRESS_MASK
                    size = key >> 64
                    age = pool.clock[0] - pool.gc_base[addr]
                    if self._whole_segment(addr, size) and age >= age_threshold:
                        freed = True
                        reclaimed += size
                        total_age -= age
                        count -= 1
                        self._release_block(pool, addr, size)

    # --- expandable segments --------------------------------------------------------------------------------

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> int:
        """``try_allocate_expandable_block``: map pages at the lowest place with room for size (after a free
        block if one ends there), one map per unmapped run, merging into one free block; -1 when a map would
        pass the card."""
        addr = self._find_expandable_block(pool, size)
        if self._state[addr] == _UNMAPPED:
            addr = self._map_block(pool, addr, min(self._size[addr], size))
            if addr < 0:
                return -1
        while self._size[addr] < size:
            after = addr + self._size[addr]
            addr = self._map_block(pool, after, min(size - self._size[addr], self._size[after]))
            if addr < 0:
                return -1
        self._unlist(pool, addr, self._size[addr], _FREE)
        return addr

    def _find_expandable_block(self, pool: _Pool, size: int) -> int:
        """``find_expandable_block``: the lowest unmapped run (or the free block just before it) from which
        free and unmapped blocks add up to size; else a new segment whose address space is 1 1/8 of the
        card, in pages of 2 MiB (small pool) or the large segment size (large pool)."""
        states = self._state
        sizes = self._size
        for unmapped in pool.unmapped:
            start = unmapped
            before = self._start_of_end.get(unmapped)
            if before is not None and states[before] == _FREE:
                start = before
            room = 0
            block = start
            while room < size and states.get(block, _ALLOCATED) != _ALLOCATED:
                room += sizes[block]
                block += sizes[block]
            if room >= size:
                return start
        page = pool.page_bytes
        space = -(-(self._card_bytes + self._card_bytes // 8) // page) * page
        base = pool.next_expandable
        pool.next_expandable += space + page  # the next segment starts page-aligned, past a gap
        sizes[base] = space
        states[base] = _UNMAPPED
        self._start_of_end[base + space] = base
        insort(pool.unmapped, base)
        self._expandable_segments[base] = space
        return base

    def _map_block(self, pool: _Pool, addr: int, size: int) -> int:
        """``map_block``: back the first size bytes of the unmapped block at addr with whole pages, and merge
        the mapped run with a free block before or after it; returns the merged block, or -1 where the pages
        would pass the card (``ExpandableSegment::map`` gives back a partial map when cuMemCreate fails)."""
        page = pool.page_bytes
        mapped = -(-size // page) * page
        if self.limit_bytes is not None and self._reserved + mapped > self.limit_bytes:
            return -1
        self._unlist(pool, addr, self._size[addr], _UNMAPPED)
        whole = self._drop(addr)
        if mapped < whole:
            rest = addr + mapped
            self._size[rest] = whole - mapped
            self._state[rest] = _UNMAPPED
            self._start_of_end[addr + whole] = rest
            insort(pool.unmapped, rest)
        self.device_allocs += 1
        self._add_reserved(mapped)
        addr, merged = self._merge(pool, addr, mapped, _FREE)
        insort(pool.free, merged << 64 | addr)
        if self._gc:
            pool.gc_base[addr] = pool.clock[0]
        return addr

    def _unmap_block(self, pool: _Pool, addr: int) -> int | None:
        """``unmap_block``: give back the whole pages inside the free block at addr; the partial pages at its
        ends stay as free blocks, and the unmapped run merges with unmapped neighbours. Returns the unmapped
        block's address, or None where the block holds no whole page."""
        page = pool.page_bytes
        size = self._size[addr]
        offset = addr & _OFFSET_MASK  # from the pool's expandable origin, where segments start page-aligned
        begin = -(-offset // page) * page
        end = (offset + size) // page * page
        if begin >= end:
            return None
        self._unlist(pool, addr, size, _FREE)
        self._drop(addr)
        origin = addr - offset
        if begin > offset:
            self._place_free(pool, addr, begin - offset)
        if offset + size > end:
            self._place_free(pool, origin + end, offset + size - end)
        unmapped, _ = self._merge(pool, origin + begin, end - begin, _UNMAPPED)
        insort(pool.unmapped, unmapped)
        self._reserved -= end - begin
        self.device_frees += 1
        return unmapped


def replay(
    events: Iterable[tuple[int, int]],
    config: AllocatorConfig = AllocatorConfig(),
    limit_bytes: int | None = None,
    *,
    memory_fraction: float | None = None,
    streams: Mapping[int, int] | None = None,
) -> AllocatorPeaks:
    """The allocator's figures after a trace: each event is ``(key, nbytes)``, nbytes >= 0 allocating nbytes
    under key and ``nbytes == FREE`` freeing key.

    The same request after a free on another stream cannot take the freed block: 3 MiB freed on the default
    stream stay cached in their 20 MiB segment while a side stream's 3 MiB take a segment of their own.

    >>> replay([(1, 3 << 20), (1, FREE), (2, 3 << 20)]).peak_reserved_bytes == 20 << 20
    True
    >>> replay([(1, 3 << 20), (1, FREE), (2, 3 << 20)], streams={2: 77}).peak_reserved_bytes == 40 << 20
    True

    Args:
        events: the trace, in order.
        config: the allocator's options (``AllocatorConfig.parse(os.environ["PYTORCH_CUDA_ALLOC_CONF"])``).
        limit_bytes: the card's memory available to the allocator; None for no limit.
        memory_fraction: ``set_per_process_memory_fraction``'s share of limit_bytes, if one is set.
        streams: the stream each allocation was made on, by key, for those not made on the default stream
            (any ids: each distinct one is a stream of its own).

    Returns:
        The peaks and end figures; where a request does not fit, ``oom`` is True, ``oom_event`` the index of
        that event and ``oom_request_bytes`` its size, with the figures as they stood then.

    Raises:
        ValueError: a key allocated twice, a free of a key that holds nothing, or nbytes below FREE.
    """
    allocator = CachingAllocator(config, limit_bytes, memory_fraction=memory_fraction)
    malloc = allocator.malloc
    free = allocator.free
    on_streams = streams or {}
    indices: dict[int, int] = {}  # a stream's id -> its index, 1 and up in order of first use
    for index, (key, nbytes) in enumerate(events):
        try:
            if nbytes == FREE:
                free(key)
            elif key in on_streams:
                stream = on_streams[key]
                malloc(key, nbytes, indices.setdefault(stream, len(indices) + 1))
            else:
                malloc(key, nbytes)
        except AllocatorOutOfMemory as oom:
            return replace(allocator.peaks(), oom=True, oom_event=index, oom_request_bytes=oom.requested_bytes)
    return allocator.peaks()
