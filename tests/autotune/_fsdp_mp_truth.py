"""One rank of a real 2-process FSDP2 job on gloo, bf16 as torchtitan runs it (spawned by test_fsdp.py).

The truth for ``--strategy fsdp --precision bf16``, sharing no code with the probe: the GPT built the ordinary
way, each block then the root wrapped by ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``, the last block with ``reshard_after_forward=False`` (torchtitan's ``apply_fsdp``), no
autocast; 2 micro-batches forward and backward, an AdamW step, zero_grad, twice. The peak is the CPU
allocator's own running total of allocated bytes, rank 0's written to a file; one run per size.

Why the allocator's total and not the sum of the profiler's memory events: the profiler records the
allocations and frees made on the threads it profiles. gloo's worker thread sometimes drops the last reference
to a tensor (a reduce-scatter's input, one block's unsharded fp32 gradient: 199,936 bytes on the 2-layer GPT),
and that free is no event, so the events' sum stays high for the rest of the run (+0 to +495,872 bytes seen,
run to run). c10's CPU allocator keeps a total of what it handed out and got back, and each ``[memory]`` event
carries it (``total_allocated``); but it counts only on profiled threads too, unless the flag
``caffe2_report_cpu_memory_usage`` is on (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter::New/Delete).
With the flag on from the rank's start, every thread's frees come off the total when they happen, and the
largest total over the run's events, less the total before its first, is the same in every run: what one
process with a fake group measures. (A peak made by an allocation on gloo's own thread would not be seen at
an event of a profiled thread; the probe does not model one either.)
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from examples import gpt


def run(rank: int, world_size: int, rendezvous: str, out_dir: str, sizes: list[int]) -> None:
    try:
        count_every_thread()
        _run(rank, world_size, rendezvous, out_dir, sizes)
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def count_every_thread() -> None:
    """Turn on c10's flag caffe2_report_cpu_memory_usage: the CPU allocator counts every thread's allocations
    and frees in its total, not only the profiled threads' (no Python API sets a c10 flag; libc10 exports it)."""
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _steps(mesh: object, micro_batch: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    task = gpt.make_task(precision="bf16")
    model = gpt.GPT(gpt.GPTConfig())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = list(model.blocks)
    for index, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        for _ in range(2):
            batch = task.batch(micro_batch)
            loss = task.compute_loss(model, batch) / 2
            loss.backward()
            del batch, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del model, optimizer


def _cpu_allocations(prof: Any) -> list[tuple[int, int, int]]:
    """(time, bytes allocated or freed, the allocator's total after it) of each CPU memory event, in order."""
    found, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            found.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
    return sorted(found)


def _peak_bytes(mesh: object, micro_batch: int) -> int:
    gc.collect()  # an earlier run's cyclic garbage freed inside the profile would count low
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _steps(mesh, micro_batch)
    events = _cpu_allocations(prof)
    _, first_bytes, first_total = events[0]
    before = first_total - first_bytes
    return max(total for _, _, total in events) - before


def _run(rank: int, world_size: int, rendezvous: str, out_dir: str, sizes: list[int]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world_size,))
        peaks = {m: _peak_bytes(mesh, m) for m in sizes}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({str(m): p for m, p in peaks.items()}))
    finally:
        dist.destroy_process_group()
