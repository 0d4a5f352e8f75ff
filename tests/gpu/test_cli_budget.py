"""`autotune probe --device cuda` refuses a budget above the card's own memory before any trial (issue 31)."""

from __future__ import annotations

import pytest
import torch

from autotune.cli import main
from autotune.core.errors import ExitCode


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "auto"])
def test_a_budget_above_the_card_is_refused_before_any_trial(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    code = main(["probe", "examples/mlp.py:task", "--device", device, "--budget", str(total + 1)])
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE, err
    assert err.strip().splitlines() == [line for line in err.strip().splitlines() if line.startswith("autotune: error")]
    assert f"({total} bytes as CUDA reports it)" in err and "trial m=" not in err
