"""One rank of a real pipeline whose stages run context parallelism, on gloo: pp 2 x cp 2, 4 processes (spawned by
test_cp_pipeline.py). The truth for ``--pp 2 --cp 2`` over ddp (each stage's module in DDP over its cp group) or fsdp
(each stage's blocks then its root ``fully_shard``-ed over its cp group: torchtitan's dp_shard_cp with one replica).

Shares no measuring code with the probe. Each stage is transformers' ``LlamaForCausalLM`` (``attn_implementation=
"sdpa"``) built on ``meta`` and cut by hand, as a user cuts a model for ``torch.distributed.pipelining``: the stage's
run of decoder layers (``tensor_split``'s), the embedding dropped past the first stage (a later stage takes the
arriving activation as ``inputs_embeds``), the norm and the head made ``nn.Identity`` before the last; then given
storage with ``to_empty``. ``PipelineStage`` over the pp group and ``Schedule1F1B`` (K micro-batches) drive it; the
last stage's loss is transformers' own causal-LM loss over ``shift_labels`` (``ForCausalLMLoss``). Each step runs
inside PyTorch's ``context_parallel`` over the cp group, as torchtitan's train context wraps ``schedule.step``: the
step's whole batch, made on every rank as transformers' Trainer readies one for context parallelism (``input_ids``,
``labels``, ``shift_labels`` padded with -100 and shifted, ``position_ids`` an expanded ``arange``), sharded along the
sequence (none restored); the schedule cuts it into micro-batches, ``position_ids`` going to every stage; the
attention masks are left out (``is_causal``). An AdamW step and ``zero_grad`` after each step, two steps.

What it does share is the job's CPU attention kernel (autotune/measure/context_parallel.py's
``install_cpu_flash_attention``): torch's ring attention calls CUDA-only flash kernels, so without it this job cannot
run on the CPU at all. It measures nothing.

Each rank's peak is the CPU allocator's own running total (tests/autotune/_pipeline_worker.py's
``profiled_peak_bytes``: c10's flag on so gloo's threads' frees come off it), the stage's build and two steps, after
one run at m = 1; the collectives waited and fenced as issued (tests/autotune/_ordered_gloo.py).
"""

from __future__ import annotations

import functools
import gc
import json
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.autotune._ordered_gloo import collectives_in_order, one_thread_groups, warmed_up
from tests.autotune._pipeline_worker import count_every_thread, profiled_peak_bytes


class _Stage(nn.Module):
    """A stage's part of the causal LM: token ids in on the first stage, the arriving activation on the others;
    out the hidden states (the head an Identity) or, on the last, the logits."""

    def __init__(self, model: nn.Module, first: bool) -> None:
        super().__init__()
        self.model, self.first = model, first

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.first:
            return self.model(input_ids=inputs, position_ids=position_ids).logits  # type: ignore[no-any-return]
        return self.model(inputs_embeds=inputs, position_ids=position_ids).logits  # type: ignore[no-any-return]


