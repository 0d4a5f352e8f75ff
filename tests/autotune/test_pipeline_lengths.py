"""--pp with --seq-len (issue 41): a pipeline over an hf: model at its lengths, each length searched stage by stage on
its own, the probe's real stages equal to the estimate's fake ones on the CPU, and a length past the model's maximum
refused before any trial."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.core.errors import TaskError
from autotune.core.mesh import Mesh
from autotune.orchestrate.config import EstimateConfig, ProbeConfig
from autotune.orchestrate.lengths import PIPELINE_LENGTHS, estimate_lengths, probe_lengths
from autotune.tasks.load import load_task

LLAMA = f"hf:{Path(__file__).resolve().parents[2] / 'examples' / 'configs' / 'tiny-llama.json'}"
MESH = Mesh(pp=2, pp_schedule="1f1b", pp_microbatches=4)
SETUP = {"budget_bytes": 8 << 20, "world_size": 2, "mesh": MESH, "target_batch": 64}


def test_a_pipeline_at_lengths_is_measured_stage_by_stage_and_the_estimate_equals_the_probe() -> None:
    task = load_task(LLAMA)
    probed = probe_lengths(task, ProbeConfig(device="cpu", **SETUP), [64, 128])
    estimated = estimate_lengths(task, EstimateConfig.of(device_kind="cpu", **SETUP), [64, 128])
    assert [p.seq_len for p in probed.profiles] == [p.seq_len for p in estimated.profiles] == [64, 128]
    for real, fake in zip(probed.profiles, estimated.profiles, strict=True):
        assert real.pipeline is not None and fake.pipeline is not None
        assert real.max_micro_batch == fake.max_micro_batch >= 1
        assert real.pipeline.stage_peak_bytes == fake.pipeline.stage_peak_bytes  # to the byte, every stage
        assert real.plan is not None and real.plan.accumulation_steps in range(2, 5)  # 1F1B: pp <= K <= 4
        assert PIPELINE_LENGTHS in real.warnings and PIPELINE_LENGTHS in fake.warnings
    assert probed.profiles[0].max_micro_batch > probed.profiles[1].max_micro_batch  # longer holds more


def test_a_length_past_the_models_maximum_is_refused_before_any_trial() -> None:
    trials: list[object] = []
    with pytest.raises(TaskError, match="--seq-len 512 is longer than the model takes: .* maximum length of 256"):
        config = EstimateConfig.of(device_kind="cpu", budget_bytes=64 << 20)
        estimate_lengths(load_task(LLAMA), config, [64, 512], on_trial=trials.append)
    assert trials == []


def test_the_longest_length_search_stops_at_the_models_maximum_and_says_so() -> None:
    run = estimate_lengths(load_task(LLAMA), EstimateConfig.of(device_kind="cpu", budget_bytes=64 << 20), [64, 128])
    assert run.surface is not None and run.surface.longest is not None
    longest = run.surface.longest
    assert (longest.seq_len, longest.limited_by, longest.cap) == (256, "model", 256)
    assert "maximum length 256" in longest.note
