"""Meshes on emulated cards (issue 34): m_max per rank of Llama 3.1 8B-, 70B- and Mixtral 8x7B-shaped configs at
L = 8192 on emulated H100s (80 GB), one `autotune estimate` per mesh, as a user runs it.

    nice .venv/bin/python bench/meshes.py                                  # every mesh (minutes each; 1-2 GiB RSS)
    nice .venv/bin/python bench/meshes.py --only 8b                        # one model
    nice .venv/bin/python bench/meshes.py --only 70b --mesh "fsdp 64"      # one mesh of one model
    nice .venv/bin/python bench/meshes.py --published                      # torchtitan's published rows (issue 45)

8B and Mixtral run at 8 ranks, the issue's meshes: fsdp 8; tp 8; fsdp 4 x tp 2; fsdp 2 x tp 2 x pp 2 (1F1B, K = 8);
pp 2 alone; cp 2. 70B runs at 64 ranks, as the field runs it (at 8 ranks its bf16 weights, gradients and AdamW
states alone exceed 80 GB a rank on every mesh): fsdp 64; fsdp 8 x tp 8; fsdp 4 x tp 8 x pp 2 (1F1B, K = 8);
fsdp 32 x cp 2; ddp 32 x cp 2; fsdp 4 x tp 8 x cp 2.
Pipelines compose with fsdp and tp (1F1B and GPipe; autotune/measure/pipeline/). Context parallelism composes
with ddp and fsdp (FSDP2 over the dp x cp ranks, torchtitan's dp_shard_cp; autotune/cli/inputs.py refuses it beside
pp, or beside tp over ddp, in one line): its rows are fsdp x cp 2, ddp x cp 2 and fsdp x tp x cp 2. What the
project cannot estimate yet is printed as its one-line refusal or error ("micro-batch 1 does not fit" included),
so the table says where the answer stops.
A pipeline's row adds each stage's figure at m_max, the most loaded stage and the bubble. Mixtral 8x7B's shapes
(8 experts, top-2) run beside the Llamas. AdamW runs with foreach=false under tp: foreach AdamW fails on
lists that mix plain tensors (the norms, outside the tp plan) and DTensors, as the real job would. Each row gives
m_max per rank (the most loaded rank or stage), the reserved bytes at m = 1, the wall seconds and the peak RSS of
the CLI and its emulation child (wait4). Figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
MODELS = {
    "8b": "hf:examples/configs/llama-3.1-8b.json?weights_dtype=bf16&optimizer=AdamW:foreach=false",
    "70b": "hf:bench/configs/llama-3.1-70b.json?weights_dtype=bf16&optimizer=AdamW:foreach=false",
    # Mixtral 8x7B's shapes: 8 experts, top-2 routing, routed evenly (--moe-load-factor 1, the default).
    "mixtral": "hf:bench/configs/mixtral-8x7b.json?weights_dtype=bf16&optimizer=AdamW:foreach=false",
}
COMMON = ("--gpu", "h100", "--precision", "bf16", "--seq-len", "8192", "--ac", "full", "--max-micro-batch", "8")
MESHES = {
    "fsdp 8": ("--strategy", "fsdp", "--world-size", "8"),
    "tp 8": ("--world-size", "8", "--tp", "8"),
    "fsdp 4 x tp 2": ("--strategy", "fsdp", "--world-size", "8", "--tp", "2"),
    "fsdp 2 x tp 2 x pp 2 (1F1B, K 8)": (
        "--strategy", "fsdp", "--world-size", "8", "--tp", "2", "--pp", "2", "--pp-schedule", "1f1b",
        "--pp-microbatches", "8",
    ),
    "pp 2 (1F1B, K 8)": ("--world-size", "2", "--pp", "2", "--pp-schedule", "1f1b", "--pp-microbatches", "8"),
    # FSDP2 over all 8 ranks (the cp pair shares the shards: dp_shard_cp), each cp pair splitting the sequence.
    "fsdp 4 x cp 2": ("--strategy", "fsdp", "--world-size", "8", "--cp", "2"),
    # DDP over every rank, each holding the whole model (autotune/measure/context_parallel.py).
    "ddp 4 x cp 2": ("--world-size", "8", "--cp", "2"),
    # torchtitan's long-context 3-D mesh: tp inside each cp rank, FSDP2 over the dp x cp ranks.
    "fsdp 2 x tp 2 x cp 2": ("--strategy", "fsdp", "--world-size", "8", "--tp", "2", "--cp", "2"),
}  # fmt: skip
# 70B at 64 ranks: at 8 its weights, gradients and AdamW states alone exceed a rank's 80 GB on every mesh.
MESHES_64 = {
    "fsdp 64": ("--strategy", "fsdp", "--world-size", "64"),
    "fsdp 8 x tp 8": ("--strategy", "fsdp", "--world-size", "64", "--tp", "8"),
    "fsdp 4 x tp 8 x pp 2 (1F1B, K 8)": (
        "--strategy", "fsdp", "--world-size", "64", "--tp", "8", "--pp", "2", "--pp-schedule", "1f1b",
        "--pp-microbatches", "8",
    ),
    # FSDP2 over all 64 ranks, each cp pair splitting the sequence; and under ddp, the whole model on every rank.
    "fsdp 32 x cp 2": ("--strategy", "fsdp", "--world-size", "64", "--cp", "2"),
    "ddp 32 x cp 2": ("--world-size", "64", "--cp", "2"),
    "fsdp 4 x tp 8 x cp 2": ("--strategy", "fsdp", "--world-size", "64", "--tp", "8", "--cp", "2"),
}  # fmt: skip
MESHES_OF = {"8b": MESHES, "70b": MESHES_64, "mixtral": MESHES}

# torchtitan's published rows (benchmarks/llama3_h100_202412_torchtitan.md: 96 GB H100s, L 8192, full checkpointing,
# torchtitan's tp plan), each estimated at the published local batch on emulated 96 GB H100s with --tp-plan
# torchtitan, beside the published memory (GiB, the most loaded rank's). Their float8 and torch.compile cannot be
# expressed in an estimate (fake trials run the eager bf16 model): the closest expressible row is bf16 eager, fp32
# weights under FSDP2's bf16 mixed precision, AdamW.
PUBLISHED_COMMON = (
    "--gpu", "h100-96gb", "--precision", "bf16", "--seq-len", "8192", "--ac", "full", "--strategy", "fsdp",
    "--tp-plan", "torchtitan",
)  # fmt: skip
PUBLISHED = {
    # Table 4: 2-D, FSDP 32 x TP 8 over 256 GPUs, local batch 16 (one micro-batch), float8 + compile: 71.9 GiB.
    "70B fsdp 32 x tp 8, local batch 16": (
        "hf:bench/configs/llama-3.1-70b.json", 16, 71.9,
        ("--world-size", "256", "--tp", "8", "--max-micro-batch", "32"),
    ),
    # Table 5: 3-D, FSDP 8 x TP 8 x PP 8 over 512 GPUs, local batch 32 as 8 micro-batches of 4, float8 + compile +
    # async TP: 82.5 GiB (1F1B) and 72.7 GiB (interleaved 1F1B; V 2 stages per rank assumed).
    "405B fsdp 8 x tp 8 x pp 8, 1F1B, 8 x 4": (
        "hf:bench/configs/llama-3.1-405b.json", 4, 82.5,
        ("--world-size", "512", "--tp", "8", "--pp", "8", "--pp-schedule", "1f1b", "--pp-microbatches", "8",
         "--max-micro-batch", "8"),
    ),
    "405B fsdp 8 x tp 8 x pp 8, interleaved 1F1B (V 2), 8 x 4": (
        "hf:bench/configs/llama-3.1-405b.json", 4, 72.7,
        ("--world-size", "512", "--tp", "8", "--pp", "8", "--pp-schedule", "interleaved-1f1b",
         "--pp-virtual-stages", "2", "--pp-microbatches", "8", "--max-micro-batch", "8"),
    ),
}  # fmt: skip


def run(model: str, mesh: tuple[str, ...], common: tuple[str, ...] = COMMON, at: int = 1) -> dict[str, object]:
    """One estimate in a child process: its m_max and reserved bytes at m = ``at`` (or its error line), seconds,
    RSS."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "profile.json"
        command = [sys.executable, "-m", "autotune.cli", "estimate", model, *common, *mesh, "--output", str(out)]
        if at != 1:
            command += ["--micro-batches", str(at)]
        started = time.perf_counter()
        with open(Path(folder) / "err", "w+") as err:
            process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(process.pid, 0)
            code = os.waitstatus_to_exitcode(status)
            err.seek(0)
            lines = [line for line in err.read().splitlines() if line.startswith("autotune:")]
        result: dict[str, object] = {"seconds": time.perf_counter() - started, "rss_bytes": usage.ru_maxrss * 1024}
        if code != 0 or not out.exists():
            result["error"] = lines[-1] if lines else f"exit {code}, no profile written"
            return result
        profile = json.loads(out.read_text())
    profile = profile[0] if isinstance(profile, list) else profile
    result["max_micro_batch"] = profile["max_micro_batch"]
    stages = profile.get("pipeline")
    if stages:  # each stage's figure at m_max (reserved + outside), the most loaded, the bubble
        figures = " / ".join(f"{peak / GiB:.2f}" for peak in stages["stage_peak_bytes"])
        result["note"] = (
            f"stages {figures} GiB at m_max, most loaded {stages['most_loaded_stage']}, "
            f"bubble {stages['bubble_fraction']:.3f}"
        )
    at_one = next((t for t in profile["trials"] if t["micro_batch"] == at), None)
    if at_one is not None:
        result["reserved_at_1"] = at_one["peak_bytes"] - (at_one.get("outside_allocator_bytes") or 0)
    return result


