"""The caching-allocator model: one hand-derived sequence per rule of CUDACachingAllocator.cpp, the config
parser, and properties that hold for any trace. Each expected figure is derived in the comment above it."""

from __future__ import annotations

import doctest
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.core import allocator as allocator_module
from autotune.core.allocator import (
    FREE,
    AllocatorConfig,
    AllocatorOutOfMemory,
    CachingAllocator,
    replay,
)

MiB = 1 << 20


def run(events: list[tuple[int, int]], text: str = "", **limits: object) -> CachingAllocator:
    """An allocator after the events (no OOM expected)."""
    allocator = CachingAllocator(AllocatorConfig.parse(text), **limits)  # type: ignore[arg-type]
    for key, nbytes in events:
        if nbytes == FREE:
            allocator.free(key)
        else:
            allocator.malloc(key, nbytes)
    return allocator


# --- round_size -------------------------------------------------------------------------------------------


def test_requests_round_up_to_512_bytes() -> None:
    config = AllocatorConfig()
    # kMinBlockSize: below 512 -> 512; otherwise the next multiple of 512.
    assert [config.round_size(n) for n in (1, 511, 512, 513, 1000, 5000)] == [512, 512, 512, 1024, 1024, 5120]
    # allocated_bytes counts the block: 1000 bytes hold 1024.
    assert run([(0, 1000)]).allocated_bytes == 1024


def test_roundup_power2_divisions_rounds_to_the_next_division() -> None:
    config = AllocatorConfig.parse("roundup_power2_divisions:4")
    # 1 GiB + 1: between 1 GiB and 2 GiB, 4 divisions of 256 MiB -> 1.25 GiB; a power of two stays as it is.
    assert config.round_size((1 << 30) + 1) == 1280 * MiB
    assert config.round_size(1 << 30) == 1 << 30
    # 1200 bytes is not above 512 x 4, so it rounds to 512 bytes only (round_size's second condition).
    assert config.round_size(1200) == 1536
    # The 1.25 GiB block is a segment of its own (>= 10 MiB, already a multiple of 2 MiB), not split.
    allocator = run([(0, (1 << 30) + 1)], "roundup_power2_divisions:4")
    assert allocator.allocated_bytes == allocator.reserved_bytes == 1280 * MiB
    # Without the option the same request is 1 GiB + 512 bytes in a 1 GiB + 2 MiB segment.
    plain = run([(0, (1 << 30) + 1)])
    assert (plain.allocated_bytes, plain.reserved_bytes) == ((1 << 30) + 512, (1 << 30) + 2 * MiB)


def test_roundup_power2_divisions_per_interval() -> None:
    # The cases of c10/test/core/AllocatorConfig_test.cpp: [MiB:count] sets the interval [MiB, 2 MiB); the
    # first entry also covers the intervals below it, '>' the ones after the last named; unnamed ones are 0.
    config = AllocatorConfig.parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]")
    got = [config.divisions_for(mib * MiB) for mib in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)]
    assert got == [8, 8, 2, 4, 2, 4, 1, 1, 1]
    config = AllocatorConfig.parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    got = [config.divisions_for(mib * MiB) for mib in (64, 128, 256, 512, 1024, 2048, 4096)]
    assert got == [8, 8, 16, 1, 0, 8, 2]
    # 600 MiB under [256:1,512:2,1024:4,>:8]: interval [512 MiB, 1 GiB) has 2 divisions of 256 MiB -> 768 MiB;
    # 3 GiB + 1: interval [2 GiB, 4 GiB) filled by '>' with 8 divisions of 256 MiB -> 3.25 GiB.
    config = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert config.round_size(600 * MiB) == 768 * MiB
    assert config.round_size((3 << 30) + 1) == 3328 * MiB
    assert config.round_size(300 * MiB) == 300 * MiB  # 1 division: 512-byte rounding only


# --- get_pool / get_allocation_size ----------------------------------------------------------------------


