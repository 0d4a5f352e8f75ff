"""The pairwise table of issue 41: every single dimension and every pair of {fsdp, tp, pp, cp, compile, ac op,
ac every-2, offload activations, adamw8bit, LoRA, nf4, bf16} on a tiny hf: Llama config at --seq-len, by
`autotune probe` and `autotune estimate` (each in a process of its own, as a user runs them). Each cell prints
m_max by both and whether they agree, or the one line that refuses the composition (autotune/core/compositions.py),
or the first line of a failure. Written to bench/results/compositions.json.

    .venv/bin/python bench/compositions.py [--only fsdp,tp] [--containing compile] [--workers 2] [--timeout 600]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
SEQ_LEN = 32
BUDGET = "8MiB"
# Each dimension's flags, and its mesh degrees (tp, pp, cp) and whether it shards (fsdp) for the world size.
DIMENSIONS: dict[str, tuple[list[str], tuple[int, int, int], bool]] = {
    "fsdp": (["--strategy", "fsdp"], (1, 1, 1), True),
    "tp": (["--tp", "2"], (2, 1, 1), False),
    "pp": (["--pp", "2"], (1, 2, 1), False),
    "cp": (["--cp", "2"], (1, 1, 2), False),
    "compile": (["--compile"], (1, 1, 1), False),
    "ac op": (["--ac", "op"], (1, 1, 1), False),
    "ac every-2": (["--ac", "every-2"], (1, 1, 1), False),
    "offload": (["--offload", "activations"], (1, 1, 1), False),
    "adamw8bit": (["--optimizer", "adamw8bit"], (1, 1, 1), False),
    "lora": (["--lora-rank", "4"], (1, 1, 1), False),
    "nf4": (["--quantize", "nf4"], (1, 1, 1), False),
    "bf16": (["--precision", "bf16"], (1, 1, 1), False),
}


def _argv(cell: tuple[str, ...]) -> list[str]:
    flags: list[str] = []
    tp = pp = cp = 1
    shards = False
    for name in cell:
        more, (t, p, c), sharded = DIMENSIONS[name]
        flags += more
        tp, pp, cp, shards = tp * t, pp * p, cp * c, shards or sharded
    if "nf4" in cell and "lora" not in cell:
        flags += ["--lora-rank", "4"]  # QLoRA: a 4-bit base trains only its adapters
    world = tp * pp * cp
    if shards and world // (tp * pp * cp) * cp < 2:
        world *= 2  # FSDP2 needs 2 shards
    return [*flags, "--world-size", str(world)] if world > 1 else flags


def _run(command: str, spec: str, cell: tuple[str, ...], timeout: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as where:
        out = Path(where) / "profile.json"
        on = ["--device", "cpu"] if command == "probe" else ["--device-kind", "cpu"]
        argv = [command, spec, *on, "--budget", BUDGET, "--seq-len", str(SEQ_LEN), *_argv(cell), "--output", str(out)]
        started = time.perf_counter()
        try:
            done = subprocess.run(
                [str(Path(sys.executable).with_name("autotune")), *argv],
                capture_output=True,
                text=True,
                timeout=timeout,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                cwd=ROOT,
            )
        except subprocess.TimeoutExpired:
            return {"argv": argv, "said": f"timed out after {timeout:.0f} s", "seconds": timeout}
        seconds = round(time.perf_counter() - started, 1)
        result: dict[str, object] = {"argv": argv, "rc": done.returncode, "seconds": seconds}
        if out.exists():
            profile = json.loads(out.read_text())
            profile = profile[0] if isinstance(profile, list) else profile
            result["m_max"] = profile["max_micro_batch"]
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        if done.returncode != 0:
            result["said"] = lines[-1][:300] if lines else f"exit {done.returncode}"
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated dimensions (default: all)")
    parser.add_argument("--containing", help="of those cells, only the ones with this dimension (e.g. compile)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(DIMENSIONS)
    cells = [(name,) for name in names] + list(itertools.combinations(names, 2))
    if args.containing:
        cells = [cell for cell in cells if args.containing in cell]
    with tempfile.TemporaryDirectory() as where:
        config = Path(where) / "llama"
        config.mkdir()
        (config / "config.json").write_text(json.dumps(LLAMA))
        spec = f"hf:{config}"
        jobs = [(command, cell) for cell in cells for command in ("probe", "estimate")]
        with ThreadPoolExecutor(args.workers) as pool:
            results = list(pool.map(lambda job: _run(job[0], spec, job[1], args.timeout), jobs))
    table: dict[str, dict[str, object]] = {}
    for (command, cell), result in zip(jobs, results, strict=True):
        table.setdefault(" x ".join(cell), {})[command] = result
    print("| cell | probe m_max | estimate m_max | agree | s (probe / estimate) | refused or failed |")
    print("|---|---|---|---|---|---|")
    for cell, both in table.items():
        probe, estimate = both["probe"], both["estimate"]
        agree = "yes" if probe.get("m_max") is not None and probe.get("m_max") == estimate.get("m_max") else ""
        said = probe.get("said") or estimate.get("said") or ""
        print(
            f"| {cell} | {probe.get('m_max', '')} | {estimate.get('m_max', '')} | {agree} | "
            f"{probe['seconds']} / {estimate['seconds']} | {said} |"
        )
    results_dir = ROOT / "bench" / "results"
    results_dir.mkdir(exist_ok=True)
    stored = results_dir / "compositions.json"
    if (args.only or args.containing) and stored.exists():  # a subset run updates its cells in the whole table
        table = {**json.loads(stored.read_text()), **table}
    stored.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
