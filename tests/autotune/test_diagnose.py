"""A job that cannot fit one micro-batch gets one line: what it needs and what would fit it.

The options the line offers are checked against the tools themselves: an estimate at the fsdp world
size it names fits, and so does the budget it names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from autotune.cli import main
from autotune.cli.common import EXIT_NO_FIT
from autotune.core.errors import CannotFitError
from autotune.orchestrate.estimate import EstimateConfig, estimate
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.search.diagnose import NoFit, diagnose_no_fit
from autotune.tasks.load import load_task

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Done:
    """One `autotune ...` run in this process: its exit status and what it wrote."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Callable[..., Done]:
    """`autotune *args` from the repository's root, in this process (autotune.cli.main)."""
    monkeypatch.chdir(REPO)

    def run(*args: str) -> Done:
        capsys.readouterr()
        code = main(list(args))
        captured = capsys.readouterr()
        return Done(code, captured.out, captured.err)

    return run


def _bytes_after(label: str, line: str) -> int:
    found = re.search(label + r" (\d+) bytes", line)
    assert found is not None, f"{label!r} not in {line}"
    return int(found.group(1))


def _one_error_line(done: Done) -> str:
    assert done.returncode == EXIT_NO_FIT, done.stderr
    assert "Traceback" not in done.stderr and "OutOfMemoryError" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("autotune: error:")]
    assert len(errors) == 1, done.stderr
    assert done.stderr.rstrip("\n").splitlines()[-1] == errors[0]
    return errors[0]


def test_the_100m_gpt_at_64mib_names_the_bytes(cli: Callable[..., Done]) -> None:
    """The issue's case: an allocator exception before, one line with the figures now."""
    line = _one_error_line(cli("probe", "examples/gpt.py:task_100m", "--device", "cpu", "--budget", "64MiB"))
    with torch.device("meta"):
        params = sum(p.numel() for p in load_task("examples/gpt.py:task_100m").model().parameters())
    static = _bytes_after("optimizer state alone take", line)
    needs = _bytes_after("it needs", line)
    # fp32 weights, gradients and AdamW's two moments at least, the step's temporaries at most as much again.
    assert 16 * params <= static <= 24 * params
    assert static < needs
    assert "budget 67108864 bytes (64.00 MiB)" in line
    # The activations of one sample alone are over the 57.6 MiB limit: sharding cannot help, and says why.
    assert "--strategy fsdp" not in line and "activations alone take about" in line
    budget = _bytes_after("a budget of", line)
    assert needs <= budget * 0.9 < needs + MiB


def test_probe_offers_fsdp_ac_and_a_budget_that_really_fit() -> None:
    with pytest.raises(CannotFitError) as caught:
        probe(load_task("examples/gpt.py:task"), ProbeConfig(device="cpu", budget_bytes=3 * MiB))
    no_fit = caught.value.diagnosis
    assert isinstance(no_fit, NoFit)
    # The diagnosis's line, then the cheapest change that fits (autotune/orchestrate/levers.py): one line.
    assert str(caught.value).startswith(no_fit.line() + "; the cheapest change that fits micro-batch 1: ")
    assert "\n" not in str(caught.value)
    assert no_fit.fsdp_world_size == 2 and "--strategy fsdp --world-size 2" in no_fit.line()
    assert no_fit.ac_full_peak_bytes is not None and "--ac full" in no_fit.line()
    assert no_fit.peak_bytes is not None and no_fit.static_bytes is not None
    assert no_fit.static_bytes < no_fit.limit_bytes < no_fit.peak_bytes
    # What the line offers fits when asked for (estimates: no memory spent checking).
    task = load_task("examples/gpt.py:task")
    sharded = estimate(task, EstimateConfig.of(budget_bytes=3 * MiB, device_kind="cpu", strategy="fsdp", world_size=2))
    assert sharded.max_micro_batch >= 1
    checkpointed = estimate(
        task, EstimateConfig.of(budget_bytes=3 * MiB, device_kind="cpu", activation_checkpointing="full")
    )
    assert checkpointed.max_micro_batch >= 1
    assert no_fit.budget_needed_bytes is not None
    enough = probe(task, ProbeConfig(device="cpu", budget_bytes=no_fit.budget_needed_bytes))
    assert enough.max_micro_batch >= 1


def test_estimate_says_the_same_with_its_own_exit_status(cli: Callable[..., Done]) -> None:
    line = _one_error_line(
        cli("estimate", "examples/gpt.py:task", "--budget", "3MiB", "--device-kind", "cpu", "--max-micro-batch", "64")
    )
    assert "micro-batch 1 does not fit" in line and "--strategy fsdp --world-size 2" in line


def test_an_fsdp_job_is_offered_a_larger_world_size_only() -> None:
    no_fit = diagnose_no_fit(
        load_task("examples/gpt.py:task"),
        budget_bytes=2 * MiB,
        headroom=0.1,
        micro_batch=1,
        device_type="cpu",
        strategy="fsdp",
        world_size=2,
    )
    assert no_fit.fsdp_world_size is not None and no_fit.fsdp_world_size > 2
    assert "world size 2, limit" in no_fit.line()


def test_a_measured_peak_over_the_limit_is_said_beside_an_eager_fake_one_within_it() -> None:
    # Issue 41: a compiled probe's no-fit read "does not fit: ... limit L ... it needs X" with X below L (the fake
    # trial runs the eager step, without the compiled step's buffers).
    from autotune.search.diagnose import NoFit

    limit = 22_649_241
    said = NoFit(
        micro_batch=1,
        budget_bytes=24 << 20,
        limit_bytes=limit,
        headroom=0.1,
        peak_bytes=20_880_292,
        static_bytes=None,
        measured_bytes=23_880_292,
    )
    line = said.line()
    assert "it peaked at 23880292 bytes (22.77 MiB) when measured" in line
    assert "a fake trial of the eager step needs 20880292 bytes" in line and "it needs 20880292" not in line
    assert said.budget_needed_bytes is not None and said.budget_needed_bytes * 0.9 >= 23_880_292
