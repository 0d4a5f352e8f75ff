"""A GPT (causal LM, token-level loss) as a ProbeTask, its size a parameter.

Sequences are right-padded; padded positions carry label -100 and are excluded from the loss,
so the number of supervised tokens varies between micro-batches, as in real LM training.

- ``task``: the small model the tests use (2 layers, d_model 64).
- ``task_100m``: about 100 M parameters (12 layers, d_model 768, seq 256), for the benchmarks.
- ``task_7b``: a 7 B configuration (32 layers, d_model 4096, 32 heads, seq 4096, vocab 32000,
  bf16), for ``autotune estimate`` only: it is never built for real here.
- ``task_seq``, ``task_seq_eager``, ``task_7b_seq``: sequence-aware (``batch(m, seq_len=L)``): probe
  them at several lengths with ``--seq-len 64,128,256``. ``_eager`` materializes the L x L
  attention scores and mask (memory in m·L² and L²) where the others use fused attention.

``make_task(cfg, name=..., precision=...)`` gives any other size, ``make_seq_task`` its
sequence-aware form.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from autotune import ProbeTask

IGNORE_INDEX = -100


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.0
    # "sdpa" (fused scaled_dot_product_attention) or "eager" (scores and mask materialized, L x L).
    attention: str = "sdpa"


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attention = cfg.attention
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        if self.attention == "eager":
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        else:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(att.transpose(1, 2).reshape(b, t, c)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.cfg.seq_len:
            # What a real embedding lookup would say at run time, said from the shape alone, so that a
            # fake trial refuses the length too.
            raise ValueError(f"sequence length {length} is longer than the position table ({self.cfg.seq_len})")
        positions = torch.arange(length, device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_batch(
    micro_batch: int,
    cfg: GPTConfig = GPTConfig(),
    *,
    seed: int = 0,
    variable_lengths: bool = False,
) -> dict[str, torch.Tensor]:
    """micro_batch sequences of cfg.seq_len tokens; with variable_lengths, right-padded to it."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=gen)
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    if variable_lengths:
        lengths = torch.randint(2, cfg.seq_len + 1, (micro_batch,), generator=gen)
        pad = torch.arange(cfg.seq_len)[None, :] >= lengths[:, None]
        input_ids = input_ids.masked_fill(pad, 0)
        labels = labels.masked_fill(pad | torch.roll(pad, shifts=-1, dims=1), IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels}


def loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed token loss and the number of supervised tokens (labels != -100)."""
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total, int((labels != IGNORE_INDEX).sum())


def token_mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    total, count = loss_sum(model, batch)
    return total / max(count, 1)


def make_task(cfg: GPTConfig = GPTConfig(), *, name: str = "gpt-small", precision: str = "fp32") -> ProbeTask:
    """The GPT of cfg as a ProbeTask (the tags carry the sizes that change memory)."""
    return ProbeTask(
        name=name,
        model=lambda: GPT(cfg),
        # Variable lengths padded to seq_len: the shape (and so the memory) is the worst case.
        batch=lambda m: make_batch(m, cfg, variable_lengths=True),
        loss=token_mean_loss,
        loss_sum=loss_sum,
        precision=precision,
        tags={"seq_len": cfg.seq_len, "n_layers": cfg.n_layers}
        | ({} if cfg == GPTConfig() else {"d_model": cfg.d_model, "vocab_size": cfg.vocab_size}),
    )


def make_seq_task(
    cfg: GPTConfig = GPTConfig(seq_len=2048), *, name: str = "gpt-small-seq", precision: str = "fp32"
) -> ProbeTask:
    """The GPT of cfg as a sequence-aware ProbeTask: ``batch(m, seq_len=L)`` for any L up to
    cfg.seq_len (the position table). The tags leave the length out: one fingerprint, every length."""

    def batch(micro_batch: int, seq_len: int) -> dict[str, torch.Tensor]:
        return make_batch(micro_batch, dataclasses.replace(cfg, seq_len=seq_len), variable_lengths=True)

    return ProbeTask(
        name=name,
        model=lambda: GPT(cfg),
        batch=batch,
        loss=token_mean_loss,
        loss_sum=loss_sum,
        precision=precision,
        tags={"max_seq_len": cfg.seq_len, "n_layers": cfg.n_layers, "d_model": cfg.d_model, "attention": cfg.attention},
    )


GPT_100M = GPTConfig(vocab_size=8192, seq_len=256, d_model=768, n_heads=12, n_layers=12)
GPT_7B = GPTConfig(vocab_size=32000, seq_len=4096, d_model=4096, n_heads=32, n_layers=32)

task = make_task()
task_100m = make_task(GPT_100M, name="gpt-100m")
task_7b = make_task(GPT_7B, name="gpt-7b", precision="bf16")
task_seq = make_seq_task()
task_seq_eager = make_seq_task(GPTConfig(seq_len=2048, attention="eager"), name="gpt-small-seq-eager")
task_7b_seq = make_seq_task(dataclasses.replace(GPT_7B, seq_len=65536), name="gpt-7b-seq", precision="bf16")
