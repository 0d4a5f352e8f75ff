"""One rank of a real 4-process pipeline over FSDP2 on gloo: pp 2 x dp 2 (spawned by test_pipeline_fsdp.py).

The truth for ``--strategy fsdp --pp 2 --world-size 4``, sharing no code with the probe, built as torchtitan
builds it: a ``(pp, dp)`` device mesh; rank r runs pipeline stage ``r // 2`` and is rank ``r % 2`` of its
data-parallel group. Each stage's module is the tiny Llama of tests/autotune/_pipeline_worker.py built on
``meta`` and cut by hand (the stage's blocks kept, the embedding None past the first stage, the norm and the head
None before the last), each block then the root wrapped by ``fully_shard`` over the dp sub-mesh (the last block
not resharded after forward, torchtitan's ``apply_fsdp``), then given storage with ``to_empty`` (only the shards
are ever made) and small normal values; ``PipelineStage`` over the pp sub-mesh's group with ``Schedule1F1B``
(torch's pipelining keeps every micro-batch's gradient unsharded and the parameters gathered until the step's
last backward, then reduce-scatters once: ``perform_reduce_grad``), an AdamW step and ``zero_grad``, twice. The
peak is the CPU allocator's own running total with c10's flag ``caffe2_report_cpu_memory_usage`` on (every
thread's frees counted), the least of three runs per size (tests/autotune/_fsdp_mp_truth.py says why: gloo's
thread drops a collective's input late in some runs); every run's figure is written beside it. FSDP2's
all-gather is written straight into its output, as NCCL writes it (:func:`_in_place_all_gather`: gloo's own makes
two transient copies of the whole output that a card's job does not). ``ScheduleGPipe`` runs the same way.
"""

from __future__ import annotations

import gc
import json
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.profiler import ProfilerActivity, profile

from tests.autotune._pipeline_worker import LAYERS, TinyLlama, count_every_thread, lm_loss, make_batch

RUNS_PER_SIZE = 3


def _in_place_all_gather(
    self: Any, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
) -> None:
    """FSDP2's all-gather written straight into its output, as NCCL writes it on a card: gloo's
    ``all_gather_into_tensor`` makes two transient copies of the whole output on the CPU (a flat output and its
    copy; 65,792 bytes each for one block of the tiny Llama, seen in a 2-process profile of the call alone), which a
    card's job does not make, and which crossed the stage's peak here. Each rank sends its shard to each peer and
    receives each peer's into its own slice of the output (gloo's send and receive use the tensors' memory)."""
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    chunks = output_tensor.chunk(len(ranks))
    with torch.no_grad():
        chunks[me].copy_(input_tensor)
    ops = []
    for peer, global_rank in enumerate(ranks):
        if peer != me:
            ops.append(dist.P2POp(dist.isend, input_tensor, global_rank, group))
            ops.append(dist.P2POp(dist.irecv, chunks[peer], global_rank, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _stage_model(stage: int, stages: int, dp_mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = TinyLlama(LAYERS)
    per_stage = [len(part) for part in torch.arange(LAYERS).tensor_split(stages)]
    start = sum(per_stage[:stage])
    model.layers = nn.ModuleList(list(model.layers)[start : start + per_stage[stage]])
    if stage > 0:
        model.tok_embeddings = None
    if stage < stages - 1:
        model.norm = None
        model.output = None
    blocks = list(model.layers)
    for index, block in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=index < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0.0, 0.02)
    return model.train()


def _steps(mesh: Any, microbatches: int, micro_batch: int, schedule_name: str) -> None:
    stage_index, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    model = _stage_model(stage_index, stages, mesh["dp"])
    stage = PipelineStage(model, stage_index, stages, torch.device("cpu"), group=mesh["pp"].get_group())
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule_name]
    schedule = kind(stage, n_microbatches=microbatches, loss_fn=lm_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        inputs, targets = make_batch(microbatches * micro_batch)
        if stage_index == 0:
            schedule.step(inputs, return_outputs=False)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=targets, losses=losses, return_outputs=False)
            del losses
        del inputs, targets
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del schedule, stage, optimizer, model


def _peak_bytes(mesh: Any, microbatches: int, micro_batch: int, schedule_name: str) -> int:
    gc.collect()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _steps(mesh, microbatches, micro_batch, schedule_name)
    dist.barrier()
    events = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        if "Allocation" in str(node.tag) and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
    events.sort()
    _, first_bytes, first_total = events[0]
    return max(total for _, _, total in events) - (first_total - first_bytes)


def run(
    rank: int,
    world_size: int,
    stages: int,
    rendezvous: str,
    out_dir: str,
    k: int,
    sizes: list[int],
    schedule_name: str = "1f1b",
) -> None:
    """This rank's peak under ``schedule_name`` (1f1b, gpipe) at each size (the least of RUNS_PER_SIZE runs) to
    rank{rank}.json, every run's to rank{rank}.runs.json."""
    try:
        count_every_thread()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        _fsdp_collectives.DefaultAllGather.__call__ = _in_place_all_gather  # type: ignore[method-assign,assignment]

        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
        try:
            torch.manual_seed(rank)
            mesh = init_device_mesh("cpu", (stages, world_size // stages), mesh_dim_names=("pp", "dp"))
            runs = {m: [_peak_bytes(mesh, k, m, schedule_name) for _ in range(RUNS_PER_SIZE)] for m in sizes}
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps({str(m): min(r) for m, r in runs.items()}))
            Path(out_dir, f"rank{rank}.runs.json").write_text(json.dumps({str(m): r for m, r in runs.items()}))
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