def test_small_requests_share_2_mib_segments() -> None:
    # 1 MiB is the largest small request: a 2 MiB segment, split; the second 1 MiB takes the other half;
    # one byte more needs a second 2 MiB segment.
    allocator = run([(0, MiB), (1, MiB)])
    assert (allocator.reserved_bytes, allocator.allocated_bytes, allocator.segments) == (2 * MiB, 2 * MiB, 1)
    allocator.malloc(2, 1)
    assert (allocator.reserved_bytes, allocator.segments) == (4 * MiB, 2)


def test_large_requests_under_10_mib_share_20_mib_segments() -> None:
    # 1 MiB + 1 rounds to 1 MiB + 512: large pool, a 20 MiB segment, the rest (19 MiB - 512) split off.
    allocator = run([(0, MiB + 1)])
    assert (allocator.reserved_bytes, allocator.allocated_bytes) == (20 * MiB, MiB + 512)
    # 9 MiB leaves 11 MiB; an 11 MiB request fits it exactly: still one 20 MiB segment.
    allocator = run([(0, 9 * MiB), (1, 11 * MiB)])
    assert (allocator.reserved_bytes, allocator.allocated_bytes, allocator.segments) == (20 * MiB, 20 * MiB, 1)


def test_requests_of_10_mib_or_more_get_their_own_segment_rounded_to_2_mib() -> None:
    # 10 MiB is not under kMinLargeAlloc: a 10 MiB segment. 11 MiB -> a 12 MiB segment, and the 1 MiB
    # left is not more than kSmallSize, so it stays with the block: allocated counts 12 MiB.
    assert run([(0, 10 * MiB)]).reserved_bytes == 10 * MiB
    allocator = run([(0, 11 * MiB)])
    assert (allocator.reserved_bytes, allocator.allocated_bytes) == (12 * MiB, 12 * MiB)


# --- get_free_block ---------------------------------------------------------------------------------------


def test_best_fit_takes_the_smallest_free_block_that_fits() -> None:
    # One 20 MiB segment cut into [k0 6][k1 2][k2 8][k3 4]; freeing k0 and k2 leaves free blocks of 6 and
    # 8 MiB. 5 MiB takes the 6 MiB one, and the 1 MiB left is not split off: allocated 2 + 4 + 6 = 12 MiB
    # (had it taken the 8 MiB block, the 3 MiB left would be split off and allocated would be 11 MiB).
    allocator = run([(0, 6 * MiB), (1, 2 * MiB), (2, 8 * MiB), (3, 4 * MiB), (0, FREE), (2, FREE), (4, 5 * MiB)])
    assert (allocator.segments, allocator.allocated_bytes) == (1, 12 * MiB)


def test_best_fit_breaks_ties_by_address() -> None:
    # Segments A then B, each [6 MiB][14 MiB]. Freeing both 6 MiB blocks makes a tie; 5 MiB takes A's
    # (the lower address). Freeing B's 14 MiB then makes B wholly free, and empty_cache gives it back:
    # 20 MiB stay reserved (had the tie gone to B, neither segment would be free and 40 MiB would stay).
    allocator = run([(0, 6 * MiB), (1, 14 * MiB), (2, 6 * MiB), (3, 14 * MiB), (0, FREE), (2, FREE)])
    assert allocator.segments == 2
    allocator.malloc(4, 5 * MiB)
    allocator.free(3)
    allocator.empty_cache()
    assert (allocator.reserved_bytes, allocator.segments) == (20 * MiB, 1)


def test_oversize_blocks_do_not_serve_smaller_requests() -> None:
    # max_split_size 40 MiB: the cached 50 MiB block is oversize, and a 30 MiB request may not have it:
    # a new 30 MiB segment, 80 MiB reserved. Without the option 30 MiB takes the 50 MiB block and splits.
    events = [(0, 50 * MiB), (0, FREE), (1, 30 * MiB)]
    assert run(events, "max_split_size_mb:40").reserved_bytes == 80 * MiB
    assert run(events).reserved_bytes == 50 * MiB


