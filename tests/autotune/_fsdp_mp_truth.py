"""One rank of a real 2-process FSDP2 job on gloo, bf16 as torchtitan runs it (spawned by test_fsdp.py).

The truth for ``--strategy fsdp --precision bf16``, sharing no code with the probe: the GPT built the ordinary
way, each block then the root wrapped by ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``, the last block with ``reshard_after_forward=False`` (torchtitan's ``apply_fsdp``), no
autocast; 2 micro-batches forward and backward, an AdamW step, zero_grad, twice. The peak is the CPU
allocator's own count (torch.profiler's memory events summed in order), rank 0's written to a file.

Each size runs until a run peaks at or below the figure asked about, at most MAX_REPEATS times: with real
collectives the peak varies from run to run (seen: +0, +199,936,
+347,904 and +443,904 bytes at m = 4, all on the main thread; 199,936 bytes is one block's unsharded fp32
gradient, the reduce-scatter's input, held longer or shorter, most likely as gloo completes it), and every run
can reach the same floor, the order in which each collective is done when issued (about one run in three
reaches it here). That floor is what one process with a fake group measures; every run is reported, and the
test asserts the floor is reached and no run is below it.
"""

from __future__ import annotations

import gc
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from examples import gpt

MAX_REPEATS = 16


def run(rank: int, world_size: int, rendezvous: str, out_dir: str, floors: dict[int, int]) -> None:
    try:
        _run(rank, world_size, rendezvous, out_dir, floors)
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


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


def _peak_bytes(mesh: object, micro_batch: int) -> int:
    gc.collect()  # an earlier run's cyclic garbage freed inside the profile would count low
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _steps(mesh, micro_batch)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def _runs(mesh: object, micro_batch: int, floor: int) -> list[int]:
    """Peaks of runs at micro_batch until one is at or below floor (every rank runs as many: rank 0 decides)."""
    peaks: list[int] = []
    while len(peaks) < MAX_REPEATS:
        peaks.append(_peak_bytes(mesh, micro_batch))
        done = torch.tensor([int(peaks[-1] <= floor)])
        dist.broadcast(done, src=0)
        if done.item():
            break
    return peaks


def _run(rank: int, world_size: int, rendezvous: str, out_dir: str, floors: dict[int, int]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world_size,))
        peaks = {m: _runs(mesh, m, floor) for m, floor in floors.items()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({str(m): p for m, p in peaks.items()}))
    finally:
        dist.destroy_process_group()
