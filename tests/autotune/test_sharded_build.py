"""A sharded job (fsdp, tp) never holds its whole model on one device: a fake trial's model, built whole and then
sharded, may pass the budget while it is built (Mixtral 8x7B's 93 GB of bf16 weights on an 80 GB card under fsdp 8
read "micro-batch 1 does not fit"), and the trials start from the shards (autotune/measure/trial.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.measure.meters.fake import FakeMeter
from autotune.measure.strategies import Sharded
from autotune.measure.trial import TrialRunner
from autotune.tasks.hf import hf_task
from tests.autotune._hf_configs import write_config

pytest.importorskip("transformers")


def test_a_fake_sharded_model_larger_than_the_budget_is_measured_from_its_shards(tmp_path: Path) -> None:
    config = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 8, "tie_word_embeddings": False}  # fmt: skip
    task = hf_task(write_config(tmp_path, "llama", **config)).at_length(16)
    whole_bytes = sum(p.numel() * p.element_size() for p in task.model().parameters())
    peaks: list[int] = []
    for budget in (1 << 40, None):  # unbounded, then at the first trial's own peak
        limit = budget or peaks[0]
        meter, strategy = FakeMeter(limit, "cpu"), Sharded(64)
        with strategy.process_group(meter.device):
            runner = TrialRunner(task, meter, limit_bytes=limit, strategy=strategy)
            try:
                trial = runner(1)
            finally:
                runner.close()
        assert trial.fits and not trial.oom
        peaks.append(trial.peak_bytes)
    assert peaks[0] == peaks[1] < whole_bytes  # the rank's peak is below the whole model, which is never held