def test_oversize_requests_take_oversize_blocks_within_the_rounding_limit() -> None:
    # A cached 60 MiB oversize block serves 45 MiB (60 < 45 + 20): no new segment, and never split
    # (the request is oversize), so allocated counts all 60 MiB.
    allocator = run([(0, 60 * MiB), (0, FREE), (1, 45 * MiB)], "max_split_size_mb:40")
    assert (allocator.reserved_bytes, allocator.allocated_bytes) == (60 * MiB, 60 * MiB)
    # A 62 MiB block is too large for 41 MiB (62 >= 41 + 20): a new 42 MiB segment, 104 MiB reserved...
    events = [(0, 62 * MiB), (0, FREE), (1, 41 * MiB)]
    assert run(events, "max_split_size_mb:40").reserved_bytes == 104 * MiB
    # ...unless max_non_split_rounding_mb allows 30 MiB more (62 < 41 + 30).
    allocator = run(events, "max_split_size_mb:40,max_non_split_rounding_mb:30")
    assert (allocator.reserved_bytes, allocator.allocated_bytes) == (62 * MiB, 62 * MiB)


# --- should_split -----------------------------------------------------------------------------------------


def test_the_small_pool_splits_down_to_512_bytes() -> None:
    # 1 MiB, then 1 MiB - 512 leaves exactly 512 bytes, split off; a 512-byte request takes them.
    allocator = run([(0, MiB), (1, MiB - 512), (2, 512)])
    assert (allocator.segments, allocator.allocated_bytes, allocator.cached_free_bytes) == (1, 2 * MiB, 0)


def test_the_large_pool_splits_only_a_remainder_over_1_mib() -> None:
    # In a 20 MiB segment: 19 MiB - 512 leaves 1 MiB + 512 (> 1 MiB, split off); 19 MiB leaves exactly
    # 1 MiB (kept with the block, so allocated is the whole 20 MiB).
    assert run([(0, 19 * MiB - 512)]).allocated_bytes == 19 * MiB - 512
    assert run([(0, 19 * MiB)]).allocated_bytes == 20 * MiB


def test_oversize_requests_are_never_split() -> None:
    # 42 MiB in a cached 60 MiB block (60 < 42 + 20): 18 MiB would be left, but a request of
    # max_split_size or more is not split: allocated 60 MiB. Without the option: 42 MiB, 18 MiB split off.
    events = [(0, 60 * MiB), (0, FREE), (1, 42 * MiB)]
    assert run(events, "max_split_size_mb:40").allocated_bytes == 60 * MiB
    assert run(events).allocated_bytes == 42 * MiB


# --- free_block / try_merge_blocks ------------------------------------------------------------------------


def test_freed_blocks_merge_with_free_neighbours_of_their_segment() -> None:
    # [a 4][b 4][c 4][free 8] in one 20 MiB segment. Freeing a, then c (merging with the 8 after it), then b
    # (merging with both) leaves one free 20 MiB block: the whole segment, which 19 MiB can take whole.
    allocator = run([(0, 4 * MiB), (1, 4 * MiB), (2, 4 * MiB), (0, FREE), (2, FREE), (1, FREE)])
    assert allocator.cached_free_bytes == 20 * MiB
    allocator.malloc(3, 19 * MiB)
    assert (allocator.segments, allocator.allocated_bytes) == (1, 20 * MiB)
    allocator.free(3)
    allocator.empty_cache()
    assert allocator.reserved_bytes == 0


def test_blocks_of_different_segments_never_merge() -> None:
    # Two 20 MiB segments, wholly free: no 40 MiB block comes of them, so 30 MiB needs a segment of its
    # own: 70 MiB reserved.
    allocator = run([(0, 2 * MiB), (1, 18 * MiB), (2, 2 * MiB), (3, 18 * MiB)])
    assert allocator.segments == 2
    for key in range(4):
        allocator.free(key)
    allocator.malloc(4, 30 * MiB)
    assert (allocator.reserved_bytes, allocator.segments) == (70 * MiB, 3)


# --- alloc_block and what follows its failure ----------------------------------------------------------


