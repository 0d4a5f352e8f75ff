"""`autotune estimate` on the 7B configuration of the GPT example: 80 GiB, fsdp over 8 ranks, bf16.

    .venv/bin/python bench/estimate_7b.py
    .venv/bin/python bench/estimate_7b.py --budget 40GiB --world-size 4

Runs the CLI in a child process (as a user would) and prints its answer (m, the per-rank peak at m),
the child's wall seconds and its peak resident memory, beside the targets: under 60 s and under
2 GiB of RSS on this CPU-only machine. Figures only.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 60
TARGET_RSS_BYTES = 2 << 30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="80GiB")
    parser.add_argument("--world-size", default="8")
    parser.add_argument("--task", default="examples/gpt.py:task_7b")
    args = parser.parse_args(argv)
    command = [
        sys.executable, "-m", "autotune.cli", "estimate", args.task, "--budget", args.budget,
        "--strategy", "fsdp", "--world-size", args.world_size, "--json",
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    if done.returncode != 0:
        print(done.stderr)
        return done.returncode
    print(done.stderr.strip())
    profile = json.loads(done.stdout)
    m = profile["max_micro_batch"]
    peak = next(t["peak_bytes"] for t in profile["trials"] if t["micro_batch"] == m and t["fits"])
    print()
    print("| task | budget | N | m | per-rank peak at m | fake trials | wall s | peak RSS | targets |")
    print("|---|---|---|---|---|---|---|---|---|")
    ok = seconds < TARGET_SECONDS and rss < TARGET_RSS_BYTES
    print(
        f"| {profile['task']} | {args.budget} | {args.world_size} | {m} | {peak / 2**30:.2f} GiB "
        f"| {len(profile['trials'])} | {seconds:.1f} | {rss / 2**20:.0f} MiB "
        f"| {'met' if ok else 'NOT met'} (< {TARGET_SECONDS} s, < {TARGET_RSS_BYTES >> 30} GiB) |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
