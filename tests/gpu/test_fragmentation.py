"""On a real GPU: the profile records expandable_segments and the allocator's gap at m_max, with and
without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (each in a fresh process: the allocator reads
the setting once, at CUDA's first use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _probe(expandable: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune.cli",
            "probe",
            "examples/gpt.py:task",
            "--device",
            "cuda",
            "--budget",
            "2GiB",
            "--json",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("expandable", [False, True])
def test_the_profile_records_the_setting_and_the_gap(expandable: bool) -> None:
    profile = _probe(expandable)
    assert profile["expandable_segments"] is expandable
    gap = profile["reserved_gap_bytes"]
    at_max = next(
        t
        for t in profile["trials"]
        if t["micro_batch"] == profile["max_micro_batch"] and t["fits"] and not t.get("fake")
    )
    reserved = at_max["peak_bytes"] - (at_max["outside_allocator_bytes"] or 0)
    assert gap == max(0, reserved - at_max["allocated_bytes"])
    assert 0 <= gap < profile["budget_bytes"]
