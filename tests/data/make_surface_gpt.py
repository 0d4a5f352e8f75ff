"""Writes surface_gpt.json beside this file: the profiles of one real surface probe of the GPT
example (``examples/gpt.py:task_seq``) on the CPU at three lengths, as ``autotune probe --seq-len
128,256,512 --json`` prints them. The dashboard's tests read it instead of probing (10-30 s).

    .venv/bin/python tests/data/make_surface_gpt.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUTPUT = Path(__file__).with_name("surface_gpt.json")
LENGTHS = [128, 256, 512]
BUDGET_BYTES = 64 << 20
TARGET_TOKENS = 32768


def main() -> int:
    sys.path.insert(0, str(REPO))
    from autotune.orchestrate.lengths import probe_lengths
    from autotune.orchestrate.probe import ProbeConfig
    from autotune.tasks.load import load_task

    task = load_task(str(REPO / "examples" / "gpt.py") + ":task_seq")
    config = ProbeConfig(device="cpu", budget_bytes=BUDGET_BYTES, throughput=False)
    run = probe_lengths(task, config, LENGTHS, target_tokens=TARGET_TOKENS)
    profiles = [profile.model_dump(mode="json") for profile in run.profiles]
    OUTPUT.write_text(json.dumps(profiles, indent=2) + "\n")
    for profile in run.profiles:
        print(f"L = {profile.seq_len}: m_max {profile.max_micro_batch}", file=sys.stderr)
    print(f"wrote {len(profiles)} profiles to {OUTPUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
