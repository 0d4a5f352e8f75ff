"""What a counted fake trial records for its predicted time (autotune/measure/op_counter.py), against hand-derived
counts: each matmul's 2 x m x k x n FLOPs by phase (a checkpointed forward recomputed inside backward), FSDP2's
collectives of each unit with its bytes and overlap, DDP's buckets, and torchtitan's model FLOPs per token."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autotune.measure.meters.fake import FakeMeter
from autotune.measure.op_counter import OpCounter, ddp_buckets, flops_per_token
from autotune.measure.strategies import Sharded
from autotune.measure.trial import TrialRunner
from autotune.tasks.task import ProbeTask

WIDTH, HIDDEN, BLOCKS, M = 64, 256, 2, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.up(x).relu())


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(BLOCKS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def mlp_task(policy: str = "none") -> ProbeTask:
    return ProbeTask(name="mlp", model=Mlp, batch=lambda m: torch.randn(m, WIDTH),
                     loss=lambda model, batch: model(batch).sum(), activation_checkpointing=policy)  # fmt: skip


def counted(task: ProbeTask, strategy: object = None, world_size: int = 1) -> Iterator[object]:
    meter = FakeMeter(1 << 30, "cpu")
    runner = TrialRunner(task, meter, limit_bytes=1 << 30, strategy=strategy)  # type: ignore[arg-type]
    runner.build()
    counter = OpCounter(meter, world_size=world_size)
    with counter.counting():
        assert not runner(M).oom
    yield counter.record(M), runner
    runner.close()


# Per block and micro-batch: two matmuls forward, 2 x M x 64 x 256 FLOPs each.
FORWARD = BLOCKS * 2 * (2 * M * WIDTH * HIDDEN)
# Backward: each matmul's weight gradient and input gradient, but the first one's input (the batch) needs none.
BACKWARD = 2 * FORWARD - 2 * M * WIDTH * HIDDEN


def test_each_phases_matmul_flops_are_the_hand_count() -> None:
    record, _ = next(counted(mlp_task()))
    assert record.flops("forward") == FORWARD
    assert record.flops("backward") == BACKWARD
    assert record.flops("recompute") == 0
    assert record.flops("step") == 0  # AdamW's kernels are elementwise: bytes, no FLOPs
    assert all(op.kind == "gemm" and op.shape is not None for op in record.ops if op.flops)
    # AdamW's step over 2 x 2 weights of 64 x 256 fp32 reads and writes the weight, its gradient and two states.
    step_bytes = sum(record.ops[i].bytes * n for segment in record.step for i, n in segment.ops)
    assert step_bytes > 4 * BLOCKS * 2 * WIDTH * HIDDEN * 4


def test_full_checkpointing_recomputes_each_blocks_forward_inside_backward() -> None:
    """Each block's forward runs again inside backward, as far as backward needs it: torch's non-reentrant checkpoint
    stops once the tensors backward unpacks exist (the up matmul's output, through relu, for the down matmul's
    gradients); the down matmul's own output is saved by nothing, so it is not recomputed."""
    record, _ = next(counted(mlp_task("full")))
    assert record.flops("forward") == FORWARD
    assert record.flops("recompute") == BLOCKS * 2 * M * WIDTH * HIDDEN
    assert record.flops("backward") == BACKWARD


def test_fsdp_units_gather_and_reduce_their_flat_parameters() -> None:
    strategy = Sharded(4)
    with strategy.process_group(torch.device("cpu")):
        record, _ = next(counted(mlp_task(), strategy, world_size=4))
    unit_bytes = 2 * WIDTH * HIDDEN * 4  # a block's two fp32 weights, gathered whole (32768 elements: no padding)
    collectives = [(s.collective, s.repeat) for s in record.last if s.collective is not None]
    kinds = [(c.kind, c.phase, c.overlap, c.bytes, c.group_size, c.dim) for c, n in collectives for _ in range(n)]
    # Forward gathers both units; backward gathers the first again (the last stays unsharded after forward, as
    # torchtitan wraps it) and reduce-scatters both.
    assert kinds.count(("all_gather", "forward", "prefetched", unit_bytes, 4, "world")) == BLOCKS
    assert kinds.count(("all_gather", "backward", "prefetched", unit_bytes, 4, "world")) == BLOCKS - 1
    assert kinds.count(("reduce_scatter", "backward", "deferred", unit_bytes, 4, "world")) == BLOCKS
    assert len(kinds) == 3 * BLOCKS - 1
    assert record.flops("forward") == FORWARD  # the gathered weights compute as the whole model's


def test_ddps_buckets_hold_every_gradient() -> None:
    record, runner = next(counted(mlp_task()))
    buckets = ddp_buckets(runner.model, replicas=4, stride=1, dim="dp")  # type: ignore[attr-defined]
    assert sum(b.bytes for b in buckets) == BLOCKS * 2 * WIDTH * HIDDEN * 4
    assert all(b.kind == "all_reduce" and b.overlap == "deferred" and b.group_size == 4 for b in buckets)
    assert record.ddp_buckets == []  # a fake trial reduces nothing: the child adds them (card_steps.py)


VOCAB, D_MODEL, HEADS, LENGTH = 96, 64, 4, 32


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, D_MODEL // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D_MODEL)
        return self.head(x + self.proj(y))


def test_model_flops_per_token_are_torchtitans() -> None:
    """torchtitan: 6 x the non-embedding parameters + 12 x layers x heads x head dim x L."""
    task = ProbeTask(name="attention", model=Attention, batch=lambda m: torch.randint(0, VOCAB, (m, LENGTH)),
                     loss=lambda model, batch: model(batch).float().logsumexp(-1).sum())  # fmt: skip
    record, runner = next(counted(task))
    non_embedding = 3 * D_MODEL**2 + D_MODEL**2 + D_MODEL * VOCAB
    expected = 6 * non_embedding + 12 * 1 * HEADS * (D_MODEL // HEADS) * LENGTH
    assert flops_per_token(record, runner.model, tokens=M * LENGTH) == pytest.approx(expected)  # type: ignore[attr-defined]
    (attention,) = [op for op in record.ops if op.kind == "attention" and op.phase == "forward"]
    assert attention.causal and attention.kernel == "flash"


def test_a_transformers_config_gives_the_attention_term_itself() -> None:
    """Where the model has a transformers config (layers, heads, hidden size), torchtitan's second term is read off it
    (context parallel's ring splits each layer's attention into calls over blocks of the sequence)."""
    task = ProbeTask(name="attention", model=Attention, batch=lambda m: torch.randint(0, VOCAB, (m, LENGTH)),
                     loss=lambda model, batch: model(batch).float().logsumexp(-1).sum())  # fmt: skip
    record, runner = next(counted(task))
    model = runner.model  # type: ignore[attr-defined]
    model.config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=HEADS, hidden_size=D_MODEL)
    at_length = record.model_copy(update={"seq_len": 4 * LENGTH})  # the config's term is of the record's L
    non_embedding = 3 * D_MODEL**2 + D_MODEL**2 + D_MODEL * VOCAB
    assert flops_per_token(at_length, model, tokens=M * LENGTH) == 6 * non_embedding + 12 * HEADS * (
        D_MODEL // HEADS
    ) * (4 * LENGTH)
