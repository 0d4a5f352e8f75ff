"""``autotune estimate`` against ``autotune probe`` on ``hf:`` configs of three architectures, on the CPU.

    .venv/bin/python bench/hf_estimate.py                 # Llama, GPT-2, Qwen2 at --seq-len 16,32
    .venv/bin/python bench/hf_estimate.py --output bench/results/hf_estimate.json

Each architecture's tiny config (tests/autotune/_hf_configs.py: 1 or 2 layers, hidden 32, vocab 256, 64
positions) is written to a temporary folder as a user's config.json would be, then both commands run
as a user runs them (``autotune probe hf:DIR --seq-len 16,32 --device cpu ...`` and ``autotune estimate
hf:DIR --seq-len 16,32 --device-kind cpu ...``, same budget and target) in their own processes. A fake
trial on the CPU counts what a real one does, so the two must agree on m_max, the peak at it and the
fingerprint at every length; the table says whether they do and what each cost. Figures only.
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
sys.path.insert(0, str(REPO))

from tests.autotune._hf_configs import CONFIGS, write_config  # noqa: E402

COMMON = ["--budget", "4MiB", "--target-batch", "64", "--json"]


def run(command: list[str]) -> tuple[list[dict], float]:
    started = time.perf_counter()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "autotune"), *command], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout), time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", default="16,32")
    parser.add_argument("--archs", default=",".join(CONFIGS))
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf-estimate-") as root:
        for arch in args.archs.split(","):
            spec = f"hf:{write_config(Path(root), arch)}"
            lengths = ["--seq-len", args.seq_len]
            probed, probe_s = run(["probe", spec, "--device", "cpu", "--no-throughput", *lengths, *COMMON])
            estimated, estimate_s = run(["estimate", spec, "--device-kind", "cpu", *lengths, *COMMON])
            for p, e in zip(probed, estimated, strict=True):
                m = p["max_micro_batch"]
                peak_p = next(t["peak_bytes"] for t in p["trials"] if t["micro_batch"] == m and t["fits"])
                peak_e = next(t["peak_bytes"] for t in e["trials"] if t["micro_batch"] == e["max_micro_batch"])
                rows.append(
                    {
                        "task": p["task"],
                        "seq_len": p["seq_len"],
                        "probe_m_max": m,
                        "estimate_m_max": e["max_micro_batch"],
                        "probe_peak_bytes": peak_p,
                        "estimate_peak_bytes": peak_e,
                        "same_fingerprint": p["fingerprint"] == e["fingerprint"],
                        "equal": m == e["max_micro_batch"]
                        and peak_p == peak_e
                        and p["fingerprint"] == e["fingerprint"],
                        "probe_seconds": round(probe_s, 1),
                        "estimate_seconds": round(estimate_s, 1),
                    }
                )
    print(
        "| task | L | probe m_max | estimate m_max | peak at m_max (probe / estimate) | same fingerprint | equal "
        "| probe s | estimate s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['task']} | {r['seq_len']} | {r['probe_m_max']} | {r['estimate_m_max']} | "
            f"{r['probe_peak_bytes']} / {r['estimate_peak_bytes']} | {r['same_fingerprint']} | {r['equal']} | "
            f"{r['probe_seconds']} | {r['estimate_seconds']} |"
        )
    if args.output:
        args.output.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