def test_out_of_memory_carries_the_request_and_the_reserved_bytes() -> None:
    # Limit 30 MiB: 20 MiB fits; 12 MiB needs a 12 MiB segment, 32 MiB in all; nothing cached to release.
    allocator = CachingAllocator(limit_bytes=30 * MiB)
    allocator.malloc(0, 20 * MiB)
    with pytest.raises(AllocatorOutOfMemory) as caught:
        allocator.malloc(1, 12 * MiB - 100)
    assert (caught.value.requested_bytes, caught.value.allocation_bytes) == (12 * MiB - 100, 12 * MiB)
    assert (caught.value.reserved_bytes, caught.value.allocated_bytes) == (20 * MiB, 20 * MiB)
    assert "\n" not in str(caught.value)
    peaks = replay([(0, 20 * MiB), (1, 12 * MiB), (2, MiB)], limit_bytes=30 * MiB)
    assert (peaks.oom, peaks.oom_event, peaks.oom_request_bytes) == (True, 1, 12 * MiB)
    assert peaks.peak_reserved_bytes == 20 * MiB


def test_a_failed_cudamalloc_releases_the_cache_and_retries() -> None:
    # Limit 30 MiB, a cached 20 MiB segment: 22 MiB does not fit in it, and 20 + 22 > 30, so the allocator
    # frees the cached segment (release_cached_blocks) and tries again: 22 MiB reserved, one cudaFree.
    peaks = replay([(0, 20 * MiB), (0, FREE), (1, 22 * MiB)], limit_bytes=30 * MiB)
    assert (peaks.oom, peaks.reserved_bytes, peaks.peak_reserved_bytes) == (False, 22 * MiB, 22 * MiB)
    assert (peaks.device_allocs, peaks.device_frees, peaks.segments) == (2, 1, 1)


def test_release_available_cached_blocks_frees_oversize_blocks_first() -> None:
    # max_split_size 40 MiB, limit 80 MiB, a cached oversize 60 MiB segment. 30 MiB may not use it, and
    # 60 + 30 > 80: the smallest oversize block of at least max(30, 40) MiB goes, and 30 MiB fit.
    peaks = replay([(0, 60 * MiB), (0, FREE), (1, 30 * MiB)], AllocatorConfig.parse("max_split_size_mb:40"), 80 * MiB)
    assert (peaks.reserved_bytes, peaks.peak_reserved_bytes, peaks.device_frees) == (30 * MiB, 60 * MiB, 1)


def test_release_available_cached_blocks_frees_the_largest_oversize_blocks_until_enough() -> None:
    # Cached: a 20 MiB segment (not oversize) and oversize 44 and 50 MiB ones; limit 150 MiB. 60 MiB finds no
    # block and 114 + 60 > 150. No single oversize block is 60 MiB, so the largest go until 60 MiB are
    # freed: 50, then 44 (94 >= 60). The 20 MiB segment is not touched: 20 + 60 = 80 MiB reserved (the
    # full release_cached_blocks would have left 60).
    events = [(0, 2 * MiB), (1, 44 * MiB), (2, 50 * MiB), (0, FREE), (1, FREE), (2, FREE), (3, 60 * MiB)]
    peaks = replay(events, AllocatorConfig.parse("max_split_size_mb:40"), 150 * MiB)
    assert (peaks.oom, peaks.reserved_bytes, peaks.segments) == (False, 80 * MiB, 2)
    assert peaks.peak_reserved_bytes == 114 * MiB


def test_garbage_collection_frees_the_oldest_cached_segments_before_a_new_one() -> None:
    # Limit 200 MiB at fraction 1.0 (allowed 200 MiB), threshold 0.35 (70 MiB). Segments a 30, b 40, f 12
    # and k 10 MiB: four get_free_block calls (count 4). a and f are freed (ages start at 4); f is taken and
    # freed three times (calls 5, 6, 7; f's age restarts at 7); b is freed (at 7). 50 MiB finds no block
    # (call 8): 92 MiB reserved > 70, so 22 MiB are to be reclaimed. Ages: f 1, a 4, b 1, average 2: only a
    # is as old, and its 30 MiB are enough. 92 - 30 + 50 = 112 MiB reserved (without garbage collection, 142).
    events = [(0, 30 * MiB), (1, 40 * MiB), (2, 12 * MiB), (3, 10 * MiB), (0, FREE), (2, FREE)]
    events += [(2, 12 * MiB), (2, FREE)] * 3 + [(1, FREE), (4, 50 * MiB)]
    config = AllocatorConfig.parse("garbage_collection_threshold:0.35")
    peaks = replay(events, config, 200 * MiB, memory_fraction=1.0)
    assert (peaks.reserved_bytes, peaks.segments, peaks.device_frees) == (112 * MiB, 4, 1)
    # Garbage collection runs only under a memory fraction (set_fraction), as in the source.
    assert replay(events, config, 200 * MiB).reserved_bytes == 142 * MiB


