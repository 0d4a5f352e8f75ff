"""Where a pipeline's memory goes: each stage's steps recorded (autotune/measure/breakdown.py through the replay of
autotune/measure/pipeline/), the most loaded stage's peak stored with its stage named.

The truths share no code with the recorder: each stage's parameters summed from the model built the ordinary way,
by the modules the stage holds (the first stage the embeddings and the first half of the blocks, the last the rest,
the final norm and the head, as torchtitan cuts a model); the receive buffers from the activations' shape; each
stage's peak is the real trial's, which the parts must sum to; and the estimate's fake trials equal the probe's."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.core.mesh import Mesh
from autotune.measure.meters import CpuMeter
from autotune.measure.pipeline import PipelineTrials
from autotune.orchestrate.config import EstimateConfig, ProbeConfig
from autotune.orchestrate.estimate import estimate
from autotune.orchestrate.probe import probe
from examples import gpt

MICRO_BATCH = 4
K = 2  # micro-batches per step: one receive buffer each


def _bytes(*modules: object) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())  # type: ignore[attr-defined]


def test_each_stages_parameters_and_receive_buffers_are_its_own() -> None:
    ordinary = gpt.GPT(gpt.GPTConfig())
    cfg = ordinary.cfg
    held = {
        0: _bytes(ordinary.tok, ordinary.pos, ordinary.blocks[0]),
        1: _bytes(ordinary.blocks[1], ordinary.ln_f, ordinary.head),
    }
    # Stage 0 receives the gradients of its output, stage 1 the activations: K buffers of (m, L, d) fp32 each.
    receive_buffers = K * MICRO_BATCH * cfg.seq_len * cfg.d_model * 4
    meter = CpuMeter(1 << 40)
    trials = PipelineTrials(gpt.task, meter, limit_bytes=1 << 40, stages=2, schedule="1f1b", microbatches=K)
    trials.breakdowns = {}
    trial = trials(MICRO_BATCH)
    peaks = trials.stage_peaks[MICRO_BATCH]
    for stage, breakdown in trials.stage_breakdowns.items():
        assert breakdown is not None
        print(f"stage {stage}: peak {breakdown.peak_bytes}, parts {breakdown.parts}")
        assert breakdown.peak_bytes == peaks[stage] == sum(breakdown.parts.values())
        assert breakdown.parts["trainable_parameters"] == held[stage]
        assert breakdown.parts["collectives"] == receive_buffers
        assert breakdown.parts["optimizer_state"] >= 2 * held[stage]  # AdamW's two moments, its steps' scalars
    stored = trials.breakdowns[MICRO_BATCH]
    assert stored.stage == peaks.index(max(peaks)) and stored.peak_bytes == trial.peak_bytes
    assert stored == trials.stage_breakdowns[stored.stage].model_copy(update={"stage": stored.stage})


def test_a_pipeline_probe_stores_its_most_loaded_stage_and_the_estimate_breaks_down_the_same() -> None:
    setup = {"budget_bytes": 4_000_000, "headroom": 0.0, "world_size": 2, "breakdown": True}
    setup["mesh"] = Mesh(pp=2, pp_schedule="1f1b", pp_microbatches=K)
    measured = probe(gpt.task, ProbeConfig(device="cpu", **setup))  # type: ignore[arg-type]
    m_max = measured.max_micro_batch
    real = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.oom}
    assert measured.breakdown is not None and measured.pipeline is not None
    at_max, above = measured.breakdown
    assert (at_max.micro_batch, at_max.fits, above.micro_batch, above.fits) == (m_max, True, m_max + 1, False)
    assert at_max.peak_bytes == real[m_max] and at_max.stage == measured.pipeline.most_loaded_stage
    assert not any("not broken down" in w for w in measured.warnings)
    estimated = estimate(gpt.task, EstimateConfig(probe=ProbeConfig(**setup), device_kind="cpu"))  # type: ignore[arg-type]
    assert estimated.breakdown is not None
    assert [(b.micro_batch, b.stage, b.parts) for b in estimated.breakdown] == [
        (b.micro_batch, b.stage, b.parts) for b in measured.breakdown
    ]


def test_the_datasheet_names_the_stage(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from autotune.cli import main

    argv = ["probe", "examples/gpt.py:task", "--device", "cpu", "--budget", "4MB", "--world-size", "2", "--pp", "2"]
    code = main([*argv, "--pp-schedule", "1f1b", "--pp-microbatches", str(K), "--output", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert code == 0 and "memory at peak" in out and "the pipeline's most loaded stage:" in out
