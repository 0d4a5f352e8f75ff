"""transformers models as ProbeTasks, built from small configs (no weights, nothing downloaded).

Bench only (bench/peers.py ``--suite m50``): the tests never import transformers.

- ``gpt2``: ``GPT2LMHeadModel`` (learned positions, fused QKV ``Conv1D``, GELU MLP, tied head);
- ``llama``: ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU MLP, grouped-query attention);
- ``bert``: ``BertForMaskedLM`` (bidirectional, token types, MLM head, 15 % of tokens supervised).

Each batch is right-padded to a fixed length (the shape, and so the memory, is the worst case) with
an ``attention_mask``; ``labels`` carry -100 at padded (and, for BERT, unmasked) positions, and the
model computes its own loss from them (``ProbeTask.loss`` is None: autotune's default loss takes
``output.loss``). The models are built with ``from_config`` and sdpa attention; the hub is never
asked (``HF_HUB_OFFLINE`` is set before transformers is imported).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from autotune.tasks.task import ProbeTask  # noqa: E402

hf_logging.set_verbosity_error()  # config advice ("loss_type=None ... unrecognized"), not figures

IGNORE_INDEX = -100
SEQ_LEN = 64
VOCAB = 512
MASK_FRACTION = 0.15


def padded_batch(micro_batch: int, *, seed: int = 0, mlm: bool = False) -> dict[str, torch.Tensor]:
    """micro_batch sequences of SEQ_LEN tokens, right-padded from random lengths (at least 8)."""
    gen = torch.Generator().manual_seed(seed + micro_batch)
    input_ids = torch.randint(4, VOCAB, (micro_batch, SEQ_LEN), generator=gen)
    lengths = torch.randint(8, SEQ_LEN + 1, (micro_batch,), generator=gen)
    pad = torch.arange(SEQ_LEN)[None, :] >= lengths[:, None]
    input_ids = input_ids.masked_fill(pad, 0)
    labels = input_ids.masked_fill(pad, IGNORE_INDEX)
    if mlm:  # supervise MASK_FRACTION of the real tokens, replaced by the [MASK] id (3)
        chosen = (torch.rand(micro_batch, SEQ_LEN, generator=gen) < MASK_FRACTION) & ~pad
        labels = input_ids.masked_fill(~chosen, IGNORE_INDEX)
        input_ids = input_ids.masked_fill(chosen, 3)
    return {"input_ids": input_ids, "attention_mask": (~pad).long(), "labels": labels}


def _task(name: str, config: PretrainedConfig, *, mlm: bool = False) -> ProbeTask:
    auto = AutoModelForMaskedLM if mlm else AutoModelForCausalLM
    config._attn_implementation = "sdpa"
    return ProbeTask(
        name=f"hf-{name}",
        model=lambda: auto.from_config(config),
        batch=lambda m: padded_batch(m, mlm=mlm),
        tags={"seq_len": SEQ_LEN, "arch": config.model_type, "hidden": config.hidden_size},
    )


gpt2 = _task(
    "gpt2",
    GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        n_embd=128,
        n_layer=2,
        n_head=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        use_cache=False,
    ),
)
llama = _task(
    "llama",
    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        pad_token_id=0,
        tie_word_embeddings=False,
        use_cache=False,
    ),
)
bert = _task(
    "bert",
    BertConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=SEQ_LEN,
        pad_token_id=0,
    ),
    mlm=True,
)
