"""`autotune estimate --gpu NAME --tp N` with the optimizer's default step: on a card AdamW defaults to foreach, and
DTensor refuses a foreach op over the tp model's mixed parameter lists (DTensors, and the norms outside the plan
as plain tensors), as the real job's first step would. The estimate says so in one line with what to change
(exit 2, nothing written), and with foreach=false it answers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.measure.trial import MIXED_DTENSOR_STEP
from tests.autotune._hf_configs import write_config

pytest.importorskip("transformers")


def test_a_foreach_step_over_a_tp_model_on_a_card_is_one_line_and_exit_2(
    cuda_python: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_config(tmp_path, "llama", tie_word_embeddings=False)
    flags = ["--gpu", "h100", "--world-size", "2", "--tp", "2", "--seq-len", "64", "--max-micro-batch", "2"]
    refused = tmp_path / "refused.json"
    code = main(["estimate", f"hf:{folder}", *flags, "--output", str(refused)])
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("autotune: error:")]
    assert code == 2 and len(errors) == 1 and MIXED_DTENSOR_STEP in errors[0], stderr[-2000:]
    assert not refused.exists()

    answered = tmp_path / "answered.json"
    code = main(["estimate", f"hf:{folder}?optimizer=AdamW:foreach=false", *flags, "--output", str(answered)])
    assert code == 0
    (profile,) = json.loads(answered.read_text())
    assert profile["mesh"] == {"tp": 2} and profile["max_micro_batch"] == 2
