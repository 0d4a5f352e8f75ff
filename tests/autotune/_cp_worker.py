"""One rank of a real context-parallel job on gloo (spawned by test_context_parallel.py): the truth for --cp.

Shares no measuring code with the probe: a tiny Llama built the ordinary way
(``LlamaForCausalLM(LlamaConfig(..., attn_implementation="sdpa"))``), each attention module's mask dropped for
``is_causal=True`` by a pre-hook (accelerate's ``_attach_context_parallel_hooks``, written out), DDP over every
rank (or, with ``inner`` "fsdp", FSDP2 over every rank as torchtitan shards over its dp_shard_cp mesh: each
decoder layer, the last kept unsharded after forward, then the root), and each micro-batch prepared the way
transformers' Trainer prepares one for context parallelism (``shift_labels`` padded with -100 and shifted,
``position_ids`` an expanded ``arange``) and run under PyTorch's ``context_parallel(mesh, buffers=[input_ids,
labels, shift_labels, position_ids], buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=...)`` around forward and
backward (DDP: no_sync on the first micro-batch; FSDP2 reduce-scatters after each); 2 micro-batches, an AdamW step,
zero_grad, twice. torch's defaults: the head-tail load balancer, the ``allgather`` rotation (or the one asked for).

What it does share is the job's CPU attention kernel (autotune/measure/context_parallel.py's
``install_cpu_flash_attention``): torch's ring attention calls CUDA-only flash kernels, so without that adapter
this job cannot run on the CPU at all. It measures nothing.

Each rank's peak is the CPU allocator's own count: its running total (``total_allocated``, which each memory event
carries), with c10's flag ``caffe2_report_cpu_memory_usage`` on from the rank's start so that the frees gloo's threads
make come off it, less the total before the run's first event. The groups have one gloo thread and each collective is
waited and fenced as it is issued (tests/autotune/_ordered_gloo.py: gloo's late releases made a run read 12-36 KB above
the floor about one time in three), so each size runs once, after one run at m = 1 that makes the first step's one-time
allocations; every rank's figure is reported. With ``ring``, the same processes then check torch's ring attention on the
CPU kernel against plain SDPA (one spawn for both: each start imports torch and transformers again)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import _disable_current_modes

from tests.autotune._ordered_gloo import collectives_in_order, one_thread_groups, warmed_up


def run(
    rank: int,
    world_size: int,
    seq_len: int,
    rendezvous: str,
    out_dir: str,
    config: dict[str, Any],
    sizes: list[int],
    rotation: str = "allgather",
    ring: bool = False,
    inner: str = "ddp",
    tp: int = 1,
    optimizer: str | None = None,
) -> None:
    """The job at each size (rank 0 writes every rank's peak per size to peaks.json) under DDP or (inner "fsdp") FSDP2
    over the cp ranks, with tp > 1 each cp rank's model parallelized over tp ranks (a (cp, tp) mesh, world_size = cp x
    tp); with ring, then check_ring's comparison in the same processes (rank 0 writes ring.json): one spawn for both.
    ``optimizer``: a key of tests/autotune/_ordinary_optimizers.py's ORDINARY (the library's own class), else torch's
    AdamW."""
    gc.freeze()  # the imports are never this rank's garbage: each collection walks only what the job made
    try:
        _run(rank, world_size, seq_len, rendezvous, out_dir, config, sizes, rotation, ring, inner, tp, optimizer)
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def _drop_mask(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = None
        kwargs["is_causal"] = True
    return args, kwargs


def _model(mesh: Any, config: dict[str, Any], inner: str) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.autotune._tp_worker import llama_plan

    model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa"))  # type: ignore[call-arg]
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(_drop_mask, with_kwargs=True)
    model.train()
    if "tp" in mesh.mesh_dim_names:  # transformers' Llama plan over the tp ranks, as the tp truth parallelizes
        parallelize_module(model, mesh["tp"], llama_plan(model), src_data_rank=None)
    if inner == "ddp" and "tp" in mesh.mesh_dim_names:
        # torch's TP + DDP: DDP over the data-parallel ranks (here the cp ranks, which hold the same parameters) of a
        # 1-D mesh swaps each DTensor parameter for its local shard (_pre_dp_module_transform).
        return DistributedDataParallel(model, device_mesh=mesh["cp"])
    if inner == "ddp":
        return DistributedDataParallel(model)
    # FSDP2 over the cp ranks (they hold the same parameters; with no dp ranks here they are torchtitan's
    # dp_shard_cp), torchtitan's way: each decoder layer, the last one kept unsharded after forward, then the root.
    layers = list(model.model.layers)
    for index, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh["cp"], reshard_after_forward=index < len(layers) - 1)
    fully_shard(model, mesh=mesh["cp"])
    return model


def _steps(
    mesh: Any, config: dict[str, Any], seq_len: int, micro_batch: int, inner: str, optimizer_key: str | None = None
) -> None:
    from torch.distributed.tensor.experimental import context_parallel

    from tests.autotune._ordinary_optimizers import DEFAULT, ORDINARY

    model: Any = _model(mesh, config, inner)
    optimizer = (ORDINARY[optimizer_key] if optimizer_key else DEFAULT)(model.parameters())
    generator = torch.Generator().manual_seed(micro_batch)
    for _ in range(2):
        for index in range(2):
            # DDP all-reduces the last micro-batch's gradients only; FSDP2 reduce-scatters after each (torchtitan).
            with model.no_sync() if index == 0 and inner == "ddp" else contextlib.nullcontext():
                input_ids = torch.randint(0, config["vocab_size"], (micro_batch, seq_len), generator=generator)
                labels = input_ids.clone()
                shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
                position_ids = torch.arange(seq_len).expand(micro_batch, -1)
                buffers = [input_ids, labels, shift_labels, position_ids]
                with context_parallel(
                    mesh["cp"], buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
                ):
                    loss = (
                        model(
                            input_ids=input_ids, labels=labels, shift_labels=shift_labels, position_ids=position_ids
                        ).loss
                        / 2
                    )
                    loss.backward()
                del input_ids, labels, shift_labels, position_ids, buffers, loss
        # torchao compiles its step, which dynamo refuses under a dispatch mode (collectives_in_order's); the step
        # issues no collective.
        with _disable_current_modes():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del model, optimizer


def _count_every_thread() -> None:
    """c10's flag caffe2_report_cpu_memory_usage on: the CPU allocator's total counts every thread's frees."""
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _peak_bytes(
    mesh: Any, config: dict[str, Any], seq_len: int, micro_batch: int, inner: str, optimizer: str | None
) -> int:
    gc.collect()  # an earlier run's cyclic garbage freed inside the profile would count low
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, collectives_in_order():
        _steps(mesh, config, seq_len, micro_batch, inner, optimizer)
    found, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            found.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
    found.sort()
    _, first_bytes, first_total = found[0]
    return max(total for _, _, total in found) - (first_total - first_bytes)


