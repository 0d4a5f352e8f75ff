"""A tiny Hugging Face Trainer job (a 2-layer Llama from a config, fixed token data, SGD) for a few steps."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

SAMPLES = 128
SEQ_LEN = 32
VOCAB = 256
RECIPE_BATCH = 16
STEPS = 3
# The CPU budget of the local probe: the recipe's 16 sequences do not fit in it (10 do).
BUDGET = "3MiB"


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def model() -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
    )
    return AutoModelForCausalLM.from_config(config)


def trainer(out: Path, *, batch_size: int = RECIPE_BATCH, **overrides: Any) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **overrides,
    )
    return Trainer(model=model(), args=args, train_dataset=Tokens())


def train(t: Trainer) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(the loss of each update, the weights after the last one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        t.train()
    losses = [entry["loss"] for entry in t.state.log_history if "loss" in entry]
    return losses, {name: p.detach().clone() for name, p in t.model.named_parameters()}
