"""The loss as the job computes it (``--loss``): a Llama-3.2-1B-shaped model at L = 2048 on an emulated H100
(``autotune estimate --gpu h100``: fake trials under the CUDA build of torch, reserved bytes by the allocator's
model), with the plain loss, TRL's chunked NLL (its default chunk of 256 tokens) and Liger's fused linear cross
entropy.

    .venv/bin/python bench/losses.py
    .venv/bin/python bench/losses.py --losses plain,fused-linear --output bench/results/losses.json

The config is Llama 3.2 1B's shape (vocabulary 128,256, hidden 2048, 16 layers, tied embeddings; as
bench/finetune.py writes it), bf16 weights under bf16 autocast, AdamW. Beside each m_max: the peak at m_max, where
it sits (the breakdown's peak event: its index in the trial, and the op and phase), the m_max ratio to the plain
loss's in the same run, the fake trials and the seconds (this machine's). Figures only.
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

from bench.finetune import LLAMA_1B  # noqa: E402

GiB = 1 << 30
SEQ_LEN = 2048
LOSSES = ("plain", "chunked", "fused-linear")


def run_case(directory: Path, loss: str) -> dict[str, Any]:
    from autotune.orchestrate.estimate import EstimateConfig, estimate
    from autotune.tasks.hf import with_options
    from autotune.tasks.load import load_task

    task = load_task(with_options(f"hf:{directory}", weights_dtype="bf16")).at_length(SEQ_LEN)
    config = EstimateConfig.of(gpu="h100", precision="bf16", target_batch=256, lm_loss=loss, breakdown=True)
    started = time.perf_counter()
    profile = estimate(task, config)
    seconds = time.perf_counter() - started
    m_max = profile.max_micro_batch
    at_max = next((b for b in profile.breakdown or () if b.micro_batch == m_max), None)
    return {
        "loss": loss,
        "task": task.name,
        "seq_len": SEQ_LEN,
        "m_max": m_max,
        "peak_at_m_max_bytes": profile.peak_at(m_max),
        "peak_event": None if at_max is None else at_max.peak_event,
        "peak_where": None if at_max is None else at_max.peak_where,
        "fake_trials": len(profile.trials),
        "seconds": round(seconds, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="losses-") as root:
        directory = Path(root) / "llama-3.2-1b"
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(LLAMA_1B, indent=2))
        for loss in args.losses.split(","):
            row = run_case(directory, loss)
            plain = next((r for r in rows if r["loss"] == "plain"), None)
            row["m_max_over_plain"] = (
                None if plain is None or not plain["m_max"] else round(row["m_max"] / plain["m_max"], 2)
            )
            rows.append(row)
            peak = (row["peak_at_m_max_bytes"] or 0) / GiB
            ratio = "" if row["m_max_over_plain"] is None else f"  x{row['m_max_over_plain']} the plain loss's"
            print(
                f"{row['loss']:<13} {row['task']:<16} m_max {row['m_max']:>3} at L={SEQ_LEN}  peak {peak:6.2f} GiB at "
                f"{row['peak_where']}{ratio}  {row['fake_trials']} fake trials  {row['seconds']:.1f}s",
                flush=True,
            )
    if args.output:
        args.output.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