def test_a_memory_fraction_caps_the_segments() -> None:
    # Fraction 0.5 of 100 MiB: 50 MiB allowed. 20 + 20 fit; a third 20 MiB segment does not: OOM.
    peaks = replay([(0, 3 * MiB), (1, 20 * MiB), (2, 20 * MiB)], limit_bytes=100 * MiB, memory_fraction=0.5)
    assert (peaks.oom, peaks.oom_event, peaks.reserved_bytes) == (True, 2, 40 * MiB)


def test_empty_cache_releases_only_wholly_free_segments() -> None:
    # Two 20 MiB segments, one with a live block: empty_cache gives back the other.
    allocator = run([(0, 5 * MiB), (1, 20 * MiB), (1, FREE)])
    allocator.empty_cache()
    assert (allocator.reserved_bytes, allocator.segments, allocator.peak_reserved_bytes) == (20 * MiB, 1, 40 * MiB)


# --- streams ------------------------------------------------------------------------------------------------


def test_a_free_block_serves_only_its_own_stream() -> None:
    # 3 MiB on the default stream take a 20 MiB segment and are freed; 3 MiB on stream 1 may not take that
    # cached block (the comparator's first key is the stream): a second 20 MiB segment, 40 MiB reserved. The
    # next 3 MiB on stream 1 reuse stream 1's block; on the default stream, the default stream's.
    allocator = run([(0, 3 * MiB), (0, FREE)])
    allocator.malloc(1, 3 * MiB, stream=1)
    assert (allocator.reserved_bytes, allocator.segments) == (40 * MiB, 2)
    allocator.free(1)
    allocator.malloc(2, 3 * MiB, stream=1)
    allocator.malloc(3, 3 * MiB)
    assert (allocator.reserved_bytes, allocator.allocated_bytes, allocator.segments) == (40 * MiB, 6 * MiB, 2)
    # The small pool too: 1000 bytes on each of two streams, two 2 MiB segments.
    assert run([(0, 1000), (0, FREE)]).segments == 1
    small = run([(0, 1000), (0, FREE)])
    small.malloc(1, 1000, stream=3)
    assert (small.segments, small.reserved_bytes) == (2, 4 * MiB)


def test_a_failed_cudamalloc_releases_every_streams_cache() -> None:
    # Limit 30 MiB. 20 MiB on stream 1 take a 20 MiB segment and are freed; 20 MiB on the default stream
    # find no block of their stream, and 20 + 20 > 30: release_cached_blocks frees stream 1's segment too,
    # and the request fits: 20 MiB reserved, one cudaFree.
    peaks = replay([(1, 20 * MiB), (1, FREE), (2, 20 * MiB)], limit_bytes=30 * MiB, streams={1: 5})
    assert (peaks.oom, peaks.reserved_bytes, peaks.peak_reserved_bytes) == (False, 20 * MiB, 20 * MiB)
    assert (peaks.device_allocs, peaks.device_frees) == (2, 1)


def test_replay_gives_each_stream_id_a_pool() -> None:
    # Stream ids are any ints (torch's stream_id): 12 MiB on each of three streams, each freed before the
    # next: one 12 MiB segment per stream, 36 MiB reserved; on one stream, 12 MiB.
    events = [(1, 12 * MiB), (1, FREE), (2, 12 * MiB), (2, FREE), (3, 12 * MiB), (3, FREE)]
    assert replay(events, streams={2: 1 << 40, 3: 69}).peak_reserved_bytes == 36 * MiB
    assert replay(events, streams={2: 69, 3: 69}).peak_reserved_bytes == 24 * MiB
    assert replay(events).peak_reserved_bytes == 12 * MiB


# --- expandable segments ----------------------------------------------------------------------------------


