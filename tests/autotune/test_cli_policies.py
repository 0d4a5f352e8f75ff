"""`--ac` and `--objective` as users run them: one profile per policy, a JSON array, the
``recommended:`` line, and one-line refusals that store nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import warm_cli
from tests.autotune.test_cli import REPO


def autotune(*args: str) -> subprocess.CompletedProcess[str]:
    # One intra-op thread: two spin against each other on a shared 2-core machine (20x slower trials).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return warm_cli.run(
        [sys.executable, "-m", "autotune.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300, env=env
    )


TINY_GPT = """
from examples.gpt import GPTConfig, make_task

task = make_task(GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=4), name="gpt-tiny")
"""


def test_two_policies_print_a_json_array_and_the_recommendation(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(TINY_GPT)
    out = tmp_path / "profiles.json"
    done = autotune(
        "probe", f"{tmp_path}/tiny.py:task", "--device", "cpu", "--budget", "3MiB", "--target-batch", "64",
        "--ac", "none,full", "--objective", "throughput", "--json", "--output", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    profiles = json.loads(done.stdout)
    assert [p["activation_checkpointing"] for p in profiles] == ["none", "full"]
    assert json.loads(out.read_text()) == profiles
    assert profiles[0]["fingerprint"] == profiles[1]["fingerprint"]  # one setup, two policies
    assert profiles[0]["max_micro_batch"] < profiles[1]["max_micro_batch"]
    for profile in profiles:
        timings = profile["throughput"]
        assert timings[0]["micro_batches"] == [[profile["max_micro_batch"], 1]]
        assert all(t["samples_per_second"] > 0 for t in timings)
        if profile["plan"]["micro_batches"] != [[profile["max_micro_batch"], 1]]:
            assert timings[1]["micro_batches"] == profile["plan"]["micro_batches"]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("recommended:")]
    assert "objective throughput" in line and "none:" in line and "full:" in line


def test_an_unknown_policy_is_one_line() -> None:
    done = autotune("probe", "examples/mlp.py:task", "--device", "cpu", "--budget", "2MiB", "--ac", "none,half")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "autotune: error: argument --ac: unknown policy 'half': choose from none, every-K (K from 2 to 9999), "
        "full, op, or op:OP/OP/... (op names, e.g. op:mm/addmm); a comma list probes several: none,every-2,op"
    ]


def test_full_without_blocks_names_shard_classes_and_stores_nothing(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    done = autotune(
        "probe", "examples/mlp.py:task", "--device", "cpu", "--budget", "2MiB", "--ac", "none,full",
        "--output", str(out),
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("autotune: error: --ac full found no block") and "shard_classes" in lines[-1]
    assert not any(line.startswith("trial") for line in lines)  # refused before the first probe
    assert not out.exists()


def test_throughput_with_one_policy_still_times_it(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(TINY_GPT)
    done = autotune(
        "probe", f"{tmp_path}/tiny.py:task", "--device", "cpu", "--budget", "3MiB", "--objective", "throughput",
        "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    profile = json.loads(done.stdout)  # one policy: one profile, not an array
    assert profile["activation_checkpointing"] == "none"
    assert profile["throughput"][0]["micro_batch"] == profile["max_micro_batch"]
    assert any(line.startswith("recommended: --ac none: m_max") for line in done.stderr.splitlines())


def test_estimate_takes_ac_and_compares_policies_by_memory(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(TINY_GPT)
    done = autotune(
        "estimate", f"{tmp_path}/tiny.py:task", "--device-kind", "cpu", "--budget", "3MiB", "--ac", "none,every-2",
        "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    profiles = json.loads(done.stdout)
    assert [p["activation_checkpointing"] for p in profiles] == ["none", "every-2"]
    assert all(p["throughput"] is None for p in profiles)  # fake trials are never timed
    assert any(line.startswith("recommended: --ac every-2") for line in done.stderr.splitlines())


def test_fleet_makes_one_pair_per_policy_and_refuses_a_policy_before_any_cluster_time(tmp_path: Path) -> None:
    from autotune.cli.policies import with_policies
    from autotune.fleet import make_pairs
    from autotune.orchestrate.probe import ProbeConfig

    pairs = make_pairs(
        ["examples/gpt.py:task"],
        accelerators=None,
        device="cpu",
        budgets=[8 << 20, 16 << 20],
        config_for=lambda device, budget: ProbeConfig(device=device, budget_bytes=budget),
        working_dir=Path(__file__).resolve().parents[2],
    )
    expanded = with_policies(pairs, ["none", "full"])
    assert [p.index for p in expanded] == [0, 1, 2, 3]
    assert [p.config.activation_checkpointing for p in expanded] == ["none", "full", "none", "full"]
    assert expanded[1].label.endswith("budget 8.00 MiB, ac full")
    assert with_policies(pairs, [None]) == pairs
    done = autotune(
        "fleet", "examples/mlp.py:task", "--device", "cpu", "--budget", "2MiB", "--ac", "full",
        "--output", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 2 and "shard_classes" in done.stderr.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []
