"""CPU semantics against emulated cards: m_max, the figure at m_max and seconds, for the examples.

    .venv/bin/python bench/emulated.py [--budget 2GiB] [--cards h100,h200] [--tasks examples/gpt.py:task,...]

CPU semantics: `autotune estimate --device-kind cuda` on this torch (a CPU build: live tensor bytes, no
allocator, no context). Emulated: `autotune estimate --gpu CARD` (CUDA semantics in a child process, the
caching allocator's reserved bytes + the memory outside it). Each run is a CLI process of its own.
Where the real H200 figure is known (../shared/gpu-runs: the GPT example at 2 GiB held m = 1212), it is
printed beside.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KNOWN_H200_M_MAX = {("examples/gpt.py:task", "2GiB"): 1212}


def _estimate(task: str, budget: str, extra: list[str]) -> tuple[int, int, float]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "p.json"
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "autotune.cli", "estimate", task, "--budget", budget, "--output", str(out), *extra],
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{task} {extra}: {done.stderr.strip().splitlines()[-1]}")
        profile = json.loads(out.read_text())
    m_max = profile["max_micro_batch"]
    at = [t["peak_bytes"] for t in profile["trials"] if t["micro_batch"] == m_max]
    return m_max, at[0] if at else -1, seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", default="2GiB")
    parser.add_argument("--cards", default="h100,h200")
    parser.add_argument("--tasks", default="examples/gpt.py:task,examples/mlp.py:task,examples/cnn.py:task")
    args = parser.parse_args()
    print("| task | semantics | m_max | figure at m_max (MiB) | seconds | real H200 m_max |")
    print("|---|---|---|---|---|---|")
    for task in args.tasks.split(","):
        real = KNOWN_H200_M_MAX.get((task, args.budget), "")
        m, figure, seconds = _estimate(task, args.budget, ["--device-kind", "cuda"])
        print(f"| {task} | CPU | {m} | {figure / 2**20:.1f} | {seconds:.1f} | {real} |", flush=True)
        for card in args.cards.split(","):
            m, figure, seconds = _estimate(task, args.budget, ["--gpu", card])
            print(f"| {task} | emulated {card} | {m} | {figure / 2**20:.1f} | {seconds:.1f} | {real} |", flush=True)


if __name__ == "__main__":
    main()
