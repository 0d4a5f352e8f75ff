"""Tiny Hugging Face configs written to disk, as a user's config.json would be (no hub, no weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 256
SEQ_LEN = 16

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
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
