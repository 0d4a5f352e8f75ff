"""The compiled meter counts a free made on a thread the profiler does not follow (issue 41).

gloo runs each collective on a worker thread, and that thread can drop the last reference to a block the job let go
of (DDP's first bucket, replaced by the reducer after the first backward): the profiler records no event for that
free. The meter reads the allocator's own running total, which counts it.
"""

from __future__ import annotations

import threading

import torch

from autotune.measure.meters.compiled import CompiledCpuMeter, _report_flag

MIB = 1 << 20


def test_a_block_freed_on_another_thread_leaves_the_live_bytes() -> None:
    meter = CompiledCpuMeter(budget_bytes=1 << 30)
    with meter.measure():
        held = [torch.empty(MIB, dtype=torch.uint8)]
        # The last reference dies on a thread the profiler does not follow, before the next block is made.
        freer = threading.Thread(target=held.clear)
        freer.start()
        freer.join()
        second = torch.empty(MIB, dtype=torch.uint8)
        del second
    # One block of 1 MiB was alive at a time: the allocator never held more (the second is made after the first's
    # free). Before, the first was counted until the span ended, and this read 2 MiB.
    assert meter.reading().peak_bytes == MIB


def test_a_block_allocated_on_another_thread_is_counted() -> None:
    meter = CompiledCpuMeter(budget_bytes=1 << 30)
    made: list[torch.Tensor] = []
    with meter.measure():
        mine = torch.empty(MIB, dtype=torch.uint8)
        maker = threading.Thread(target=lambda: made.append(torch.empty(2 * MIB, dtype=torch.uint8)))
        maker.start()
        maker.join()
        del mine  # the first event after the other thread's block: the meter counts that block just before it
    made.clear()
    # Both blocks were alive between the other thread's allocation and this thread's free.
    assert meter.reading().peak_bytes == 3 * MIB


def test_the_allocators_flag_is_put_back_after_a_span() -> None:
    flag = _report_flag()
    assert flag is not None  # the CPU build's libc10 exports it (the truths of tests/autotune/_*_worker.py set it)
    before = flag.value
    meter = CompiledCpuMeter(budget_bytes=1 << 30)
    with meter.measure():
        assert flag.value
    assert flag.value == before


def test_a_block_allocated_on_another_thread_has_its_place_in_the_breakdown() -> None:
    """The breakdown replays the events the meter counts: the other thread's block (which the profiler did not
    record; op-level checkpointing in a compiled graph makes such blocks) is a block of its own from just before the
    next event, so the parts still sum to the meter's peak and the trial is broken down (it was not before)."""
    from autotune.measure.breakdown import BreakdownRecorder

    meter = CompiledCpuMeter(budget_bytes=1 << 30)
    recorder = BreakdownRecorder()
    made: list[torch.Tensor] = []
    with recorder.recording(meter), meter.measure():
        recorder.phase("forward")
        mine = torch.empty(MIB, dtype=torch.uint8)
        maker = threading.Thread(target=lambda: made.append(torch.empty(2 * MIB, dtype=torch.uint8)))
        maker.start()
        maker.join()
        del mine
    made.clear()
    peak = meter.reading().peak_bytes
    breakdown = recorder.breakdown(1, True, peak)
    assert peak == 3 * MIB
    assert breakdown is not None and sum(breakdown.parts.values()) == 3 * MIB
    # The timeline's last point: the other thread's 2 MiB, still alive after this thread's block was freed.
    assert sum(breakdown.timeline[-1][1:]) == 2 * MIB