def published() -> None:
    """torchtitan's published rows: the estimate's reserved bytes on the most loaded rank at the published local
    batch beside the published memory, the gap, m_max, wall seconds and RSS."""
    print(f"{'row':58} {'m':>3} {'published':>10} {'estimate':>10} {'gap':>7} {'m_max':>5} {'wall s':>7} {'RSS':>9}")
    for label, (model, m, figure, mesh) in PUBLISHED.items():
        got = run(model, mesh, PUBLISHED_COMMON, at=m)
        reserved = got.get("reserved_at_1")
        seconds, rss_bytes = float(str(got["seconds"])), int(str(got["rss_bytes"]))
        if isinstance(reserved, int):
            estimate, gap = f"{reserved / GiB:.2f} GiB", f"{(reserved / GiB - figure) / figure:+.1%}"
        else:
            estimate, gap = "-", "-"
        print(
            f"{label:58} {m:>3} {figure:>6.1f} GiB {estimate:>10} {gap:>7} {got.get('max_micro_batch', '-')!s:>5} "
            f"{seconds:7.0f} {rss_bytes / GiB:7.2f} GiB  {got.get('error', got.get('note', ''))}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--only", choices=sorted(MODELS), help="one model")
    parser.add_argument("--mesh", choices=sorted({*MESHES, *MESHES_64}), help="one mesh")
    parser.add_argument(
        "--published", action="store_true", help="torchtitan's published 70B (2-D) and 405B (3-D) rows instead"
    )
    args = parser.parse_args(argv)
    if args.published:
        published()
        return 0
    chosen = [args.only] if args.only else list(MODELS)
    if args.mesh and not any(args.mesh in MESHES_OF[name] for name in chosen):
        parser.error(f"--mesh {args.mesh!r}: not a mesh of {' or '.join(chosen)} (70b runs at 64 ranks)")
    print(f"{'model':7} {'mesh':34} {'m_max':>5} {'reserved@1':>11} {'wall s':>7} {'RSS':>9}  note")
    for name, model in MODELS.items():
        if args.only and name != args.only:
            continue
        for label, mesh in MESHES_OF[name].items():
            if args.mesh and label != args.mesh:
                continue
            got = run(model, mesh)
            reserved = got.get("reserved_at_1")
            shown = f"{reserved / GiB:.2f} GiB" if isinstance(reserved, int) else "-"
            seconds, rss_bytes = float(str(got["seconds"])), int(str(got["rss_bytes"]))
            print(
                f"{name:7} {label:34} {got.get('max_micro_batch', '-')!s:>5} {shown:>11} "
                f"{seconds:7.0f} {rss_bytes / GiB:7.2f} GiB  {got.get('error', got.get('note', ''))}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
