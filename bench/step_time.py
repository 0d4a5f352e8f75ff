"""Predicted step times on emulated cards against published runs (issue 65): torchtitan's Llama 3.1 8B on 96 GB H100s.

    .venv/bin/python bench/step_time.py                 # record each row's fake step (minutes a row), price, print
    .venv/bin/python bench/step_time.py --reprice       # price the saved records again (seconds)

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
# The card's peak is not known (torchtitan: between the H100 NVL's 835 and the SXM's 989 TFLOPS bf16): the estimate
# runs at the upper bound and the records are priced at both. The run's torch (2024-12-23) ran FlashAttention-2 for
# SDPA on an H100 (cuDNN was opt-in then: pytorch/pytorch#138522, #141133, #142132); today's picks cuDNN, and
# --sdpa-backend flash cannot run under --ac op here (the kernel is chosen around the forward only, so the recompute
# in backward takes cuDNN and op-level checkpointing finds another op than it saved). The records of today's kernel
# are priced as FlashAttention-2's (the same FLOPs; KERNEL_THEN), and as cuDNN's beside it.
PEAK_BOUNDS = (835.0, 989.0)
KERNEL_THEN = "flash"
COMMON_8B = (
    "--gpu", "h100-96gb", "--peak-tflops", "989", "--precision", "bf16", "--seq-len", "8192", "--max-seq-len",
    "8192", "--ac", "op", "--strategy", "fsdp", "--max-micro-batch", "2", "--no-breakdown",
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


def as_kernel(steps: list[dict[str, Any]], kernel: str | None) -> list[dict[str, Any]]:
    """The records with every attention kernel priced as ``kernel``'s (None: as recorded)."""
    if kernel is None:
        return steps
    changed = json.loads(json.dumps(steps))
    for step in changed:
        for op in step["ops"]:
            if op["kind"] == "attention":
                op["kernel"] = kernel
    return changed


def price(name: str, overrides: Any, kernel: str | None = KERNEL_THEN) -> dict[str, Any]:
    """The row's saved records priced on its card with the figures given, attention as ``kernel``'s."""
    from autotune.core.mesh import Mesh
    from autotune.core.schemas import Profile
    from autotune.orchestrate.config import card_of
    from autotune.orchestrate.predicted import predicted_throughput

    kept = json.loads((RECORDS / f"{name}.records.json").read_text())
    profile_data = json.loads((RECORDS / f"{name}.profile.json").read_text())
    profile = Profile.model_validate(profile_data[0] if isinstance(profile_data, list) else profile_data)
    warnings: list[str] = []
    made = predicted_throughput(
        as_kernel(kept["steps"], kernel),
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
    parser.add_argument("--only", choices=sorted(RUNS), help="one record")
    args = parser.parse_args(argv)
    names = [args.only] if args.only else list(RUNS)
    if not args.reprice:
        for name in names:
            print(f"recording {name} ...", file=sys.stderr, flush=True)
            record(name)
    low, high = (
        {
            name: price(name, FigureOverrides(peak_tflops=peak))
            for name in names
            if (RECORDS / f"{name}.records.json").exists()
        }
        for peak in PEAK_BOUNDS
    )
    print(
        f"source: {TORCHTITAN}; emulated h100-96gb, its bf16 peak between {PEAK_BOUNDS[0]:g} and "
        f"{PEAK_BOUNDS[1]:g} TFLOPS"
    )
    print(f"{'row':44} {'predicted (835..989)':>22} {'published':>10} {'gap':>15}")
    predicted_of: dict[str, tuple[float, float]] = {}
    for row, name, published, beyond in ROWS:
        if name not in low:
            continue
        slow, fast = (found[name]["throughput"].tokens_per_second_per_gpu or 0.0 for found in (low, high))
        predicted_of[row] = (slow, fast)
        gaps = f"{(slow - published) / published:+.1%}..{(fast - published) / published:+.1%}"
        note = f"  out of reach ({beyond}: fake trials run the eager bf16 step)" if beyond else ""
        print(f"{row:44} {slow:10,.0f}..{fast:<10,.0f} {published:10,.0f} {gaps:>15}{note}")
    recorded = {name: price(name, FigureOverrides(peak_tflops=PEAK_BOUNDS[1]), kernel=None) for name in low}
    for name, found in recorded.items():
        tokens = found["throughput"].tokens_per_second_per_gpu or 0.0
        print(f"  {name} with today's cuDNN attention as recorded, at 989: {tokens:,.0f} tokens/s per GPU")
    for name in low:
        for peak, found in zip(PEAK_BOUNDS, (low, high), strict=True):
            timing = found[name]["throughput"]
            parts = timing.parts
            print(
                f"  {name} at {peak:g} TFLOPS: step {timing.seconds_per_update:.3f} s = compute "
                f"{parts.compute_seconds:.3f} s (recomputing {parts.recompute_seconds:.3f}) + exposed communication "
                f"{parts.exposed_communication_seconds:.3f} s + optimizer {parts.optimizer_seconds:.3f} s; MFU "
                f"{timing.mfu or 0:.1%}"
            )
    print("pairs of eager rows (published order; predicted order at both bounds):")
    rows = [(row, published) for row, name, published, beyond in ROWS if name in low and beyond is None]
    for i, (a, pa) in enumerate(rows):
        for b, pb in rows[i + 1 :]:
            same = all((pa > pb) == (predicted_of[a][j] > predicted_of[b][j]) for j in (0, 1))
            order = "right order" if same else "WRONG ORDER"
            print(f"  {a} {'>' if pa > pb else '<'} {b}: predicted {predicted_of[a][1]:,.0f} against "
                  f"{predicted_of[b][1]:,.0f} (at 989), {order}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
