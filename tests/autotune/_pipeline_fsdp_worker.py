"""One rank of a real pipeline over FSDP2 and/or tp on gloo: pp 2 x dp 2, pp 2 x tp 2, pp 2 x dp 2 x tp 2 (spawned by
test_pipeline_fsdp.py and bench/pipeline_meshes.py).

The truth for ``--strategy fsdp --pp 2 --world-size 4`` (and, with ``tp``, for ``--pp 2 --tp 2``: a stage's blocks
parallelized by ``parallelize_module`` over the tp sub-mesh first, torchtitan's ``apply_tp``), sharing no code with the
probe, built as torchtitan builds it: a ``(pp, dp)`` device mesh; rank r runs pipeline stage ``r // 2`` and is rank ``r
% 2`` of its data-parallel group. Each stage's module is the tiny Llama of tests/autotune/_pipeline_worker.py built on
``meta`` and cut by hand (the stage's blocks kept, the embedding None past the first stage, the norm and the head None
before the last), each block then the root wrapped by ``fully_shard`` over the dp sub-mesh (the last block not resharded
after forward, torchtitan's ``apply_fsdp``), then given storage with ``to_empty`` (only the shards are ever made) and
small normal values; ``PipelineStage`` over the pp sub-mesh's group with ``Schedule1F1B`` (torch's pipelining keeps
every micro-batch's gradient unsharded and the parameters gathered until the step's last backward, then reduce-scatters
once: ``perform_reduce_grad``), an AdamW step and ``zero_grad``, twice. The peak is the CPU allocator's own running
total with c10's flag ``caffe2_report_cpu_memory_usage`` on (every thread's frees counted), one run per size after one
at m = 1 that makes the first step's one-time allocations: the groups have one gloo thread and each collective is waited
and fenced as it is issued (tests/autotune/_ordered_gloo.py), so gloo's late releases no longer move a run's figure.
FSDP2's all-gather is written straight into its output, as NCCL writes it (:func:`_in_place_all_gather`: gloo's own
makes two transient copies of the whole output that a card's job does not). ``ScheduleGPipe`` runs the same way;
``ScheduleInterleaved1F1B`` with V 2 stages per rank (r, r + pp) of a 4-block model, each stage's module sharded on its
own with its own optimizer (torchtitan's model parts)."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import _disable_current_modes

from tests.autotune._ordered_gloo import collectives_in_order, compiled_waits_fenced, one_thread_groups, warmed_up
from tests.autotune._pipeline_worker import (
    DIM,
    HEADS,
    INTERLEAVED_LAYERS,
    INTERLEAVED_VIRTUAL,
    LAYERS,
    Block,
    TinyLlama,
    _rotate_half,
    count_every_thread,
    cut_to_stage,
    lm_loss,
    profiled_peak_bytes,
    train_two_steps,
)

RUNS_PER_SIZE = 1


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


class TpBlock(Block):
    """The tiny Llama's block with each rank's share of the heads: q, k, v column-wise and o row-wise under
    tensor parallelism hold DIM / tp of the width, so the heads are counted from the local width."""

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = h.shape
        x = self.attention_norm(h)
        q, k, v = (w(x).view(batch, length, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.wo(attention.transpose(1, 2).reshape(batch, length, -1))
        x = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))


class TpLlama(TinyLlama):
    """The tiny Llama whose blocks take a tensor-parallel plan (:data:`TP_PLAN`)."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__(layers)
        self.layers = nn.ModuleList(TpBlock() for _ in range(layers))


# transformers' names for the styles (the probe's task plan); the truth applies PyTorch's own ParallelStyles.
TP_PLAN = {
    **{f"layers.*.{name}": "colwise" for name in ("wq", "wk", "wv", "w1", "w3")},
    **{f"layers.*.{name}": "rowwise" for name in ("wo", "w2")},
}


