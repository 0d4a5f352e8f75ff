"""The caching allocator's gap at m_max, with and without expandable segments, on a CUDA device.

    .venv/bin/python bench/fragmentation.py                                  # the 100M GPT at 12 GiB
    .venv/bin/python bench/fragmentation.py --task examples/gpt.py:task --budget 2GiB

Probes the task twice, each in a fresh process (the allocator reads PYTORCH_CUDA_ALLOC_CONF once, at
CUDA's first use): as the environment has it without ``expandable_segments``, and with
``expandable_segments:True``. Prints per run m_max, the peak at m_max (reserved plus memory outside
the allocator), what the tensors allocated, the gap (reserved minus allocated, the profile's
``reserved_gap_bytes``) and the datasheet's fragmentation line. Figures only; needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.3f} GiB"


def probe(task: str, budget: str, expandable: bool, timeout: float) -> dict | None:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    args = [sys.executable, "-m", "autotune.cli", "probe", task, "--device", "cuda", "--budget", budget, "--json"]
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        print(f"probe failed ({'with' if expandable else 'without'} expandable segments): {done.stderr[-800:]}")
        return None
    return dict(json.loads(done.stdout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="examples/gpt.py:task_100m")
    parser.add_argument("--budget", default="12GiB")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per probe")
    args = parser.parse_args(argv)

    from autotune.core.schemas import Profile
    from autotune.measure.fragmentation import gap_advice

    print(f"{args.task} at {args.budget} on cuda")
    print(
        "| expandable_segments | m_max | peak at m_max | allocated at m_max | gap (reserved - allocated) | gap share |"
    )
    print("|---|---|---|---|---|---|")
    status = 0
    advice = []
    for expandable in (False, True):
        profile = probe(args.task, args.budget, expandable, args.timeout)
        if profile is None:
            status = 1
            continue
        at_max = next(
            (
                t
                for t in profile["trials"]
                if t["micro_batch"] == profile["max_micro_batch"] and t["fits"] and not t.get("fake")
            ),
            None,
        )
        peak = at_max["peak_bytes"] if at_max else None
        gap = profile.get("reserved_gap_bytes")
        share = f"{100 * gap / peak:.1f}%" if gap is not None and peak else "-"
        print(
            f"| {profile.get('expandable_segments')} | {profile['max_micro_batch']} | {_gib(peak)} "
            f"| {_gib(at_max.get('allocated_bytes') if at_max else None)} | {_gib(gap)} | {share} |"
        )
        advice.append((expandable, gap_advice(Profile.model_validate(profile))))
    for expandable, line in advice:
        print(f"datasheet ({'with' if expandable else 'without'}): {line or 'no fragmentation line (gap small)'}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
