"""One rank of a real 2-process pipeline on gloo (spawned by test_pipeline.py), and the tiny Llama both sides run.

The truth for ``--pp 2``, sharing no code with the probe: the model built the ordinary way on ``meta``, cut by
hand as torchtitan and PyTorch's pipelining tutorial cut it (the stage's blocks kept, the embedding set to None
on every stage but the first, the norm and the head on every stage but the last), materialized with
``to_empty`` and run by ``torch.distributed.pipelining`` itself (``PipelineStage`` with ``ScheduleGPipe`` or
``Schedule1F1B``): each step every rank makes the whole batch (inputs and targets, as a data loader does on every
rank of torchtitan), the first stage steps on the inputs, the last on the targets with the loss, outputs not
returned (torchtitan's ``return_outputs=False``); then an AdamW step and ``zero_grad``, twice. The peak is the
CPU allocator's own running total (``total_allocated`` of torch.profiler's allocation events, less the total
before the first), with c10's flag ``caffe2_report_cpu_memory_usage`` on from the rank's start so that frees made on
gloo's threads (the last reference to a sent tensor) come off that total when they happen, though the profile
records no event for them (tests/autotune/_fsdp_mp_truth.py says how that was found).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.profiler import ProfilerActivity, profile

from tests.autotune._host_copies import HostCopies, offload_blocks
from tests.autotune._ordinary_optimizers import ORDINARY

VOCAB = 96
DIM = 32
HEADS = 2
LAYERS = 3
SEQ_LEN = 16
INTERLEAVED_VIRTUAL = 2
INTERLEAVED_LAYERS = 4


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Block(nn.Module):
    """A Llama decoder block: RMSNorm, attention with rotary positions, RMSNorm, SwiGLU."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.ffn_norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)
        self.w3 = nn.Linear(DIM, 4 * DIM, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = h.shape
        x = self.attention_norm(h)
        q, k, v = (w(x).view(batch, length, HEADS, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.wo(attention.transpose(1, 2).reshape(batch, length, DIM))
        x = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))


class TinyLlama(nn.Module):
    """Embedding, LAYERS blocks, norm, head; a stage of a pipeline sets the parts it lacks to None (torchtitan)."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm: nn.Module | None = nn.RMSNorm(DIM)
        self.output: nn.Module | None = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        length = h.shape[1]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM // HEADS, 2, dtype=torch.float32) / (DIM // HEADS)))
        angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_batch(micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (micro_batch, SEQ_LEN)), torch.randint(0, VOCAB, (micro_batch, SEQ_LEN))


def cut_to_stage(model: TinyLlama, stage: int, stages: int) -> TinyLlama:
    """The stage's part of the model, cut by hand as torchtitan cuts it: its run of blocks (``tensor_split``'s), the
    embedding dropped past the first stage, the norm and the head before the last."""
    per_stage = [len(part) for part in torch.arange(len(model.layers)).tensor_split(stages)]
    start = sum(per_stage[:stage])
    model.layers = nn.ModuleList(list(model.layers)[start : start + per_stage[stage]])
    if stage > 0:
        model.tok_embeddings = None
    if stage < stages - 1:
        model.norm = None
        model.output = None
    return model


def _stage_model(
    stage: int,
    stages: int,
    layers: int,
    checkpointed: bool = False,
    copies: HostCopies | None = None,
    compiled: bool = False,
) -> nn.Module:
    """The stage built and initialised; with ``copies``, every block's saved activations in host memory; ``compiled``:
    each block compiled as torchtitan's ``apply_compile`` compiles it (``torch.compile`` of the block, put back in its
    place)."""
    with torch.device("meta"):
        model = cut_to_stage(TinyLlama(layers), stage, stages)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    if checkpointed:  # every block recomputes its forward in backward (torch's own wrapper)
        for index, layer in enumerate(model.layers):
            model.layers[index] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if copies is not None:
        offload_blocks(model.layers, copies)
    if compiled:
        for index, layer in enumerate(model.layers):
            model.layers.register_module(str(index), torch.compile(layer))
    return model.train()


# The memory budget the rank's compiled blocks were last compiled under (dynamo's cache does not guard on it).
_COMPILED_UNDER: dict[str, str] = {}


def _steps(
    job: str, rank: int, ranks: int, microbatches: int, micro_batch: int, copies: HostCopies | None = None
) -> None:
    # "1f1b+full": the 1F1B schedule with every block checkpointed; "1f1b+offload": every block's saved activations
    # in host memory, in ``copies``; "1f1b+adamw4bit": each stage stepped by that optimizer as the library builds it
    # (tests/autotune/_ordinary_optimizers.py), not torch's AdamW; "1f1b+compile": each block compiled.
    # "1f1b+compile+budget:0.5": compiled blocks partitioned under the compiler's activation memory budget 0.5, set
    # as a training script sets it (torch._functorch.config), in a fresh compiler.
    schedule_name, _, policy = job.partition("+")
    policy, _, budget = policy.partition("+budget:")
    make_optimizer = ORDINARY.get(policy, lambda params: torch.optim.AdamW(params, lr=1e-3))
    if budget:
        import torch._functorch.config as functorch_config

        if _COMPILED_UNDER.get("budget") != budget:  # the first size of this job: a fresh compiler
            torch._dynamo.reset()
            _COMPILED_UNDER["budget"] = budget
        with functorch_config.patch(activation_memory_budget=float(budget)):
            _run_steps(schedule_name, policy, rank, ranks, microbatches, micro_batch, copies, make_optimizer)
    else:
        _run_steps(schedule_name, policy, rank, ranks, microbatches, micro_batch, copies, make_optimizer)


def _run_steps(
    schedule_name: str,
    policy: str,
    rank: int,
    ranks: int,
    microbatches: int,
    micro_batch: int,
    copies: HostCopies | None,
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
) -> None:
    # Interleaved: each rank holds INTERLEAVED_VIRTUAL stages (rank, rank + ranks, ...) of a deeper model, and one
    # optimizer per stage (torchtitan's one per model part).
    virtual = INTERLEAVED_VIRTUAL if schedule_name == "interleaved-1f1b" else 1
    layers = INTERLEAVED_LAYERS if virtual > 1 else LAYERS
    indices = [rank + chunk * ranks for chunk in range(virtual)]
    models = [
        _stage_model(index, ranks * virtual, layers, policy == "full", copies, policy == "compile") for index in indices
    ]
    stages = [
        PipelineStage(model, index, ranks * virtual, torch.device("cpu"))
        for model, index in zip(models, indices, strict=True)
    ]
    if virtual > 1:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=lm_loss)
    else:
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule_name]
        schedule = kind(stages[0], n_microbatches=microbatches, loss_fn=lm_loss)
    optimizers = [make_optimizer(model.parameters()) for model in models]
    train_two_steps(schedule, rank == 0, microbatches, micro_batch, optimizers)
    del schedule, stages, optimizers, models


def train_two_steps(
    schedule: Any, first_stage: bool, microbatches: int, micro_batch: int, optimizers: list[torch.optim.Optimizer]
) -> None:
    """Two steps of the schedule as a training loop runs them: the first stage feeds the inputs, the others the
    targets (the last computes the losses, kept until the step ends), then each optimizer steps and zeroes."""
    for _ in range(2):
        inputs, targets = make_batch(microbatches * micro_batch)
        if first_stage:
            schedule.step(inputs, return_outputs=False)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=targets, losses=losses, return_outputs=False)
            del losses
        del inputs, targets
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def count_every_thread() -> None:
    """c10's flag caffe2_report_cpu_memory_usage on: the CPU allocator's total counts every thread's frees."""
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def peak_bytes(
    schedule_name: str,
    stage_index: int,
    stages: int,
    microbatches: int,
    micro_batch: int,
    copies: HostCopies | None = None,
) -> int:
    """The allocator's peak running total over the stage's build and two steps, less the total before them."""
    return profiled_peak_bytes(lambda: _steps(schedule_name, stage_index, stages, microbatches, micro_batch, copies))


