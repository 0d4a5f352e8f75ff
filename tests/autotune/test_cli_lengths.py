"""`autotune probe --seq-len` as users run it: a JSON array of profiles, one table, one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.autotune._tasks import assert_profile_contract
from tests.autotune.test_cli import autotune

SEQ_TASKS = """
from examples.gpt import GPTConfig, make_seq_task

task = make_seq_task(GPTConfig(seq_len=4096, d_model=32, n_heads=2, n_layers=2), name="tiny-seq")
"""


@pytest.fixture
def seq_task(tmp_path: Path) -> str:
    path = tmp_path / "seq_tasks.py"
    path.write_text(SEQ_TASKS)
    return f"{path}:task"


def test_probe_over_lengths_prints_a_json_array_and_one_table(seq_task: str, tmp_path: Path) -> None:
    out_file = tmp_path / "profiles.json"
    done = autotune(
        "probe", seq_task, "--device", "cpu", "--budget", "8MiB", "--seq-len", "64,128", "--target-tokens", "4096",
        "--no-throughput", "--json", "--output", str(out_file),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    profiles = json.loads(done.stdout)
    assert json.loads(out_file.read_text()) == profiles
    assert [p["seq_len"] for p in profiles] == [64, 128]
    assert len({p["fingerprint"] for p in profiles}) == 1
    for profile in profiles:
        assert_profile_contract(profile)
        plan = profile["plan"]
        assert plan["effective_batch"] * profile["seq_len"] == 4096  # 64 x 64 and 32 x 128 tokens
        assert profile["surface"]["measured_lengths"] == [64, 128]
    longest = profiles[0]["surface"]["longest"]
    assert longest["micro_batch"] == 1 and longest["seq_len"] > 128
    table = done.stderr
    assert "autotune datasheet: tiny-seq over sequence lengths" in table
    assert "tokens/micro-batch" in table and f"longest L at m=1: {longest['seq_len']}" in table


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["examples/mlp.py:task", "--seq-len", "128"], "--seq-len 128: task 'mlp' is not sequence-aware"),
        (["SEQ", "--seq-len", "64,0"], "sequence length '0' must be a positive integer"),
        (["SEQ", "--seq-len", "64,abc"], "sequence length 'abc' is not an integer"),
        (["SEQ"], "is sequence-aware (its batch takes seq_len=): give the lengths with --seq-len"),
        (["SEQ", "--seq-len", "64,9000"], "--seq-len 9000: the model cannot take this length"),
        (["SEQ", "--seq-len", "64", "--target-batch", "8", "--target-tokens", "512"], "not both"),
        (["SEQ", "--target-tokens", "512"], "--target-tokens needs --seq-len"),
    ],
)
def test_bad_lengths_give_one_line_and_nothing_else(seq_task: str, args: list[str], message: str) -> None:
    done = autotune("probe", *[seq_task if a == "SEQ" else a for a in args], "--device", "cpu", "--budget", "8MiB")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stdout == ""
    error_lines = [line for line in done.stderr.splitlines() if line.startswith("autotune: error:")]
    assert len(error_lines) == 1 and message in error_lines[0], done.stderr


def test_estimate_workers_must_be_a_count() -> None:
    done = autotune("estimate", "examples/gpt.py:task_seq", "--seq-len", "64", "--budget", "8MiB", "--workers", "-1")
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stdout == ""
    assert "--workers" in done.stderr.strip().splitlines()[-1], done.stderr
