"""Tiny Hugging Face configs written to disk, as a user's config.json would be (no hub, no weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 256
SEQ_LEN = 16

# The Llama config has one decoder layer: a fake trial's time is its ops', which a second layer nearly doubles, and
# one layer holds every part a truth checks (embedding, attention, MLP, norms, head). A test about how layers
# compose (pipeline stages, every-K checkpointing, a figure a page quotes) writes two: write_config(..., **TWO_LAYERS).
TWO_LAYERS = {"num_hidden_layers": 2}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": VOCAB,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {
        "model_type": "qwen2",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
}


def write_config(directory: Path, arch: str, **overrides: Any) -> Path:
    """directory/arch/config.json for one of CONFIGS; returns the directory holding it."""
    where = directory / arch
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps({**CONFIGS[arch], **overrides}, indent=2))
    return where


_BERT = {
    "model_type": "bert",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}
# One config per head family that hf: batches (autotune/tasks/hf.py FAMILIES), each naming its class in
# "architectures" as a published checkpoint's config.json does.
HEADS: dict[str, dict[str, Any]] = {
    "bert-seq-cls": {**_BERT, "architectures": ["BertForSequenceClassification"], "num_labels": 3},
    "bert-token-cls": {**_BERT, "architectures": ["BertForTokenClassification"], "num_labels": 5},
    "bert-mlm": {**_BERT, "architectures": ["BertForMaskedLM"]},
    "t5": {
        "model_type": "t5",
        "vocab_size": VOCAB,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
        "architectures": ["T5ForConditionalGeneration"],
    },
    "vit": {
        "model_type": "vit",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "image_size": 32,
        "patch_size": 8,
        "num_channels": 3,
        "num_labels": 5,
        "architectures": ["ViTForImageClassification"],
    },
    "llama-seq-cls": {**CONFIGS["llama"], "architectures": ["LlamaForSequenceClassification"], "pad_token_id": 0},
}


def write_head_config(directory: Path, head: str, **overrides: Any) -> Path:
    """directory/head/config.json for one of HEADS; returns the directory holding it."""
    where = directory / head
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps({**HEADS[head], **overrides}, indent=2))
    return where