def test_expandable_segments_grow_in_pages_of_20_mib_for_the_large_pool() -> None:
    # 3 MiB maps one 20 MiB page; 12 MiB fits in the 17 MiB left; 30 MiB does not fit in the 5 MiB left, so
    # the segment grows after it by 25 MiB, two pages (40 MiB): 60 MiB reserved, still one segment.
    allocator = run([(0, 3 * MiB)], "expandable_segments:True")
    assert (allocator.reserved_bytes, allocator.allocated_bytes) == (20 * MiB, 3 * MiB)
    allocator.malloc(1, 12 * MiB)
    assert allocator.reserved_bytes == 20 * MiB
    allocator.malloc(2, 30 * MiB)
    assert (allocator.reserved_bytes, allocator.allocated_bytes, allocator.segments) == (60 * MiB, 45 * MiB, 1)


def test_expandable_segments_grow_in_pages_of_2_mib_for_the_small_pool() -> None:
    # 1000 bytes map one 2 MiB page (1024 allocated); 1 MiB fits in what is left; the next 1 MiB needs 1024
    # bytes more than the 1 MiB - 1024 left, so one more 2 MiB page: 4 MiB in one segment (cudaMalloc'd
    # segments would be two).
    allocator = run([(0, 1000), (1, MiB), (2, MiB)], "expandable_segments:True")
    assert (allocator.reserved_bytes, allocator.segments) == (4 * MiB, 1)
    assert run([(0, 1000), (1, MiB), (2, MiB)]).segments == 2


def test_expandable_segments_split_any_remainder_of_512_bytes() -> None:
    # should_split with expandable segments: 11 MiB in a 20 MiB page leaves 9 MiB, split off (a cudaMalloc'd
    # 12 MiB segment would keep its 1 MiB with the block).
    assert run([(0, 11 * MiB)], "expandable_segments:True").allocated_bytes == 11 * MiB


def test_best_fit_skips_the_block_that_could_grow() -> None:
    # One page: [p 8][q 2][r 5][T 5 free, touching the unmapped rest]. Freeing p makes an interior free block
    # I of 8 MiB. 4 MiB: the smallest fit is T, but T counts as the size it can grow to, so I (8 MiB, no
    # growth) is taken, leaving 4 MiB. 8 MiB then fits neither the 4 nor T's 5 MiB: the segment grows by a
    # page after T: 40 MiB reserved (had 4 MiB gone to T, the 8 MiB would have fitted I: 20 MiB).
    events = [(0, 8 * MiB), (1, 2 * MiB), (2, 5 * MiB), (0, FREE), (3, 4 * MiB), (4, 8 * MiB)]
    assert run(events, "expandable_segments:True").reserved_bytes == 40 * MiB


def test_empty_cache_unmaps_the_whole_free_pages_of_expandable_segments() -> None:
    # [a 30][b 30] in pages of 20 MiB (three mapped). Freeing a and emptying the cache unmaps the one whole
    # page inside it, [0, 20): 40 MiB stay reserved, the [20, 30) part stays mapped and free. Freeing b
    # merges it with that part, and empty_cache unmaps [20, 60): nothing mapped, the segment goes.
    allocator = run([(0, 30 * MiB), (1, 30 * MiB)], "expandable_segments:True")
    assert allocator.reserved_bytes == 60 * MiB
    allocator.free(0)
    allocator.empty_cache()
    assert (allocator.reserved_bytes, allocator.cached_free_bytes, allocator.segments) == (40 * MiB, 10 * MiB, 1)
    allocator.free(1)
    allocator.empty_cache()
    assert (allocator.reserved_bytes, allocator.segments) == (0, 0)


def test_expandable_pages_count_against_the_card() -> None:
    # Limit 50 MiB: 30 MiB maps two pages (40 MiB); 20 MiB needs one more page past the free 10 MiB, 60 MiB
    # in all, and there is no whole free page to unmap: out of memory. cudaMalloc'd segments of 30 and
    # 20 MiB fit the same card exactly.
    events = [(0, 30 * MiB), (1, 20 * MiB)]
    peaks = replay(events, AllocatorConfig.parse("expandable_segments:True"), 50 * MiB)
    assert (peaks.oom, peaks.oom_event, peaks.reserved_bytes) == (True, 1, 40 * MiB)
    assert replay(events, limit_bytes=50 * MiB).reserved_bytes == 50 * MiB


