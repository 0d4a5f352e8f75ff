"""Shared parameters stay shared: tied embeddings are counted once, checked against the CPU allocator's own
count of the model built the ordinary way (tests/autotune/_allocator_truth.py), not against the probe's
other paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from autotune.measure.meters.cpu import CpuMeter
from autotune.measure.trial import build_model, build_on_meta
from autotune.orchestrate.estimate import EstimateConfig, estimate
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task
from autotune.tasks.task import ProbeTask
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._hf_configs import write_config

MiB = 1 << 20
SEQ_LEN = 16
# Tied configs as published models ship them: GPT-2 ties by default, Qwen2 when the config says so.
TIED = {"gpt2": {}, "qwen2": {"tie_word_embeddings": True}}
# What the meter cannot see: `0.5 * x` wraps 0.5 into an 8-byte CPU tensor in C++, below the dispatch mode,
# and MulBackward0 keeps it for backward. GPT-2's gelu_new keeps three per block (2 blocks: 48 bytes, the
# allocator's count above the probe's at every m); Qwen2 keeps none. On CUDA they are host memory.
KEPT_NUMBERS_BYTES = {"gpt2": 2 * 3 * 8, "qwen2": 0}


def _task(tmp_path: Path, arch: str) -> ProbeTask:
    return load_task(f"hf:{write_config(tmp_path, arch, **TIED[arch])}").at_length(SEQ_LEN)


def _shared(model: nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight  # type: ignore[operator,union-attr]


@pytest.mark.parametrize("arch", sorted(TIED))
def test_materializing_a_meta_model_keeps_tied_weights_one_parameter(tmp_path: Path, arch: str) -> None:
    task = _task(tmp_path, arch)
    meta = build_on_meta(task)
    assert meta is not None and _shared(meta)
    model = build_model(task, CpuMeter(64 * MiB), meta)
    assert _shared(model)
    ordinary = task.model()
    assert _shared(ordinary)
    assert len(list(model.parameters())) == len(list(ordinary.parameters()))
    # Buffers too: every tensor that was one object on meta is one object on the device.
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ordinary.parameters())


@pytest.mark.parametrize(("strategy", "world_size"), [("ddp", 1), ("fsdp", 2)])
@pytest.mark.parametrize("arch", sorted(TIED))
def test_tied_configs_are_exact_against_the_allocator_at_m_max_and_past_it(
    tmp_path: Path, arch: str, strategy: str, world_size: int
) -> None:
    task = _task(tmp_path, arch)
    budget = 2 * MiB
    config = ProbeConfig(device="cpu", budget_bytes=budget, target_batch=64, strategy=strategy, world_size=world_size)
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    assert 2 <= m_max < 64
    limit = int(budget * (1 - config.headroom))
    at_max = allocator_peak_bytes(task, m_max, world_size=world_size)
    past_max = allocator_peak_bytes(task, m_max + 1, world_size=world_size)
    # The allocator agrees with the decision at the boundary: m_max fits, m_max + 1 does not.
    assert at_max <= limit < past_max
    # And with the figures: the probe's real trials at m_max and m_max + 1, byte for byte but for the
    # Python numbers autograd keeps (below).
    peaks = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.fake}
    assert 0 <= at_max - peaks[m_max] <= KEPT_NUMBERS_BYTES[arch]
    assert 0 <= past_max - peaks[m_max + 1] <= KEPT_NUMBERS_BYTES[arch]
    estimated = estimate(
        task,
        EstimateConfig.of(
            budget_bytes=budget, device_kind="cpu", target_batch=64, strategy=strategy, world_size=world_size
        ),
    )
    assert estimated.max_micro_batch == m_max
    assert estimated.peak_at(m_max) == measured.peak_at(m_max)