def profiled_peak_bytes(steps: Callable[[], None]) -> int:
    """The CPU allocator's peak running total over ``steps`` (every rank between two barriers), less the total
    before them."""
    gc.collect()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        steps()
    dist.barrier()
    events = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        if "Allocation" in str(node.tag) and node.extra_fields.device.type == torch.device("cpu").type:
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
    events.sort()
    _, first_bytes, first_total = events[0]
    return max(total for _, _, total in events) - (first_total - first_bytes)


def run(rank: int, world_size: int, rendezvous: str, out_dir: str, jobs: list[tuple[str, int, list[int]]]) -> None:
    """Each job (schedule, K, sizes): this rank's peak at each size, written to rank{rank}.json."""
    gc.freeze()  # the imports are never this rank's garbage: each collection walks only what the job made
    try:
        count_every_thread()
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
        try:
            torch.manual_seed(rank)
            peaks = {}
            for name, k, sizes in jobs:
                for m in sizes:
                    if "+compile" in name:
                        # A compiled job at m: a fresh compiler (as a fresh process has; a graph made for another
                        # size first would be dynamic) compiles at m in its first steps, which run first: the job is
                        # measured where its compilation has settled.
                        torch._dynamo.reset()
                        _steps(name, rank, world_size, k, m)
                        dist.barrier()
                    copies = HostCopies() if name.endswith("+offload") else None
                    peaks[f"{name}/{k}/{m}"] = peak_bytes(name, rank, world_size, k, m, copies)
                    if copies is not None:
                        peaks[f"{name}/{k}/{m}/host"] = copies.peak_bytes
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(peaks))
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
