"""One rank of a real 2-process FSDP2 (or DDP) job on gloo, bf16 as torchtitan runs it by default (spawned by
test_fsdp.py, and by test_optimizer_ranks.py with an optimizer, a precision and a GPT config of its own).

The truth for ``--strategy fsdp --precision bf16``, sharing no code with the probe: the GPT built the ordinary
way, each block then the root wrapped by ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``, the last block with ``reshard_after_forward=False`` (torchtitan's ``apply_fsdp``), no
autocast; 2 micro-batches forward and backward, an AdamW step, zero_grad, twice. ``optimizer`` names one of
tests/autotune/_ordinary_optimizers.py's constructors (torch's or the library's own, not the project's spec);
``precision="fp32"`` wraps without a policy; ``strategy="ddp"`` wraps the whole model in DistributedDataParallel
instead, the first micro-batch under ``no_sync`` (one all-reduce per step, as the probe's ddp trial). The peak is
the CPU allocator's own running total of allocated bytes, rank 0's written to a file; one run per size, after one at
m = 1 that makes the first step's one-time allocations (below: why one is enough).

Why the allocator's total and not the sum of the profiler's memory events: the profiler records the
allocations and frees made on the threads it profiles. gloo's worker thread sometimes drops the last reference
to a tensor (a reduce-scatter's input, one block's unsharded fp32 gradient: 199,936 bytes on the 2-layer GPT),
and that free is no event, so the events' sum stays high for the rest of the run (+0 to +495,872 bytes seen,
run to run). c10's CPU allocator keeps a total of what it handed out and got back, and each ``[memory]`` event
carries it (``total_allocated``); but it counts only on profiled threads too, unless the flag
``caffe2_report_cpu_memory_usage`` is on (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter::New/Delete).
With the flag on from the rank's start, every thread's frees come off the total when they happen, and the
largest total over the run's events, less the total before its first, is what one process with a fake group
measures. (A peak made by an allocation on gloo's own thread would not be seen at an event of a profiled thread;
the probe does not model one either.)

Why one run per size: when gloo's thread dropped a collective's input late, after the main thread's next allocation,
the total held both for a moment (one run in three of fused AdamW under fsdp read 25,216 bytes more at m=4: 1,032,060
against 1,006,844). That is the timing of two threads, not the job, and it is removed at its cause: every group has
one gloo thread and each collective is waited and fenced as it is issued (tests/autotune/_ordered_gloo.py), so each
input is gone where the job drops it, as a card's caching allocator frees it on its stream's order and as the probe
counts it. rank{N}.runs.json keeps the run.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import os
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import _disable_current_modes

from examples import gpt
from tests.autotune._ordered_gloo import collectives_in_order, one_thread_groups, warmed_up
from tests.autotune._ordinary_checkpointing import checkpointed
from tests.autotune._ordinary_optimizers import DEFAULT, ORDINARY


@dataclass(frozen=True)
class Job:
    """What each rank runs: the optimizer's key in _ordinary_optimizers.ORDINARY (None: torch's AdamW), the
        precision ("bf16": FSDP2's policy, no autocast; "fp32": no policy), examples/gpt.py's GPTConfig fields
        (empty: its default), "fsdp" or "ddp", and a memory policy's name (tests/autotune/_ordinary_checkpointing.py:
    the blocks in torch's checkpoint_wrapper before FSDP2 shards them, as torchtitan applies it; None: none)."""

    optimizer: str | None = None
    precision: str = "bf16"
    gpt_config: dict[str, Any] = field(default_factory=dict)
    strategy: str = "fsdp"
    policy: str | None = None


def run(rank: int, world_size: int, rendezvous: str, out_dir: str, sizes: list[int], job: Job = Job()) -> None:
    gc.freeze()  # the imports are never this rank's garbage: each collection walks only what the job made
    try:
        count_every_thread()
        _run(rank, world_size, rendezvous, out_dir, sizes, job)
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def count_every_thread() -> None:
    """Turn on c10's flag caffe2_report_cpu_memory_usage: the CPU allocator counts every thread's allocations
    and frees in its total, not only the profiled threads' (no Python API sets a c10 flag; libc10 exports it)."""
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _wrapped(model: nn.Module, mesh: Any, job: Job) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if job.strategy == "ddp":
        return DistributedDataParallel(model)
    bf16 = job.precision == "bf16"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs: dict[str, Any] = {"mp_policy": policy} if policy is not None else {}
    blocks = list(model.blocks)  # type: ignore[arg-type]
    for index, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=index < len(blocks) - 1, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _optimizer(job: Job) -> Callable[[Any], torch.optim.Optimizer]:
    return DEFAULT if job.optimizer is None else ORDINARY[job.optimizer]


def _steps(mesh: Any, micro_batch: int, job: Job) -> None:
    config = gpt.GPTConfig(**job.gpt_config)
    task = gpt.make_task(config, precision=job.precision)
    model = gpt.GPT(config)
    if job.policy is not None:
        model = checkpointed(model, job.policy)
    model = _wrapped(model, mesh, job)
    model.train()
    optimizer = _optimizer(job)(model.parameters())
    for _ in range(2):
        for index in range(2):
            # ddp: the gradients all-reduce on the last micro-batch of the step only.
            sync = job.strategy != "ddp" or index == 1
            with nullcontext() if sync else model.no_sync():  # type: ignore[operator]
                batch = task.batch(micro_batch)
                loss = task.compute_loss(model, batch) / 2
                loss.backward()
                del batch, loss
        # torchao compiles its step, which dynamo refuses under a dispatch mode; no optimizer step issues a collective.
        with _disable_current_modes():
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


def _peak_bytes(mesh: object, micro_batch: int, job: Job) -> int:
    gc.collect()  # an earlier run's cyclic garbage freed inside the profile would count low
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, collectives_in_order():
        _steps(mesh, micro_batch, job)
    events = _cpu_allocations(prof)
    _, first_bytes, first_total = events[0]
    before = first_total - first_bytes
    return max(total for _, _, total in events) - before


def _run(rank: int, world_size: int, rendezvous: str, out_dir: str, sizes: list[int], job: Job) -> None:
    """One job per spawn: two jobs one after the other in the same processes do not peak as each alone does
    (fused AdamW after foreach=false under fsdp: +35,968 bytes at m=3)."""
    from torch.distributed.device_mesh import init_device_mesh

    one_thread_groups()  # every gloo group this rank makes: one worker thread
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world_size,))
        # A script imports its libraries before it trains: bitsandbytes' import makes two 64-byte code tables
        # (nf4, fp4) that live as long as the process, and an import inside the profile would count them.
        _optimizer(job)([nn.Parameter(torch.zeros(1))])
        warmed_up(functools.partial(_steps, mesh, 1, job))  # torchao compiles its step here
        peaks = {str(m): _peak_bytes(mesh, m, job) for m in sizes}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(peaks))
        Path(out_dir, f"rank{rank}.runs.json").write_text(json.dumps({m: [peak] for m, peak in peaks.items()}))
    finally:
        dist.destroy_process_group()
