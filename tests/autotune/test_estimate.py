"""`autotune estimate`: fake trials only, labelled as an estimate, equal to the probe on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autotune.core.errors import AutotuneError, BudgetError
from autotune.core.schemas import Profile
from autotune.orchestrate.estimate import EstimateConfig, estimate
from autotune.orchestrate.probe import ProbeConfig, probe
from examples import gpt
from tests import warm_cli
from tests.autotune._tasks import linear_task

MiB = 1 << 20


def test_an_estimate_on_cpu_semantics_equals_the_probe_and_is_labelled() -> None:
    config = EstimateConfig.of(budget_bytes=24 * MiB, device_kind="cpu", target_batch=256)
    estimated = estimate(gpt.task, config)
    measured = probe(gpt.task, ProbeConfig(device="cpu", budget_bytes=24 * MiB, target_batch=256))
    assert estimated.source == "estimate" and measured.source == "measured"
    assert estimated.max_micro_batch == measured.max_micro_batch
    assert estimated.trials and all(t.fake for t in estimated.trials)
    assert estimated.deciding_trials == estimated.trials
    assert estimated.plan is not None and estimated.plan.effective_batch == 256
    assert estimated.fingerprint == measured.fingerprint
    at_m = estimated.peak_at(estimated.max_micro_batch)
    assert at_m == measured.peak_at(measured.max_micro_batch)


def test_an_fsdp_estimate_matches_the_fsdp_probe() -> None:
    config = EstimateConfig.of(budget_bytes=24 * MiB, device_kind="cpu", strategy="fsdp", world_size=4)
    estimated = estimate(gpt.task, config)
    measured = probe(gpt.task, ProbeConfig(device="cpu", budget_bytes=24 * MiB, strategy="fsdp", world_size=4))
    assert (estimated.strategy, estimated.world_size) == ("fsdp", 4)
    assert estimated.max_micro_batch == measured.max_micro_batch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-semantics warning of a CPU-only torch")
def test_a_cuda_estimate_without_cuda_says_it_used_cpu_semantics() -> None:
    config = EstimateConfig.of(budget_bytes=24 * MiB, device_kind="cuda", device_name="NVIDIA H100 80GB HBM3")
    estimated = estimate(gpt.task, config)
    assert estimated.device.kind == "cuda" and estimated.device.name == "NVIDIA H100 80GB HBM3"
    assert any("CPU semantics" in w for w in estimated.warnings)


def test_a_model_that_cannot_be_built_on_meta_is_built_fake_with_a_warning() -> None:
    class NeedsData(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(64, 8)
            if self.body.weight.device.type == "meta":
                raise RuntimeError("this model reads its weights while it is built")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    estimated = estimate(linear_task(model=NeedsData), EstimateConfig.of(budget_bytes=MiB, device_kind="cpu"))
    assert estimated.max_micro_batch > 1
    assert any("could not be built on the meta device (in NeedsData)" in w for w in estimated.warnings)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (EstimateConfig.of(budget_bytes=None), "needs a budget"),
        (EstimateConfig.of(budget_bytes=0), "must be positive"),
        (EstimateConfig.of(budget_bytes=MiB, strategy="fsdp", world_size=1), "at least 2"),
        (EstimateConfig.of(budget_bytes=MiB, device_kind="tpu"), "device kind"),
    ],
)
def test_bad_estimate_configs_are_refused(config: EstimateConfig, message: str) -> None:
    with pytest.raises((AutotuneError, BudgetError), match=message):
        estimate(gpt.task, config)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return warm_cli.run(
        [sys.executable, "-m", "autotune.cli", "estimate", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "needs a budget"),
        (["--budget", "0"], "is less than one byte"),
        (["--budget", "8MiB", "--strategy", "fsdp"], "at least 2"),
    ],
)
def test_the_cli_refuses_bad_input_in_one_line(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main() in this process: a process each took 5 s for its torch import (test_cli holds the exit status of a
    real process)."""
    from autotune.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    try:
        code = main(["estimate", "examples/gpt.py:task", *args])
    except SystemExit as exc:  # argparse refuses a value by its type
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_cli_prints_an_estimate_profile() -> None:
    done = _cli("examples/gpt.py:task", "--device-kind", "cpu", "--budget", "12MiB", "--json")
    assert done.returncode == 0, done.stderr
    profile = Profile.model_validate(json.loads(done.stdout))
    assert profile.source == "estimate" and all(t.fake for t in profile.trials)
    assert "source           estimate" in done.stderr