def _every_rank(peak_bytes: int) -> list[int]:
    mine = torch.tensor([peak_bytes])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(peak.item()) for peak in every]


def _run(
    rank: int,
    world_size: int,
    seq_len: int,
    rendezvous: str,
    out_dir: str,
    config: dict[str, Any],
    sizes: list[int],
    rotation: str,
    ring: bool,
    inner: str,
    tp: int,
    optimizer: str | None,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    from autotune.measure.context_parallel import install_cpu_flash_attention

    _count_every_thread()
    install_cpu_flash_attention()
    set_rotate_method(rotation)
    one_thread_groups()  # every gloo group this rank makes: one worker thread
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        if tp > 1:  # tp innermost, as torchtitan lays out its mesh
            mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("cp", "tp"))
        else:
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
        warmed_up(functools.partial(_steps, mesh, config, seq_len, 1, inner, optimizer))
        peaks = {str(m): _every_rank(_peak_bytes(mesh, config, seq_len, m, inner, optimizer)) for m in sizes}
        if rank == 0:
            Path(out_dir, "peaks.json").write_text(json.dumps(peaks))
        if ring:
            _check_ring(mesh["cp"], rank, out_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check_ring(mesh: Any, rank: int, out_dir: str) -> None:
    """torch's ring attention on the CPU kernel against plain SDPA, under each rotation: causal attention over
    (2, 4, 32, 8) query, key and value sharded as context_parallel shards them (head-tail), forward and backward,
    gathered back with context_parallel_unshard; rank 0 writes the largest differences by rotation."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    differences = {}
    for rotation in ("allgather", "alltoall"):
        set_rotate_method(rotation)
        differences[rotation] = _ring_differences(mesh)
    if rank == 0:
        Path(out_dir, "ring.json").write_text(json.dumps(differences))


def _ring_differences(mesh: Any) -> list[float]:
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 32, 8, generator=generator) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], is_causal=True)
    expected.backward(grad)
    sharded = [t.clone() for t in (q, k, v, grad)]
    with context_parallel(mesh, buffers=sharded, buffer_seq_dims=[2, 2, 2, 2]):
        local = [t.detach().clone().requires_grad_() for t in sharded[:3]]
        out = torch.nn.functional.scaled_dot_product_attention(local[0], local[1], local[2], is_causal=True)
        out.backward(sharded[3])
        grads: list[torch.Tensor] = [t.grad for t in local]  # type: ignore[misc]
        gathered = context_parallel_unshard(mesh, [out.detach(), *grads], [2, 2, 2, 2])
    wanted = [expected.detach()] + [t.grad for t in leaves]
    return [float((a - b).abs().max()) for a, b in zip(gathered, wanted, strict=True)]  # type: ignore[operator]
