"""Predicted step times on emulated cards against published runs (issue 65): torchtitan's Llama 3.1 8B on 96 GB H100s.

    .venv/bin/python bench/step_time.py                 # record each row's fake step (minutes a row), price, print
    .venv/bin/python bench/step_time.py --reprice       # price the saved records again (seconds): other figures
    .venv/bin/python bench/step_time.py --reprice --peak-tflops 835   # the H100 NVL's peak, torchtitan's lower bound

Each row is `autotune estimate` as a user runs it (the CLI, in this process) on the emulated card the run used, at
the published local batch (--max-micro-batch), under the published setup; the records it priced are saved under
bench/results/step_time/ so that other figures can be priced without the fake trials (--reprice). Printed per row:
predicted tokens/s per GPU, the published figure, the gap, the parts of the step; then every published pair of rows
with its order, predicted and published. A row the emulation cannot express (torch.compile, float8) is priced
eager and said to be out of reach, with how far the eager prediction is from it.

Sources: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Tables 1 and 3: FSDP, local batch 2,
selective (op) activation checkpointing, L 8192; 96 GB HBM2e H100s at 500 W, 2.4 TB/s, NVLink within 8, 400 Gb/s a
GPU between hosts; torch of 2024-12-23).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "bench" / "results" / "step_time"
LLAMA_8B = "hf:examples/configs/llama-3.1-8b.json"
TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
# torchtitan's 8B rows: FSDP over 8 or 128 H100s (96 GB), bf16 (fp32 weights, bf16 FSDP2 mixed precision), AdamW,
# op-level SAC, L 8192, local batch 2 (one micro-batch a step).
COMMON_8B = (
    "--gpu", "h100-96gb", "--precision", "bf16", "--seq-len", "8192", "--max-seq-len", "8192", "--ac", "op",
    "--strategy", "fsdp", "--max-micro-batch", "2", "--no-breakdown",
)  # fmt: skip
# (row, record, published tokens/s per GPU, what the published run did that an estimate cannot: None if nothing)
ROWS: list[tuple[str, str, float, str | None]] = [
    ("Table 1: 8B, FSDP 8", "8b-fsdp8", 5762, None),
    ("Table 1: 8B, FSDP 8 + compile", "8b-fsdp8", 6667, "torch.compile"),
    ("Table 1: 8B, FSDP 8 + compile + float8", "8b-fsdp8", 8532, "torch.compile and float8"),
    ("Table 3: 8B, FSDP 128", "8b-fsdp128", 5605, None),
    ("Table 3: 8B, FSDP 128 + compile", "8b-fsdp128", 6514, "torch.compile"),
    ("Table 3: 8B, FSDP 128 + compile + float8", "8b-fsdp128", 8380, "torch.compile and float8"),
]
RUNS: dict[str, tuple[str, ...]] = {
    "8b-fsdp8": (LLAMA_8B, *COMMON_8B, "--world-size", "8", "--target-batch", "16"),
    "8b-fsdp128": (LLAMA_8B, *COMMON_8B, "--world-size", "128", "--target-batch", "256"),
}


def record(name: str) -> dict[str, Any]:
    """Run the row's estimate (the CLI, here) and save the records it priced and its profile."""
    import autotune.orchestrate.predicted as predicted
    from autotune.cli import main

    saved: dict[str, Any] = {}
    original = predicted.predicted_throughput

    def keep(steps: Any, *args: Any, **kwargs: Any) -> Any:
        saved["steps"] = list(steps)
        return original(steps, *args, **kwargs)

    predicted.predicted_throughput = keep  # type: ignore[assignment]
    out = RECORDS / f"{name}.profile.json"
    RECORDS.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        code = main(["estimate", *RUNS[name], "--output", str(out)])
    finally:
        predicted.predicted_throughput = original  # type: ignore[assignment]
    if code != 0 or "steps" not in saved:
        raise SystemExit(f"{name}: the estimate failed (exit {code}) or recorded no step")
    kept = {"run": list(RUNS[name]), "seconds": round(time.perf_counter() - started, 1), "steps": saved["steps"]}
    (RECORDS / f"{name}.records.json").write_text(json.dumps(kept))
    return kept


def price(name: str, overrides: Any) -> dict[str, Any]:
    """The row's saved records priced on its card with the figures given."""
    from autotune.core.mesh import Mesh
    from autotune.core.schemas import Profile
    from autotune.orchestrate.config import card_of
    from autotune.orchestrate.predicted import predicted_throughput

    kept = json.loads((RECORDS / f"{name}.records.json").read_text())
    profile_data = json.loads((RECORDS / f"{name}.profile.json").read_text())
    profile = Profile.model_validate(profile_data[0] if isinstance(profile_data, list) else profile_data)
    warnings: list[str] = []
    made = predicted_throughput(
        kept["steps"],
        card_of("h100-96gb"),
        precision=profile.precision,
        world_size=profile.world_size,
        mesh=Mesh.from_dict(profile.mesh),
        max_micro_batch=profile.max_micro_batch,
        plan=profile.plan,
        overrides=overrides,
        warnings=warnings,
    )
    if not made:
        raise SystemExit(f"{name}: no prediction: {warnings}")
    return {"profile": profile, "throughput": made[-1], "warnings": warnings, "seconds": kept["seconds"]}


def main(argv: list[str] | None = None) -> int:
    from autotune.core.step_time import FigureOverrides

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--reprice", action="store_true", help="price the saved records again (no fake trials)")
    parser.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak (default the catalog's)")
    parser.add_argument("--only", choices=sorted(RUNS), help="one record")
    args = parser.parse_args(argv)
    overrides = FigureOverrides(peak_tflops=args.peak_tflops)
    names = [args.only] if args.only else list(RUNS)
    if not args.reprice:
        for name in names:
            print(f"recording {name} ...", file=sys.stderr, flush=True)
            record(name)
    priced = {name: price(name, overrides) for name in names}
    print(f"source: {TORCHTITAN}; card h100-96gb" + (f", --peak-tflops {args.peak_tflops:g}" if args.peak_tflops else ""))
    print(f"{'row':44} {'predicted':>10} {'published':>10} {'gap':>7}  parts of the predicted step")
    predicted_of: dict[str, float] = {}
    for row, name, published, beyond in ROWS:
        if name not in priced:
            continue
        timing = priced[name]["throughput"]
        tokens = timing.tokens_per_second_per_gpu or 0.0
        predicted_of[row] = tokens
        gap = (tokens - published) / published
        parts = timing.parts
        said = (
            f"compute {parts.compute_seconds:.3f} s (recompute {parts.recompute_seconds:.3f}), exposed comm "
            f"{parts.exposed_communication_seconds:.3f} s, optimizer {parts.optimizer_seconds:.3f} s, step "
            f"{timing.seconds_per_update:.3f} s, MFU {timing.mfu or 0:.1%}"
        )
        if beyond:
            said = f"out of reach ({beyond}: fake trials run the eager bf16 step); the eager prediction is {gap:+.1%}"
        print(f"{row:44} {tokens:10,.0f} {published:10,.0f} {gap:+7.1%}  {said}")
    print("pairs (published order; predicted order):")
    rows = [(row, published) for row, name, published, beyond in ROWS if name in priced and beyond is None]
    for i, (a, pa) in enumerate(rows):
        for b, pb in rows[i + 1 :]:
            same = (pa > pb) == (predicted_of[a] > predicted_of[b])
            print(f"  {a} {'>' if pa > pb else '<'} {b}: predicted {predicted_of[a]:,.0f} vs {predicted_of[b]:,.0f}, "
                  f"{'right order' if same else 'WRONG ORDER'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
