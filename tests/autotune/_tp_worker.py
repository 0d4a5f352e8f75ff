"""One rank of a real tensor-parallel job on gloo (spawned by test_tensor_parallel.py): the truth for --tp.

Shares no code with the probe: a tiny Llama built the ordinary way (``LlamaForCausalLM(LlamaConfig(...))``),
parallelized with PyTorch's own ``parallelize_module`` and the plan transformers ships for Llama written out
here (q/k/v/gate/up column-wise, o/down row-wise, the embedding vocabulary-parallel, the LM head column-wise
with its logits gathered), under ``dp > 1`` each decoder layer then the root sharded by ``fully_shard`` over
the data-parallel dimension (torchtitan's order); 2 micro-batches forward and backward, an AdamW step,
zero_grad, twice. The peak is the CPU allocator's own count: its running total (``total_allocated``, which
each memory event carries), with c10's flag ``caffe2_report_cpu_memory_usage`` on from the rank's start so
that the frees gloo's threads make come off it (the profiler's event sum would miss them), less the total
before the run's first event.

Gloo's worker threads used to make a run's peak vary above a floor (at tp = 2, m = 3: 608,316 bytes in most runs,
633,676 or 682,044 in some): the groups have one thread and each collective is waited and fenced as it is issued
(tests/autotune/_ordered_gloo.py), so each size runs once and reads the same figure every run, after one run at m = 1
that makes the first step's one-time allocations (peft's and DTensor's caches, torchao's compiled step). Rank 0
writes the most loaded rank's peak per size.
"""

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

SEQ_LEN = 16


def run(
    rank: int, world_size: int, tp: int, rendezvous: str, out_dir: str, config: dict[str, Any], sizes: list[int]
) -> None:
    gc.freeze()  # the imports are never this rank's garbage: each collection walks only what the job made
    try:
        _run(rank, world_size, tp, rendezvous, out_dir, config, sizes)
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def llama_plan(model: torch.nn.Module) -> dict[str, Any]:
    """The tp plan transformers ships for Llama, written out for parallelize_module: q/k/v/gate/up column-wise,
    o/down row-wise, the embedding vocabulary-parallel, the LM head column-wise with its logits gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for index in range(len(model.model.layers)):  # type: ignore[union-attr,arg-type]
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{index}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{index}.{name}"] = RowwiseParallel()
    return plan


def torchtitan_plan(model: torch.nn.Module) -> dict[str, Any]:
    """torchtitan's Llama plan (torchtitan/models/llama3/infra/parallelize.py, apply_tp) written out for
    transformers' Llama names with torch's own styles: the embedding vocabulary-parallel with its output sharded on
    the sequence, sequence parallel on the norms, each attention and MLP's input prepared from the sequence shards
    to whole (PrepareModuleInput: attention takes hidden_states by keyword, the MLP positionally), o/down row-wise
    reduce-scattered onto the sequence, the LM head column-wise with its logits sharded by vocabulary for
    loss_parallel(). The residual stream stays a DTensor (use_local_output=False), as transformers adds it to the
    blocks' outputs."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for index in range(len(model.model.layers)):  # type: ignore[union-attr,arg-type]
        block = f"model.layers.{index}."
        plan[block + "input_layernorm"] = SequenceParallel()
        plan[block + "self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        )
        plan[block + "post_attention_layernorm"] = SequenceParallel()
        plan[block + "mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[block + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[block + name] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


def _gpt2_torchtitan_model(mesh: Any, config: dict[str, Any]) -> torch.nn.Module:
    """GPT-2 under torchtitan's layout, built here with DTensor's public API: torch's own styles where they take the
    module (the embeddings vocabulary-parallel over the vocabulary and over the positions, outputs sharded on the
    sequence; SequenceParallel on the norms; PrepareModuleInput on attn and mlp; the LM head column-wise for
    loss_parallel(), tied to wte again after sharding, as tie_weights() would), and transformers' Conv1D layers (no
    torch style takes them) sharded with ``distribute_module``: c_attn and c_fc by output columns (weight dim 1, bias
    dim 0), both c_proj by input rows (weight dim 0) with the partial sums reduce-scattered onto the sequence; the
    attention's split of its packed q/k/v and its head count set to the rank's share, as torchtitan sets a model's
    local heads."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(**{k: v for k, v in config.items() if not k.startswith("_") and k != "model_type"})
    )
    tp_mesh = mesh["tp"]
    gathered = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    plan: dict[str, Any] = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "transformer.wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "transformer.ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for index in range(len(model.transformer.h)):
        block = f"transformer.h.{index}."
        plan.update({block + "ln_1": SequenceParallel(), block + "ln_2": SequenceParallel()})
        plan.update({block + "attn": gathered, block + "mlp": gathered})
    parallelize_module(model, tp_mesh, plan, src_data_rank=None)
    model.lm_head.weight = model.transformer.wte.weight

    def placed(placements: dict[str, Any]) -> Any:
        def partition(_: str, module: nn.Module, device_mesh: Any) -> None:
            for name, placement in placements.items():
                param = getattr(module, name)
                shard = distribute_tensor(param, device_mesh, [placement], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(shard))

        return partition

    def columns_in(_: nn.Module, inputs: tuple[Any, ...], device_mesh: Any) -> tuple[Any, ...]:
        return (DTensor.from_local(inputs[0], device_mesh, [Replicate()], run_check=False),)

    def rows_in(_: nn.Module, inputs: tuple[Any, ...], device_mesh: Any) -> tuple[Any, ...]:
        return (DTensor.from_local(inputs[0], device_mesh, [Shard(-1)], run_check=False),)

    tp = tp_mesh.size()
    for block in model.transformer.h:
        block.attn.split_size //= tp
        block.attn.num_heads //= tp
        block.attn.embed_dim //= tp
        for layer in (block.attn.c_attn, block.mlp.c_fc):
            distribute_module(
                layer, tp_mesh, placed({"weight": Shard(1), "bias": Shard(0)}), columns_in,
                lambda _, output, __: output.to_local(),
            )  # fmt: skip
        for layer in (block.attn.c_proj, block.mlp.c_proj):
            distribute_module(
                layer, tp_mesh, placed({"weight": Shard(0), "bias": Replicate()}), rows_in,
                lambda _, output, __: output.redistribute(placements=[Shard(1)]),
            )  # fmt: skip
    return model


def _lora_model(mesh: Any, config: dict[str, Any]) -> torch.nn.Module:
    """LoRA under tp: the base parallelized with the plan above, then peft's ``get_peft_model`` over it. peft
    sizes each adapter from the base layer's local weight, so under a column-wise layer lora_B is the rank's
    share of the output (a plain tensor) and lora_A is whole on every rank: the layout peft's own
    tensor-parallel LoRA gives (peft/tuners/lora/model.py, lora_B sharded as its layer)."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    lora = config["_lora"]
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "_lora"}))
    parallelize_module(model, mesh["tp"], llama_plan(model), src_data_rank=None)
    lora_config = LoraConfig(
        r=lora["rank"],
        lora_alpha=2 * lora["rank"],
        target_modules=lora["targets"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, lora_config)
    return wrapped  # type: ignore[return-value]


def _model(mesh: Any, config: dict[str, Any]) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    if "_lora" in config:
        model = _lora_model(mesh, config)
        model.train()
        return model
    if config.get("model_type") == "gpt2":
        model = _gpt2_torchtitan_model(mesh, config)
    else:
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if not k.startswith("_")}))
        plan = torchtitan_plan(model) if config.get("_plan") == "torchtitan" else llama_plan(model)
        parallelize_module(model, mesh["tp"], plan, src_data_rank=None)
    if mesh["dp"].size() > 1:
        layers = list(model.model.layers)  # type: ignore[union-attr,arg-type]
        for index, layer in enumerate(layers):
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=index < len(layers) - 1)
        fully_shard(model, mesh=mesh["dp"])
    model.train()
    return model