# --- size zero, peaks -------------------------------------------------------------------------------------


def test_zero_byte_requests_allocate_nothing() -> None:
    peaks = replay([(0, 0), (1, 0), (0, FREE), (1, FREE)])
    assert (peaks.peak_reserved_bytes, peaks.peak_allocated_bytes, peaks.segments, peaks.device_allocs) == (0, 0, 0, 0)


def test_reset_peaks_restarts_from_the_current_figures() -> None:
    allocator = run([(0, 20 * MiB), (1, 4 * MiB), (0, FREE)])
    assert (allocator.peak_allocated_bytes, allocator.allocated_bytes) == (24 * MiB, 4 * MiB)
    allocator.empty_cache()  # the 20 MiB segment goes; the 20 MiB segment of key 1 stays
    allocator.reset_peaks()
    assert (allocator.peak_reserved_bytes, allocator.peak_allocated_bytes) == (20 * MiB, 4 * MiB)
    assert allocator.peak_requested_bytes == 4 * MiB


def test_keys_are_checked() -> None:
    allocator = run([(0, 10)])
    with pytest.raises(ValueError, match="allocated already"):
        allocator.malloc(0, 10)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(1)
    with pytest.raises(ValueError, match="nbytes"):
        replay([(0, -2)])


# --- the config parser ------------------------------------------------------------------------------------


def test_parse_reads_every_modelled_option() -> None:
    text = "max_split_size_mb:128,roundup_power2_divisions:4,expandable_segments:True,garbage_collection_threshold:0.8"
    config = AllocatorConfig.parse(text)
    assert config.max_split_size_bytes == 128 * MiB
    assert config.roundup_power2_divisions == (4,) * 16
    assert config.expandable_segments is True
    assert config.garbage_collection_threshold == 0.8
    assert AllocatorConfig.parse("") == AllocatorConfig() == AllocatorConfig.parse(None)
    # Spaces are dropped, a trailing comma is accepted, options that move no device memory are ignored.
    spaced = AllocatorConfig.parse(" max_split_size_mb : 64 , release_lock_on_cudamalloc:True, backend:native,")
    assert spaced == AllocatorConfig(max_split_size_bytes=64 * MiB)
    assert AllocatorConfig.parse("large_segment_size_mb:32,max_split_size_mb:64").large_segment_size_bytes == 32 * MiB


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("foo:123", "foo"),
        ("max_split_size_mb:10", "max_split_size_mb"),
        ("max_split_size_mb:lots", "max_split_size_mb"),
        ("max_split_size_mb", "max_split_size_mb"),
        ("max_split_size_mb:", "max_split_size_mb"),
        ("max_non_split_rounding_mb:5", "max_non_split_rounding_mb"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[64:8", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[100:4]", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[64:3]", "roundup_power2_divisions"),
        ("garbage_collection_threshold:1.5", "garbage_collection_threshold"),
        ("garbage_collection_threshold:high", "garbage_collection_threshold"),
        ("expandable_segments:yes", "expandable_segments"),
        ("expandable_segments:True;max_split_size_mb:64", "expandable_segments"),
        ("backend:cudaMallocAsync", "backend"),
        ("max_split_size_mb:20,large_segment_size_mb:25", "max_split_size"),
    ],
)
def test_parse_errors_name_the_key_in_one_line(text: str, key: str) -> None:
    with pytest.raises(ValueError) as caught:
        AllocatorConfig.parse(text)
    message = str(caught.value)
    assert key in message and "\n" not in message and message.startswith("PYTORCH_CUDA_ALLOC_CONF")


# --- the module -------------------------------------------------------------------------------------------


def test_the_docstrings_examples_hold() -> None:
    failed, attempted = doctest.testmod(allocator_module)
    assert attempted >= 3 and failed == 0


def test_all_is_declared_and_resolves() -> None:
    assert allocator_module.__all__
    assert all(hasattr(allocator_module, name) for name in allocator_module.__all__)


