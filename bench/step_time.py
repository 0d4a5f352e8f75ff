"""Predicted step times on emulated cards against published runs (issue 65).

    .venv/bin/python bench/step_time.py                 # record each run (minutes a run), price, print
    .venv/bin/python bench/step_time.py --reprice       # price the saved records again (seconds)
    .venv/bin/python bench/step_time.py --only 8b-fsdp8 # one run

Each run is `autotune estimate` as a user runs it (the CLI, in this process) on the emulated card the published run
used, at its local batch (--max-micro-batch) and setup; the records the estimate priced are saved under
bench/results/step_time/ so that they can be priced again without the fake trials (--reprice). Printed per row: the
predicted tokens/s per GPU, the published figure and the gap; the parts of each run's step; every published pair of
eager rows with its order, predicted and published. A row the emulation cannot express (torch.compile, float8) is
priced eager and said to be out of reach, with how far the eager prediction is from it.

Sources:
- pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3: Llama 3.1 8B, FSDP over 8 and 128
  96 GB H100s (HBM2e 2.4 TB/s, NVLink within 8, 400 Gb/s a GPU between hosts, 500 W), local batch 2, op-level SAC,
  L 8192, bf16, AdamW; torch of 2024-12-23. The card's peak is not known (torchtitan: between the H100 NVL's 835 and
  the SXM's 989 TFLOPS bf16): each row is priced at both bounds.
- mosaicml/llm-foundry scripts/train/benchmarking/README.md, "H100 80GB BF16": MPT-7B, FSDP FULL_SHARD over 8 H100
  80GB, amp_bf16, at L 2048 (micro-batch 6, no checkpointing), 4096 (16 x 2, full) and 8192 (8 x 2, full). MPT is
  not a transformers model the fake trials load as MosaicML ran it (ALiBi, its Triton/flash attention, low-precision
  LayerNorm): the runs are of a GPT-2 block of MPT-7B's shapes (bench/configs/mpt-7b-shapes-gpt2.json: d 4096, 32
  layers, 32 heads, MLP 4d, vocab 50432, tied embeddings), bf16 autocast over FSDP2's bf16 mixed precision.

Attention is priced as FlashAttention-2's for both sources (the kernel their torch ran: torchtitan's torch picked it
for SDPA on an H100 in December 2024, cuDNN being opt-in then, pytorch/pytorch#141133, #142132; llm-foundry ran its
own flash attention); today's torch picks cuDNN, whose prediction is printed beside. --sdpa-backend flash cannot run
under --ac op here: the kernel is chosen around the forward only, so the recompute in backward takes cuDNN and
op-level checkpointing finds another op than it saved; the records of today's kernel are priced as flash's (the same
FLOPs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "bench" / "results" / "step_time"
KERNEL_THEN = "flash"
TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
LLM_FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md (H100 80GB BF16)"
LLAMA_8B = "hf:examples/configs/llama-3.1-8b.json"
MPT_7B = "hf:bench/configs/mpt-7b-shapes-gpt2.json"
COMMON_8B = (
    "--gpu", "h100-96gb", "--peak-tflops", "989", "--precision", "bf16", "--seq-len", "8192", "--max-seq-len",
    "8192", "--ac", "op", "--strategy", "fsdp", "--max-micro-batch", "2", "--no-breakdown",
)  # fmt: skip
COMMON_MPT = ("--gpu", "h100", "--precision", "bf16-autocast", "--strategy", "fsdp", "--world-size", "8",
              "--no-breakdown")  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One recorded estimate: its CLI arguments, its card and the peaks (TFLOPS) it is priced at (None: the
    catalog's)."""

    args: tuple[str, ...]
    card: str
    peaks: tuple[float | None, ...] = (None,)


def _mpt(length: int, micro_batch: int, steps: int, policy: str) -> Run:
    lengths = ("--seq-len", str(length), "--max-seq-len", str(length))
    plan = ("--max-micro-batch", str(micro_batch), "--target-batch", str(micro_batch * steps * 8))
    return Run((MPT_7B, *COMMON_MPT, *lengths, *plan, "--ac", policy), "h100")


RUNS: dict[str, Run] = {
    "8b-fsdp8": Run((LLAMA_8B, *COMMON_8B, "--world-size", "8", "--target-batch", "16"), "h100-96gb", (835.0, 989.0)),
    "8b-fsdp128": Run(
        (LLAMA_8B, *COMMON_8B, "--world-size", "128", "--target-batch", "256"), "h100-96gb", (835.0, 989.0)
    ),
    "mpt7b-2k": _mpt(2048, 6, 1, "none"),
    "mpt7b-4k": _mpt(4096, 16, 2, "full"),
    "mpt7b-8k": _mpt(8192, 8, 2, "full"),
}
# (source, row, run, published tokens/s per GPU, what the published run did that an estimate cannot: None if nothing)
ROWS: list[tuple[str, str, str, float, str | None]] = [
    (TORCHTITAN, "Table 1: 8B, FSDP 8", "8b-fsdp8", 5762, None),
    (TORCHTITAN, "Table 1: 8B, FSDP 8 + compile", "8b-fsdp8", 6667, "torch.compile"),
    (TORCHTITAN, "Table 1: 8B, FSDP 8 + compile + float8", "8b-fsdp8", 8532, "torch.compile and float8"),
    (TORCHTITAN, "Table 3: 8B, FSDP 128", "8b-fsdp128", 5605, None),
    (TORCHTITAN, "Table 3: 8B, FSDP 128 + compile", "8b-fsdp128", 6514, "torch.compile"),
    (TORCHTITAN, "Table 3: 8B, FSDP 128 + compile + float8", "8b-fsdp128", 8380, "torch.compile and float8"),
    (LLM_FOUNDRY, "MPT-7B, L 2048, 6 x 1, no AC", "mpt7b-2k", 10643, None),
    (LLM_FOUNDRY, "MPT-7B, L 4096, 16 x 2, full AC", "mpt7b-4k", 8611, None),
    (LLM_FOUNDRY, "MPT-7B, L 8192, 8 x 2, full AC", "mpt7b-8k", 6935, None),
]


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
        code = main(["estimate", *RUNS[name].args, "--output", str(out)])
    finally:
        predicted.predicted_throughput = original  # type: ignore[assignment]
    if code != 0 or "steps" not in saved:
        raise SystemExit(f"{name}: the estimate failed (exit {code}) or recorded no step")
    kept = {"run": list(RUNS[name].args), "seconds": round(time.perf_counter() - started, 1), "steps": saved["steps"]}
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


