"""torchtitan's DeepSeek-V3 16B recipe on an emulated 8 x H100 80 GB (issue 63): FSDP over 8 ranks, expert
parallel 8, seq 4096, op-level SAC, bf16. torchtitan ran out of memory at local batch 8 and cut it to 4, "safe for
80GB H100" (pytorch/torchtitan issue 1789, commit 82a9530). Prints each routing's m_max, the peaks at 4 and 8 and
the wall time of the estimate.

    AUTOTUNE_CUDA_PYTHON=.venv-cuda/bin/python .venv/bin/python bench/experts.py [--load-factor F ...]

The config is examples/configs/deepseek-v3-16b.json (torchtitan's deepseek_v3_16b written as transformers'
DeepseekV3Config: 27 blocks, the first dense, 64 routed experts top-6 plus 2 shared, MLA with kv_lora_rank 512).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = [
    "estimate",
    "hf:examples/configs/deepseek-v3-16b.json",
    "--gpu",
    "h100",
    "--precision",
    "bf16",
    "--strategy",
    "fsdp",
    "--world-size",
    "8",
    "--ep",
    "8",
    "--seq-len",
    "4096",
    "--ac",
    "op",
    "--micro-batches",
    "4,8",
    "--max-micro-batch",
    "8",
]
GiB = 1 << 30


def run(load_factor: float | None) -> None:
    """One estimate: its m_max, the peaks at 4 and 8, its wall time."""
    with tempfile.TemporaryDirectory() as where:
        out = Path(where) / "profile.json"
        extra = [] if load_factor is None else ["--moe-load-factor", f"{load_factor:g}"]
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "autotune.cli", *COMMAND, *extra, "--output", str(out)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - started
        routing = "worst case (default)" if load_factor is None else f"load factor {load_factor:g}"
        if done.returncode != 0:
            print(f"{routing}: exit {done.returncode} after {seconds:.0f} s: {done.stderr.strip().splitlines()[-1]}")
            return
        profile = json.loads(out.read_text())
        profile = profile[0] if isinstance(profile, list) else profile
        peaks = {t["micro_batch"]: t["peak_bytes"] / GiB for t in profile["trials"]}
        shown = ", ".join(f"m={m}: {peaks[m]:.2f} GiB" for m in (4, 8) if m in peaks)
        print(
            f"{routing} (recorded {profile.get('moe_load_factor')}): m_max {profile['max_micro_batch']} "
            f"of budget {profile['budget_bytes'] / GiB:.2f} GiB; {shown}; {seconds:.0f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load-factor", type=float, action="append", help="routings to estimate (default: both)")
    args = parser.parse_args()
    for factor in args.load_factor or [None, 1.0]:
        run(factor)


if __name__ == "__main__":
    main()
