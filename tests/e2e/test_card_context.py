"""The loop back from the card: a real server that holds a measured H200 profile gives an estimate for
the H200 the memory outside the allocator that the card showed (autotune estimate --gpu h200 --server)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2 as httpx
import pytest

from autotune.cli import main
from autotune.core.schemas import Profile
from tests.e2e.conftest import LiveServer
from tests.factories import profile_payload

MiB = 1 << 20
# The H200 of 2026-11-30 read 810.00 MiB at m = 1 of the GPT example: 4 MiB of the trial, the two 32 MiB
# cuBLAS workspaces, and so 742 MiB outside the allocator.
OUTSIDE_BYTES = 742 * MiB


def test_an_estimate_uses_the_context_the_store_measured(
    cuda_python: str, live_server: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured = profile_payload(device_name="NVIDIA H200")
    measured["torch_version"] = "2.11.0+cu130"
    for trial in measured["trials"]:
        trial["outside_allocator_bytes"] = OUTSIDE_BYTES
        trial["allocated_bytes"] = trial["peak_bytes"] - OUTSIDE_BYTES - 4 * MiB
    headers = {"Authorization": f"Bearer {live_server.token}"}
    stored = httpx.post(f"{live_server.url}/api/v1/profiles", json=measured, headers=headers, timeout=30)
    assert stored.status_code in (200, 201), stored.text
    monkeypatch.setenv("AUTOTUNE_TOKEN", live_server.token)
    out = tmp_path / "estimate.json"
    code = main(
        ["estimate", "examples/gpt.py:task", "--gpu", "h200", "--budget", "2GiB", "--max-micro-batch", "4",
         "--server", live_server.url, "--output", str(out)]
    )
    assert code == 0
    profile = Profile.model_validate(json.loads(out.read_text()))
    at_one = next(t for t in profile.trials if t.micro_batch == 1)
    assert at_one.outside_allocator_bytes == OUTSIDE_BYTES
    assert at_one.peak_bytes == 810 * MiB  # the card's own figure at m = 1
    assert any("measured profiles of the card" in w for w in profile.warnings)