def block_tp_plan() -> dict[str, Any]:
    """:data:`TP_PLAN` in PyTorch's own ParallelStyles, for one ``TpBlock``: q, k, v, w1, w3 column-wise, o and w2
    row-wise (torchtitan's apply_tp)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {name: ColwiseParallel() for name in ("wq", "wk", "wv", "w1", "w3")}
    plan.update({name: RowwiseParallel() for name in ("wo", "w2")})
    return plan


def sp_plan() -> dict[str, Any]:
    """Sequence and loss parallel over the tiny Llama, in PyTorch's own styles, by module pattern (the probe's task
    gives the same plan as its ``tp_plan``): the embedding's output reduce-scattered onto the sequence, the norms
    sequence-parallel, q/k/v and w1/w3 column-wise over their input all-gathered from the sequence shards, o and w2
    row-wise reduce-scattered back onto the sequence (the residual stream a DTensor sharded on the sequence), the
    head column-wise over the gathered sequence with its logits kept sharded by vocabulary for loss_parallel()."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for name in ("attention_norm", "ffn_norm"):
        plan[f"layers.*.{name}"] = SequenceParallel()
    for name in ("wq", "wk", "wv", "w1", "w3"):
        plan[f"layers.*.{name}"] = ColwiseParallel(input_layouts=Shard(1))
    for name in ("wo", "w2"):
        plan[f"layers.*.{name}"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


class SpLlama(TpLlama):
    """The tiny Llama as a sequence-parallel stage runs it under PipelineStage: the activation received from the
    previous stage is this rank's positions of the residual stream (made a DTensor sharded on the sequence), and a
    stage that ends before the head sends its local positions."""

    tp_mesh: Any = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        if self.tok_embeddings is None:
            tokens = DTensor.from_local(tokens, self.tp_mesh, [Shard(1)], run_check=False)
        out = super().forward(tokens)
        return out.to_local() if self.output is None else out  # type: ignore[union-attr]


def _sp_stage_model(stage: int, stages: int, mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    with torch.device("meta"):
        model = cut_to_stage(SpLlama(LAYERS), stage, stages)
    model.tp_mesh = mesh["tp"]
    held = {name for name, _ in model.named_modules()}
    # The plan's entries for the modules this stage holds, a block's star as each of its blocks' indices.
    plan = {
        name: style
        for pattern, style in sp_plan().items()
        for name in {pattern.replace("*", str(index)) for index in range(len(model.layers))}
        if name in held
    }
    parallelize_module(model, mesh["tp"], plan)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            (param.to_local() if hasattr(param, "to_local") else param).normal_(0.0, 0.02)
    return model.train()


def _outside_modes(forward: Any) -> Any:
    """A compiled block's forward run with no dispatch mode on: dynamo compiles nothing under one
    (collectives_in_order's), and the block's graph issues no collective (FSDP2's are in its hooks, outside)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return forward(*args, **kwargs)

    return call


@functools.cache
def tp_mesh_of(mesh: Any) -> Any:
    """The tp sub-mesh, sliced once for the job's life as torchtitan slices it: a slice is a new object each time,
    a parameter's DTensor spec keeps the first one it was made with, and a compiled block guards on whether its
    hooks' mesh is its parameters' (stages built over fresh slices would recompile after the first)."""
    return mesh["tp"]


def _stage_model(
    stage: int, stages: int, mesh: Any, tp: int, layers: int = LAYERS, compiled: bool = False
) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    with torch.device("meta"):
        model = cut_to_stage(TpLlama(layers) if tp > 1 else TinyLlama(layers), stage, stages)
    if tp > 1:  # torchtitan's apply_tp, then apply_compile, then apply_fsdp over dp
        for block in model.layers:
            parallelize_module(block, tp_mesh_of(mesh), block_tp_plan())
    if compiled:  # torchtitan's apply_compile (each block compiled, put back in its place)
        for index, layer in enumerate(model.layers):
            block = torch.compile(layer)
            block.forward = _outside_modes(block.forward)  # type: ignore[method-assign]
            model.layers.register_module(str(index), block)
    blocks = list(model.layers)
    if mesh["dp"].size() > 1:
        for index, block in enumerate(blocks):
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=index < len(blocks) - 1)
        fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            (param.to_local() if hasattr(param, "to_local") else param).normal_(0.0, 0.02)
    return model.train()


def _steps(
    mesh: Any,
    microbatches: int,
    micro_batch: int,
    schedule_name: str,
    sequence_parallel: bool = False,
    compiled: bool = False,
) -> None:
    rank, ranks = mesh["pp"].get_local_rank(), mesh["pp"].size()
    tp = mesh["tp"].size() if "tp" in mesh.mesh_dim_names else 1
    # Interleaved: rank r holds stages r, r + pp, ... of a deeper model, each sharded on its own as a separate model
    # part with its own optimizer (torchtitan's model_parts).
    virtual = INTERLEAVED_VIRTUAL if schedule_name == "interleaved-1f1b" else 1
    layers = INTERLEAVED_LAYERS if virtual > 1 else LAYERS
    indices = [rank + chunk * ranks for chunk in range(virtual)]
    if sequence_parallel:
        models = [_sp_stage_model(index, ranks, mesh) for index in indices]
    else:
        models = [_stage_model(index, ranks * virtual, mesh, tp, layers, compiled) for index in indices]
    stages: list[Any] = [
        PipelineStage(model, index, ranks * virtual, torch.device("cpu"), group=mesh["pp"].get_group())
        for model, index in zip(models, indices, strict=True)
    ]
    if virtual > 1:
        schedule: Any = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=lm_loss)
    else:
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule_name]
        schedule = kind(stages[0], n_microbatches=microbatches, loss_fn=lm_loss)
    optimizers: list[torch.optim.Optimizer] = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in models]
    # Loss parallel: the last stage's cross entropy on the vocabulary shards, forward and backward in its context.
    with loss_parallel() if sequence_parallel else contextlib.nullcontext():
        train_two_steps(schedule, rank == 0, microbatches, micro_batch, optimizers)
    del schedule, stages, optimizers, models


def _peak_bytes(
    mesh: Any,
    microbatches: int,
    micro_batch: int,
    schedule_name: str,
    sequence_parallel: bool = False,
    compiled: bool = False,
) -> int:
    tp = mesh["tp"].size() if "tp" in mesh.mesh_dim_names else 1
    # A compiled tp block's collectives are in its graph, where collectives_in_order does not see them: their waits
    # fence the tp group instead (gloo's worker thread let go of one 4 KiB all-reduce output late, one cold run in two).
    in_graph = compiled_waits_fenced(tp_mesh_of(mesh).get_group()) if compiled and tp > 1 else contextlib.nullcontext()

    def steps() -> None:
        with collectives_in_order(), in_graph:
            _steps(mesh, microbatches, micro_batch, schedule_name, sequence_parallel, compiled)

    return profiled_peak_bytes(steps)


def run(
    rank: int,
    world_size: int,
    stages: int,
    rendezvous: str,
    out_dir: str,
    k: int,
    sizes: list[int],
    schedule_name: str = "1f1b",
    tp: int = 1,
    runs_per_size: int = RUNS_PER_SIZE,
    sequence_parallel: bool = False,
    compiled: bool = False,
) -> None:
    """This rank's peak under ``schedule_name`` (1f1b, gpipe, interleaved-1f1b: V 2 stages per rank of a 4-block
    model) at each size (its first run's) to rank{rank}.json, every one of ``runs_per_size`` runs' to
    rank{rank}.runs.json. ``tp`` > 1: a ``(pp, dp, tp)`` mesh, the stage's blocks
    parallelized over tp (q, k, v and the MLP's w1, w3 column-wise, o and w2 row-wise) before fsdp over dp (none where
    dp is 1); with ``sequence_parallel`` (1F1B, dp 1), sequence and loss parallel instead (:func:`sp_plan`)."""
    gc.freeze()  # the imports are never this rank's garbage: each collection walks only what the job made
    try:
        count_every_thread()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        _fsdp_collectives.DefaultAllGather.__call__ = _in_place_all_gather  # type: ignore[method-assign,assignment]

        one_thread_groups()  # every gloo group this rank makes: one worker thread
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
        try:
            torch.manual_seed(rank)
            if tp > 1:  # pp x dp x tp, the tiny Llama's blocks tensor-parallel over tp
                shape = (stages, world_size // (stages * tp), tp)
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
            else:
                mesh = init_device_mesh("cpu", (stages, world_size // stages), mesh_dim_names=("pp", "dp"))
            runs = {}
            for index, m in enumerate(sizes):
                # A compiled job at m: a fresh compiler (as a fresh process has; a graph made for another size first
                # would be dynamic) compiles at m in its first steps, which run first: the job is measured where its
                # compilation has settled.
                if compiled:
                    torch._dynamo.reset()
                if index == 0 or compiled:
                    warm_size = m if compiled else 1
                    warmed_up(functools.partial(_steps, mesh, k, warm_size, schedule_name, sequence_parallel, compiled))
                runs[m] = [
                    _peak_bytes(mesh, k, m, schedule_name, sequence_parallel, compiled) for _ in range(runs_per_size)
                ]
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps({str(m): r[0] for m, r in runs.items()}))
            Path(out_dir, f"rank{rank}.runs.json").write_text(json.dumps({str(m): r for m, r in runs.items()}))
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
