"""One rank of two real 4-process jobs on gloo under DDP over a data-parallel dimension of 2 (spawned by
test_ddp_buckets_meshes.py): tp 2 x ddp 2 and pp 2 x ddp 2. The truth for DDP's gradient buckets under ``--tp`` and
``--pp`` with ``--strategy ddp``, sharing no code with the probe:

- **tp 2 x ddp 2**: a ``(dp, tp)`` device mesh; the tiny Llama of tests/autotune/_pipeline_fsdp_worker.py
  (``TpLlama``, its blocks taking a per-head plan) built the ordinary way, its blocks parallelized by torch's
  ``parallelize_module`` over the tp sub-mesh (q, k, v, w1, w3 column-wise, o and w2 row-wise), then wrapped in
  ``DistributedDataParallel(device_mesh=mesh["dp"])``, torch's own TP + DDP path (it swaps each DTensor parameter
  for its local tensor before building the reducer); AdamW over the wrapper's parameters, made before the first
  forward; 2 micro-batches (the first under ``no_sync``), the loss halved, an optimizer step and ``zero_grad``,
  twice.
- **pp 2 x ddp 2** (1F1B, K = 2): a ``(pp, dp)`` mesh; each stage's module cut by hand from the tiny Llama of
  tests/autotune/_pipeline_worker.py (``_stage_model``), wrapped in ``DistributedDataParallel`` over the dp
  sub-mesh's group and run by ``PipelineStage`` / ``Schedule1F1B`` over the pp group (torch's pipelining runs the
  forwards and every backward but the step's last under ``no_sync``); AdamW, two steps.

The peak is the CPU allocator's own running total with c10's flag ``caffe2_report_cpu_memory_usage`` on (every thread's
frees counted), over the model's build and two steps (``_pipeline_worker.profiled_peak_bytes``), one run per size after
one at the first size that makes the first step's one-time allocations: the groups have one gloo thread and each
collective is waited and fenced as it is issued (tests/autotune/_ordered_gloo.py: gloo's thread used to drop a
collective's input late in some runs); every run's figure is written (``runs`` of them),
and the bytes of the parameters DDP reduces on the rank (its one bucket per dtype: the local shards under tp, the
stage's own under pp)."""

from __future__ import annotations

import functools
import gc
import json
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.autotune import _pipeline_fsdp_worker as tp_models
from tests.autotune import _pipeline_worker as pp_models
from tests.autotune._ordered_gloo import collectives_in_order, one_thread_groups, warmed_up

TP, PP = 2, 2


def _tp_model(mesh: Any) -> DistributedDataParallel:
    from torch.distributed.tensor.parallel import parallelize_module

    model = tp_models.TpLlama(tp_models.LAYERS)
    parallelize_module(
        model, mesh["tp"], {f"layers.*.{name}": style for name, style in tp_models.block_tp_plan().items()}
    )
    return DistributedDataParallel(model.train(), device_mesh=mesh["dp"])


def _tp_steps(mesh: Any, micro_batch: int, buckets: dict[str, int]) -> None:
    model = _tp_model(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    buckets["tp"] = sum(p.numel() * p.element_size() for p in model._module_parameters if p.requires_grad)
    for _ in range(2):
        for index in range(2):
            with model.no_sync() if index == 0 else nullcontext():
                inputs, targets = pp_models.make_batch(micro_batch)
                loss = pp_models.lm_loss(model(inputs), targets) / 2
                loss.backward()
                del inputs, targets, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del model, optimizer


def _pp_steps(mesh: Any, micro_batch: int, microbatches: int, buckets: dict[str, int]) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage_index = mesh["pp"].get_local_rank()
    module = pp_models._stage_model(stage_index, PP, pp_models.LAYERS)
    model = DistributedDataParallel(module, process_group=mesh["dp"].get_group())
    # Static shapes (on meta: no storage): torch's metadata inference runs the stage's forward outside no_sync, which
    # leaves DDP's reducer expecting a backward, and the step's first backward then breaks its bucket rebuild (an
    # internal assert, "rebuilt parameter indices size is not same as original model parameters size").
    hidden = torch.empty((micro_batch, pp_models.SEQ_LEN, pp_models.DIM), device="meta", requires_grad=True)
    if stage_index == 0:
        example_in = torch.empty((micro_batch, pp_models.SEQ_LEN), dtype=torch.long, device="meta")
        example_out = hidden
    else:
        example_in, example_out = hidden, torch.empty((micro_batch, pp_models.SEQ_LEN, pp_models.VOCAB), device="meta")
    stage = PipelineStage(
        model,
        stage_index,
        PP,
        torch.device("cpu"),
        input_args=example_in,
        output_args=example_out,
        group=mesh["pp"].get_group(),
    )
    schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=pp_models.lm_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    buckets["pp"] = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    pp_models.train_two_steps(schedule, stage_index == 0, microbatches, micro_batch, [optimizer])
    del schedule, stage, optimizer, model, module


def run(
    rank: int,
    world_size: int,
    rendezvous: str,
    out_dir: str,
    tp_sizes: list[int],
    pp_sizes: list[int],
    microbatches: int,
    runs: int,
) -> None:
    """This rank's peaks: {"tp/m": first run's, "pp/m": first run's} to rank{rank}.json, every run's to
    rank{rank}.runs.json, the bytes DDP reduces on this rank (its buckets' size) to rank{rank}.buckets.json."""
    gc.freeze()  # the imports are never this rank's garbage: each collection walks only what the job made
    try:
        pp_models.count_every_thread()
        from torch.distributed.device_mesh import init_device_mesh

        one_thread_groups()  # every gloo group this rank makes: one worker thread
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
        try:
            torch.manual_seed(rank)
            tp_mesh = init_device_mesh("cpu", (world_size // TP, TP), mesh_dim_names=("dp", "tp"))
            pp_mesh = init_device_mesh("cpu", (PP, world_size // PP), mesh_dim_names=("pp", "dp"))
            buckets: dict[str, int] = {}
            every: dict[str, list[int]] = {}

            def peak_bytes(job: Any) -> int:
                def ordered() -> None:
                    with collectives_in_order():
                        job()

                return pp_models.profiled_peak_bytes(ordered)

            # The first step's one-time allocations, each job's.
            warmed_up(functools.partial(_tp_steps, tp_mesh, tp_sizes[0], buckets))
            warmed_up(functools.partial(_pp_steps, pp_mesh, pp_sizes[0], microbatches, buckets))
            for m in tp_sizes:
                tp_job = functools.partial(_tp_steps, tp_mesh, m, buckets)
                every[f"tp/{m}"] = [peak_bytes(tp_job) for _ in range(runs)]
            for m in pp_sizes:
                pp_job = functools.partial(_pp_steps, pp_mesh, m, microbatches, buckets)
                every[f"pp/{m}"] = [peak_bytes(pp_job) for _ in range(runs)]
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps({key: r[0] for key, r in every.items()}))
            Path(out_dir, f"rank{rank}.runs.json").write_text(json.dumps(every))
            Path(out_dir, f"rank{rank}.buckets.json").write_text(json.dumps(buckets))
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
