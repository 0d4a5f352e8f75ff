"""Fine-tuning a Llama-3.2-1B-shaped model at L = 2048 on an 80 GiB card, by ``autotune.estimate`` (fake
trials: no memory is spent, no weights are read): full fine-tune in fp32 weights, in bf16 weights, and LoRA
r = 16 over bf16 weights.

    .venv/bin/python bench/finetune.py
    .venv/bin/python bench/finetune.py --cases lora-bf16 --output bench/results/finetune.json

The config is Llama 3.2 1B's shape (vocab 128,256, hidden 2048, 16 layers, 32 heads, 8 key-value heads,
intermediate 8192, tied embeddings), written to a temporary folder as a user's config.json would be and
loaded as ``hf:DIR?...`` exactly as ``autotune estimate hf:DIR --weights-dtype bf16 --lora-rank 16`` loads it.
Every case trains with AdamW under bf16 autocast (``--precision bf16``). Beside each m_max: the bytes of
weights, gradients and AdamW's two moments, from the model's own parameters (each shared one counted once:
the tied embedding is one tensor), what is trainable and its dtype; AdamW's per-parameter ``step`` scalars
are left out. Figures only; the seconds are this machine's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB = 1 << 30
SEQ_LEN = 2048
BUDGET_BYTES = 80 * GiB
LLAMA_1B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# case -> the options hf: specs carry (what --weights-dtype and --lora-rank write).
CASES: dict[str, dict[str, Any]] = {
    "full-fp32": {},
    "full-bf16": {"weights_dtype": "bf16"},
    "lora-bf16": {"weights_dtype": "bf16", "lora_rank": 16},
}


def static_bytes(task: Any) -> dict[str, int]:
    """Weights, gradients and AdamW moments from the model's parameters, each tensor once."""
    import torch

    with torch.device("meta"):
        model = task.model()
    weights = gradients = 0
    for param in {id(p): p for p in model.parameters()}.values():
        size = param.numel() * param.element_size()
        weights += size
        if param.requires_grad:
            gradients += size
    return {"weights_bytes": weights, "gradients_bytes": gradients, "optimizer_bytes": 2 * gradients}


def run_case(directory: Path, name: str) -> dict[str, Any]:
    from autotune.orchestrate.estimate import EstimateConfig, estimate
    from autotune.tasks.hf import with_options
    from autotune.tasks.load import load_task

    task = load_task(with_options(f"hf:{directory}", **CASES[name])).at_length(SEQ_LEN)
    started = time.perf_counter()
    profile = estimate(
        task, EstimateConfig.of(budget_bytes=BUDGET_BYTES, device_kind="cuda", precision="bf16", target_batch=256)
    )
    seconds = time.perf_counter() - started
    m_max = profile.max_micro_batch
    return {
        "case": name,
        "task": task.name,
        "seq_len": SEQ_LEN,
        "m_max": m_max,
        "peak_at_m_max_bytes": profile.peak_at(m_max),
        **static_bytes(task),
        "fake_trials": len(profile.trials),
        "seconds": round(seconds, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="finetune-") as root:
        directory = Path(root) / "llama-3.2-1b"
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(LLAMA_1B, indent=2))
        for name in args.cases.split(","):
            row = run_case(directory, name)
            rows.append(row)
            peak = (row["peak_at_m_max_bytes"] or 0) / GiB
            print(
                f"{row['case']:<10} {row['task']:<24} m_max {row['m_max']:>3} at L={SEQ_LEN}  "
                f"weights {row['weights_bytes'] / GiB:6.2f} GiB  gradients {row['gradients_bytes'] / GiB:6.2f} GiB  "
                f"AdamW {row['optimizer_bytes'] / GiB:6.2f} GiB  peak {peak:6.2f} GiB  "
                f"{row['fake_trials']} fake trials  {row['seconds']:.1f}s",
                flush=True,
            )
    if args.output:
        args.output.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
