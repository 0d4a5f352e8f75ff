"""`autotune probe` as users run it: JSON on stdout, human text on stderr, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import warm_cli
from tests.autotune._tasks import assert_profile_contract

REPO = Path(__file__).resolve().parents[2]

BAD_TASKS = """
import torch
from autotune.tasks.task import ProbeTask

no_tensors = ProbeTask(name="no-tensors", model=lambda: torch.nn.Linear(4, 2), batch=lambda m: {"x": [1, 2]})
vector_loss = ProbeTask(
    name="vector-loss", model=lambda: torch.nn.Linear(4, 2), batch=lambda m: torch.zeros(m, 4),
    loss=lambda model, batch: model(batch).sum(dim=1),
)
"""


def autotune(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return warm_cli.run(
        [sys.executable, "-m", "autotune.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_probe_json_contract(tmp_path: Path) -> None:
    out_file = tmp_path / "nested" / "profile.json"
    done = autotune(
        "probe",
        "examples/mlp.py:task",
        "--device",
        "cpu",
        "--budget",
        "2MiB",
        "--target-batch",
        "100",
        "--json",
        "--output",
        str(out_file),
    )
    assert done.returncode == 0, done.stderr
    profile = json.loads(done.stdout)  # stdout is the profile and nothing else
    assert json.loads(out_file.read_text()) == profile
    assert_profile_contract(profile)
    plan = profile["plan"]
    assert plan["micro_batch"] * plan["accumulation_steps"] * plan["world_size"] == plan["effective_batch"] == 100
    assert "trial m=1" in done.stderr and "autotune datasheet: mlp" in done.stderr


def test_probe_human_output() -> None:
    done = autotune("probe", "examples/cnn.py:task", "--device", "cpu", "--budget", "4MiB")
    assert done.returncode == 0, done.stderr
    assert "max micro-batch" in done.stdout and "BatchNorm" in done.stdout
    assert "trial m=" in done.stderr


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """main(args) in this process, from the repository (a process of its own costs a torch import; the tests
    above hold what a real process prints where): the exit status, stdout, stderr."""
    from autotune.cli import main

    try:
        code = main(args)
    except SystemExit as exc:  # argparse refuses a value by its type or choices
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_probe_plan_balanced_by_default_and_divisor_on_request(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    common = ["probe", "examples/gpt.py:task", "--device", "cpu", "--budget", "24MiB", "--target-batch", "256"]
    code, out, err = _main([*common, "--json"], capsys)
    assert code == 0, err
    profile = json.loads(out)
    assert profile["max_micro_batch"] == 26
    assert (profile["plan"]["accumulation_steps"], profile["plan"]["micro_batches"]) == (10, [[26, 6], [25, 4]])
    assert "plan             6×26 + 4×25 = 256 (10 steps) (target 256, exact)" in err
    code, out, err = _main([*common, "--plan", "divisor", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert (plan["micro_batch"], plan["accumulation_steps"], plan["micro_batches"]) == (16, 16, [[16, 16]])


def test_a_budget_too_small_for_one_sample_is_one_line_and_its_own_exit_status() -> None:
    done = autotune("probe", "examples/gpt.py:task", "--device", "cpu", "--budget", "1MiB")
    assert done.returncode == 4  # EXIT_NO_FIT: not a usage error
    error_lines = [line for line in done.stderr.splitlines() if line.startswith("autotune: error:")]
    assert len(error_lines) == 1 and "alone take" in error_lines[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["probe", "examples/mlp.py:task", "--device", "cpu", "--budget", "8MiB", "--plan", "round"], "--plan"),
        (["probe", "nowhere.py:task", "--device", "cpu", "--budget", "1MiB"], "task file 'nowhere.py' not found"),
        (["probe", "BAD:no_tensors", "--device", "cpu", "--budget", "8MiB"], "no tensors"),
        (["probe", "BAD:vector_loss", "--device", "cpu", "--budget", "8MiB"], "must return a scalar"),
        (
            [
                "probe",
                "examples/mlp.py:task",
                "--device",
                "cpu",
                "--budget",
                "8MiB",
                "--target-batch",
                "2",
                "--world-size",
                "4",
            ],
            "smaller than world-size",
        ),
        (["probe", "examples/mlp.py:task", "--device", "cuda:7", "--budget", "8MiB"], "CUDA"),
        (["probe", "examples/mlp.py:task", "--device", "tpu", "--budget", "8MiB"], "unknown device"),
        (["probe", "examples/mlp.py:task", "--device", "cpu", "--budget", "lots"], "cannot read 'lots' as a size"),
        (["probe", "examples/mlp.py:task", "--device", "cpu"], "needs a budget"),
        (["probe", "examples/mlp.py:task", "--device", "cpu", "--budget", "8MiB", "--headroom", "2"], "headroom"),
    ],
)
def test_bad_input_gives_one_line(
    tmp_path: Path, args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main() in this process (a process each took 5 s of the suite's time for its torch import); the exit
    status of a real process is test_bad_input_exits_2_from_a_process's."""
    from autotune.cli import main

    monkeypatch.chdir(REPO)
    bad = tmp_path / "bad.py"
    bad.write_text(BAD_TASKS)
    args = [a.replace("BAD", str(bad)) for a in args]
    try:
        code = main(args)
    except SystemExit as exc:  # argparse refuses a value by its type or choices
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in err
    error_lines = [line for line in err.splitlines() if line.startswith("autotune: error:")]
    assert len(error_lines) == 1 and message in error_lines[0], err
    assert out == ""


def test_bad_input_exits_2_from_a_process(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(BAD_TASKS)
    for args, message in [
        (["--plan", "round"], "--plan"),  # argparse's own refusal
        (["--budget", "8MiB", "--headroom", "2"], "headroom"),  # the CLI's
    ]:
        done = autotune("probe", "examples/mlp.py:task", "--device", "cpu", *args)
        assert done.returncode == 2
        error_lines = [line for line in done.stderr.splitlines() if line.startswith("autotune: error:")]
        assert len(error_lines) == 1 and message in error_lines[0], done.stderr
        assert "Traceback" not in done.stderr and done.stdout == ""


def test_verify_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    code, _, err = _main(["verify", "examples/gpt.py:task", "--target-batch", "8", "--micro-batch", "2"], capsys)
    assert code == 0, err
    code, _, err = _main(["verify", "examples/cnn.py:task", "--target-batch", "8", "--micro-batch", "2"], capsys)
    assert code == 1 and "BatchNorm" in err and "Traceback" not in err