def _steps(mesh: Any, config: dict[str, Any], micro_batch: int) -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    model = _model(mesh, config)
    if config.get("_optimizer") == "adamw4bit":  # torchao's, as torchao builds it (its step compiled per parameter)
        from torchao.optim import AdamW4bit

        optimizer: torch.optim.Optimizer = AdamW4bit(model.parameters())
    else:
        optimizer = torch.optim.AdamW(model.parameters())
    generator = torch.Generator().manual_seed(micro_batch)
    # torchtitan's loss: the cross entropy on the vocabulary shards, forward and backward under loss_parallel().
    loss_context = loss_parallel if config.get("_plan") == "torchtitan" else contextlib.nullcontext
    for _ in range(2):
        for _ in range(2):
            input_ids = torch.randint(0, config["vocab_size"], (micro_batch, SEQ_LEN), generator=generator)
            batch = {"input_ids": input_ids, "labels": input_ids.clone()}
            with loss_context():
                loss = model(**batch).loss / 2
                loss.backward()
            del input_ids, batch, loss
        # torchao compiles its step, which dynamo refuses under a dispatch mode; the step issues no collective.
        with _disable_current_modes() if config.get("_optimizer") == "adamw4bit" else contextlib.nullcontext():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del model, optimizer


def _count_every_thread() -> None:
    """c10's flag caffe2_report_cpu_memory_usage on: the CPU allocator's total counts every thread's frees."""
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _peak_bytes(mesh: Any, config: dict[str, Any], micro_batch: int) -> int:
    gc.collect()  # an earlier run's cyclic garbage freed inside the profile would count low
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, collectives_in_order():
        _steps(mesh, config, micro_batch)
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


def _run(
    rank: int, world_size: int, tp: int, rendezvous: str, out_dir: str, config: dict[str, Any], sizes: list[int]
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _count_every_thread()
    one_thread_groups()  # every gloo group this rank makes: one worker thread
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        warmed_up(functools.partial(_steps, mesh, config, 1))  # peft's, DTensor's caches: 144 bytes
        peaks = {}
        for m in sizes:
            most = torch.tensor([_peak_bytes(mesh, config, m)])
            dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the most loaded rank's
            peaks[str(m)] = int(most.item())
        if rank == 0:
            Path(out_dir, "peaks.json").write_text(json.dumps(peaks))
        dist.barrier()
    finally:
        dist.destroy_process_group()