def _stage_module(config: dict[str, Any], stage: int, stages: int, mesh: Any, inner: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa"))  # type: ignore[call-arg]
    layers = list(model.model.layers)
    per_stage = [len(part) for part in torch.arange(len(layers)).tensor_split(stages)]
    start = sum(per_stage[:stage])
    kept = layers[start : start + per_stage[stage]]
    model.model.layers = nn.ModuleList(kept)
    if stage > 0:
        model.model.embed_tokens = None
    if stage < stages - 1:
        model.model.norm = nn.Identity()
        model.lm_head = nn.Identity()
    module: nn.Module = _Stage(model.train(), first=stage == 0)
    if inner == "fsdp":
        # Over the cp ranks (they hold the same parameters): each layer, the last kept gathered after forward, then the
        # stage's module as the root, which PipelineStage then drives as FSDP2's (gradients accumulated unsharded
        # over the K backwards, one reduce-scatter after the last).
        for index, layer in enumerate(kept):
            fully_shard(layer, mesh=mesh["cp"], reshard_after_forward=index < len(kept) - 1)
        fully_shard(module, mesh=mesh["cp"])
    module.to_empty(device="cpu")
    with torch.no_grad():
        for param in module.parameters():
            (param.to_local() if hasattr(param, "to_local") else param).normal_(0.0, 0.02)
        for buffer in module.buffers():  # the rotary frequencies: their values are not what is measured
            buffer.fill_(1.0)
    if inner == "ddp":
        module = DistributedDataParallel(module, process_group=mesh["cp"].get_group())
    return module


def _steps(config: dict[str, Any], mesh: Any, seq_len: int, microbatches: int, micro_batch: int, inner: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.experimental import context_parallel
    from transformers.loss.loss_utils import ForCausalLMLoss

    stage, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    vocab = config["vocab_size"]

    def loss_fn(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        return ForCausalLMLoss(logits, None, vocab, shift_labels=shift_labels)  # type: ignore[no-any-return]

    module = _stage_module(config, stage, stages, mesh, inner)
    # Static shapes (on meta: no storage), each rank's L / cp positions: torch's own inference would run the stage's
    # forward outside the step's context_parallel (the whole sequence), and outside DDP's no_sync (which leaves its
    # reducer expecting a backward, and breaks its bucket rebuild in the step's first one).
    local = seq_len // mesh["cp"].size()
    hidden = torch.empty((micro_batch, local, config["hidden_size"]), device="meta", requires_grad=True)
    if stage == 0:
        example_in, example_out = torch.empty((micro_batch, local), dtype=torch.long, device="meta"), hidden
    else:
        example_in, example_out = hidden, torch.empty((micro_batch, local, vocab), device="meta")
    pipeline = PipelineStage(
        module,
        stage,
        stages,
        torch.device("cpu"),
        input_args=example_in,
        output_args=example_out,
        group=mesh["pp"].get_group(),
    )
    schedule = Schedule1F1B(pipeline, n_microbatches=microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(micro_batch)
    for _ in range(2):
        rows = microbatches * micro_batch
        input_ids = torch.randint(0, vocab, (rows, seq_len), generator=generator)
        labels = input_ids.clone()
        shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
        position_ids = torch.arange(seq_len).expand(rows, -1)
        buffers = [input_ids, labels, shift_labels, position_ids]
        with context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set(buffers)):
            if stage == 0:
                schedule.step(input_ids, position_ids=position_ids, return_outputs=False)
            else:
                losses: list[torch.Tensor] = []
                schedule.step(position_ids=position_ids, target=shift_labels, losses=losses, return_outputs=False)
                del losses
        del input_ids, labels, shift_labels, position_ids, buffers
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del schedule, pipeline, optimizer, module


def run(
    rank: int,
    world_size: int,
    rendezvous: str,
    out_dir: str,
    config: dict[str, Any],
    seq_len: int,
    microbatches: int,
    jobs: list[tuple[str, list[int]]],
) -> None:
    """Each job (ddp or fsdp, sizes): this rank's peak at each size, to rank{rank}.json as {inner: {m: peak}}; a
    (pp, cp) mesh of pp 2 x cp 2."""
    gc.freeze()  # the imports are never this rank's garbage: each collection walks only what the job made
    try:
        count_every_thread()
        from torch.distributed.device_mesh import init_device_mesh

        from autotune.measure.context_parallel import install_cpu_flash_attention

        install_cpu_flash_attention()
        one_thread_groups()  # every gloo group this rank makes: one worker thread
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
        try:
            torch.manual_seed(rank)
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "cp"))
            peaks: dict[str, dict[str, int]] = {}
            for inner, sizes in jobs:
                steps = functools.partial(_steps, config, mesh, seq_len, microbatches, inner=inner)
                warmed_up(functools.partial(steps, 1))

                def measured(m: int, steps: Any = steps) -> None:
                    with collectives_in_order():
                        steps(m)

                peaks[inner] = {str(m): profiled_peak_bytes(functools.partial(measured, m)) for m in sizes}
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(peaks))
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