def test_importing_the_model_does_not_import_torch() -> None:
    code = "import sys, autotune.core.allocator; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# --- properties of any trace ------------------------------------------------------------------------------


def _segments_tile(allocator: CachingAllocator) -> None:
    """Every block starts where the one before it in its segment ends, and the books add up: mapped
    blocks are reserved, allocated blocks are what the live keys hold."""
    sizes, states, ends = allocator._size, allocator._state, allocator._start_of_end
    assert len(sizes) == len(states) == len(ends)
    for start, size in sizes.items():
        assert size > 0 and ends[start + size] == start
    mapped = sum(size for start, size in sizes.items() if states[start] != 2)
    assert mapped == allocator.reserved_bytes
    held = sum(sizes[addr] for addr, _ in allocator._live.values() if addr >= 0)
    assert held == allocator.allocated_bytes
    # No two free blocks touch (they would have merged), nor two unmapped ones.
    for start, size in sizes.items():
        after = start + size
        if after in states and states[start] != 0:
            assert states[after] != states[start]


_CONFIGS = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:20",
    "max_split_size_mb:40,roundup_power2_divisions:[1:2,4:4,>:8]",
    "expandable_segments:True,roundup_power2_divisions:8",
    "garbage_collection_threshold:0.5,max_split_size_mb:24",
    "expandable_segments:True,garbage_collection_threshold:0.5",
]
_sizes = st.one_of(
    st.integers(0, 4096),
    st.integers(1, 1 << 20),
    st.integers((1 << 20) + 1, 30 << 20),
    st.integers(30 << 20, 300 << 20),
)


@settings(max_examples=300, deadline=None)
@given(
    text=st.sampled_from(_CONFIGS),
    limit_mib=st.one_of(st.none(), st.integers(40, 1500)),
    fraction=st.sampled_from([None, 0.9]),
    ops=st.lists(st.tuples(st.booleans(), _sizes, st.integers(0, 10**6), st.integers(0, 2)), max_size=80),
)
def test_any_trace_keeps_the_books(text: str, limit_mib: int | None, fraction: float | None, ops: list) -> None:
    limit = None if limit_mib is None else limit_mib * MiB
    allocator = CachingAllocator(
        AllocatorConfig.parse(text), limit, memory_fraction=fraction if limit is not None else None
    )
    live: list[int] = []
    requested = 0
    sizes: dict[int, int] = {}
    last = (0, 0, 0)
    for key, (allocate, nbytes, pick, stream) in enumerate(ops):
        if allocate or not live:
            try:
                allocator.malloc(key, nbytes, stream)
            except AllocatorOutOfMemory as oom:
                assert oom.requested_bytes == nbytes and oom.reserved_bytes == allocator.reserved_bytes
                continue
            live.append(key)
            sizes[key] = nbytes
            requested += nbytes
            # A stream's blocks come from its own segments (the stream's index is in the model's address).
            address = allocator._live[key][0]
            assert address < 0 or (address >> 52) & 0xFF == stream
        else:
            gone = live.pop(pick % len(live))
            allocator.free(gone)
            requested -= sizes.pop(gone)
        assert allocator.allocated_bytes <= allocator.reserved_bytes
        assert allocator.allocated_bytes + allocator.cached_free_bytes == allocator.reserved_bytes
        assert allocator.requested_bytes == requested <= allocator.allocated_bytes
        if limit is not None:
            assert allocator.reserved_bytes <= limit
        peaks = (allocator.peak_reserved_bytes, allocator.peak_allocated_bytes, allocator.peak_requested_bytes)
        assert all(p >= q for p, q in zip(peaks, last, strict=True))
        now = (allocator.reserved_bytes, allocator.allocated_bytes, allocator.requested_bytes)
        assert all(p >= q for p, q in zip(peaks, now, strict=True))
        last = peaks
        _segments_tile(allocator)
    for key in live:
        allocator.free(key)
    allocator.empty_cache()
    assert (allocator.reserved_bytes, allocator.allocated_bytes, allocator.segments) == (0, 0, 0)
    _segments_tile(allocator)
    # Nothing left of any segment but the address space of expandable ones (all of it unmapped).
    assert all(state == 2 for state in allocator._state.values())