def price(name: str, peak: float | None, kernel: str | None = KERNEL_THEN) -> Any:
    """The row's saved records priced on its card (at ``peak`` TFLOPS, None: the catalog's), attention as
    ``kernel``'s: the profile's last Throughput (the plan's update)."""
    from autotune.core.mesh import Mesh
    from autotune.core.schemas import Profile
    from autotune.core.step_time import FigureOverrides
    from autotune.orchestrate.config import card_of
    from autotune.orchestrate.predicted import predicted_throughput

    kept = json.loads((RECORDS / f"{name}.records.json").read_text())
    data = json.loads((RECORDS / f"{name}.profile.json").read_text())
    profile = Profile.model_validate(data[0] if isinstance(data, list) else data)
    warnings: list[str] = []
    made = predicted_throughput(
        as_kernel(kept["steps"], kernel),
        card_of(RUNS[name].card),
        precision=profile.precision,
        world_size=profile.world_size,
        mesh=Mesh.from_dict(profile.mesh),
        max_micro_batch=profile.max_micro_batch,
        plan=profile.plan,
        overrides=FigureOverrides(peak_tflops=peak),
        warnings=warnings,
    )
    if not made:
        raise SystemExit(f"{name}: no prediction: {warnings}")
    return made[-1]


def _range(values: list[float]) -> str:
    return f"{values[0]:,.0f}" if len(values) == 1 else f"{values[0]:,.0f}..{values[-1]:,.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--reprice", action="store_true", help="price the saved records again (no fake trials)")
    parser.add_argument("--only", choices=sorted(RUNS), help="one run")
    args = parser.parse_args(argv)
    names = [args.only] if args.only else list(RUNS)
    if not args.reprice:
        for name in names:
            print(f"recording {name} ...", file=sys.stderr, flush=True)
            record(name)
    recorded = [name for name in RUNS if (RECORDS / f"{name}.records.json").exists()]
    priced = {name: [price(name, peak) for peak in RUNS[name].peaks] for name in recorded}
    predicted_of: dict[str, list[float]] = {}
    source = None
    for row_source, row, name, published, beyond in ROWS:
        if name not in priced:
            continue
        if row_source != source:
            source = row_source
            print(f"\n{source}")
            print(f"{'row':44} {'predicted':>16} {'published':>10} {'gap':>15}  MFU predicted")
        tokens = [timing.tokens_per_second_per_gpu or 0.0 for timing in priced[name]]
        predicted_of[row] = tokens
        gaps = "..".join(f"{(value - published) / published:+.1%}" for value in tokens)
        note = f"  out of reach ({beyond}: fake trials run the eager bf16 step)" if beyond else ""
        update = " + ".join(f"{count}x{size}" for size, count in priced[name][-1].micro_batches)
        note = f"  (update {update}){note}"
        mfu = "..".join(f"{timing.mfu or 0:.1%}" for timing in priced[name])
        print(f"{row:44} {_range(tokens):>16} {published:10,.0f} {gaps:>15}  {mfu}{note}")
    print("\nthe parts of each run's predicted step (seconds):")
    for name in recorded:
        for peak, timing in zip(RUNS[name].peaks, priced[name], strict=True):
            parts = timing.parts
            at = f" at {peak:g} TFLOPS" if peak else ""
            print(
                f"  {name}{at}: update {timing.seconds_per_update:.3f} = compute {parts.compute_seconds:.3f} "
                f"(recomputing {parts.recompute_seconds:.3f}) + exposed communication "
                f"{parts.exposed_communication_seconds:.3f} + optimizer {parts.optimizer_seconds:.3f}"
            )
        today = price(name, RUNS[name].peaks[-1], kernel=None)
        print(f"  {name} with the attention kernel as recorded (today's torch): "
              f"{today.tokens_per_second_per_gpu or 0:,.0f} tokens/s per GPU")  # fmt: skip
    print("\npairs of eager rows of one source (published order; predicted order at every peak):")
    eager = [(src, row, published) for src, row, name, published, beyond in ROWS if row in predicted_of and not beyond]
    for i, (source_a, a, pa) in enumerate(eager):
        for source_b, b, pb in eager[i + 1 :]:
            if source_a != source_b:
                continue
            same = all((pa > pb) == (x > y) for x, y in zip(predicted_of[a], predicted_of[b], strict=True))
            print(f"  {a} {'>' if pa > pb else '<'} {b}: predicted {_range(predicted_of[a])} against "
                  f"{_range(predicted_of[b])}, {'right order' if same else 'WRONG ORDER'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
