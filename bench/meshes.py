"""Meshes on emulated cards (issue 34): m_max per rank of Llama 3.1 8B-, 70B- and Mixtral 8x7B-shaped configs at
L = 8192 on emulated H100s (80 GB), one `autotune estimate` per mesh, as a user runs it.

    nice .venv/bin/python bench/meshes.py            # every mesh (minutes each; under 1 GiB of RSS)
    nice .venv/bin/python bench/meshes.py --only 8b  # one model

The meshes are the issue's: fsdp 8; fsdp 4 x tp 2; fsdp 2 x tp 2 x pp 2 (1F1B, K = 8); cp 2; and tp 8 alone. What
the project cannot estimate yet is printed as its one-line refusal or error (pp with tp or fsdp, cp with fsdp: cp
composes with ddp only, the ddp 4 x cp 2 row; Mixtral's expert tensor parallelism), so the table says where the
answer stops. A pipeline's row adds each stage's figure at
m_max, the most loaded stage and the bubble. Mixtral 8x7B's shapes (8 experts, top-2) run beside the Llamas.
AdamW runs with foreach=false under tp: foreach AdamW fails on lists that mix plain tensors (the norms, outside the
tp plan) and DTensors, as the real job would. Each row gives m_max per rank (the most loaded rank or stage), the
reserved bytes at m = 1, the wall seconds and the peak RSS of the CLI and its emulation child (wait4). Figures only.
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
    "fsdp 4 x cp 2": ("--strategy", "fsdp", "--world-size", "8", "--cp", "2"),
    # cp composes with ddp only today (autotune/measure/context_parallel.py): ddp over the 4 replicas of a cp 2 pair.
    "ddp 4 x cp 2": ("--world-size", "8", "--cp", "2"),
}  # fmt: skip


def run(model: str, mesh: tuple[str, ...]) -> dict[str, object]:
    """One estimate in a child process: its m_max and reserved bytes at m = 1 (or its error line), seconds, RSS."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "profile.json"
        command = [sys.executable, "-m", "autotune.cli", "estimate", model, *COMMON, *mesh, "--output", str(out)]
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
    at_one = next((t for t in profile["trials"] if t["micro_batch"] == 1), None)
    if at_one is not None:
        result["reserved_at_1"] = at_one["peak_bytes"] - (at_one.get("outside_allocator_bytes") or 0)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--only", choices=sorted(MODELS), help="one model")
    parser.add_argument("--mesh", choices=sorted(MESHES), help="one mesh")
    args = parser.parse_args(argv)
    print(f"{'model':7} {'mesh':34} {'m_max':>5} {'reserved@1':>11} {'wall s':>7} {'RSS':>9}  note")
    for name, model in MODELS.items():
        if args.only and name != args.only:
            continue
        for label, mesh in MESHES.items():
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
