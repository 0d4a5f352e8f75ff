"""`autotune estimate --gpu NAME --pp N`: a pipeline on an emulated card. Each stage's fake trial (the stage built
alone, its schedule replayed, autotune/measure/pipeline/) runs in the emulated child with CUDA semantics and is
replayed through the caching allocator's model on its own rank (autotune/emulation/card_pipeline.py).

What is checked against the CPU stage trials (whose figures tests/autotune/test_pipeline.py holds equal to real gloo
ranks): the same stages, K and bubble; each stage's card figure at least its CPU-semantics live bytes plus the memory
outside the allocator (the card holds the same tensors, in allocator blocks, with CUDA's own kernels' extras); the
answer the most loaded stage's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.core.schemas import Profile
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.pipeline import PipelineTrials
from autotune.tasks.hf import hf_task
from tests.autotune._hf_configs import TWO_LAYERS, write_config

pytest.importorskip("transformers")
SEQ_LEN, M_CAP, K = 512, 2, 2  # small: each stage trial replays K micro-batches, the search tries 1 up to M_CAP


def test_a_pipeline_estimates_on_an_emulated_card_stage_by_stage(cuda_python: str, tmp_path: Path) -> None:
    folder = write_config(tmp_path, "llama", tie_word_embeddings=False, max_position_embeddings=SEQ_LEN, **TWO_LAYERS)
    out = tmp_path / "pp.json"
    code = main(
        ["estimate", f"hf:{folder}", "--gpu", "h100", "--world-size", "2", "--pp", "2", "--pp-schedule", "1f1b",
         "--pp-microbatches", str(K), "--seq-len", str(SEQ_LEN), "--max-seq-len", str(SEQ_LEN),
         "--max-micro-batch", str(M_CAP), "--target-batch", str(M_CAP * K), "--output", str(out)]
    )  # fmt: skip
    assert code == 0
    (raw,) = json.loads(out.read_text())
    profile = Profile.model_validate(raw)
    assert profile.device.name == "NVIDIA H100 80GB HBM3" and profile.source == "estimate"
    assert profile.max_micro_batch == M_CAP  # a tiny model: the cap
    stages = profile.pipeline
    assert stages is not None and stages.microbatches == K
    assert stages.bubble_fraction == pytest.approx(1 / (K + 1))
    assert len(stages.stage_peak_bytes) == 2
    assert stages.most_loaded_stage == stages.stage_peak_bytes.index(max(stages.stage_peak_bytes))
    at_cap = next(t for t in profile.trials if t.micro_batch == M_CAP)
    assert at_cap.fake and at_cap.peak_bytes == max(stages.stage_peak_bytes)
    outside = at_cap.outside_allocator_bytes
    assert outside and at_cap.allocated_bytes and at_cap.allocated_bytes <= at_cap.peak_bytes - outside
    # The most loaded stage's figure broken down on the card: its live parts, the allocator's reserve beyond them
    # and the memory outside it, summing to the figure the search decided on.
    assert profile.breakdown is not None
    (broken,) = [b for b in profile.breakdown if b.micro_batch == M_CAP]
    assert broken.stage == stages.most_loaded_stage and broken.peak_bytes == at_cap.peak_bytes
    assert sum(broken.parts.values()) == at_cap.peak_bytes and broken.parts["outside_allocator"] == outside
    live_peak_bytes = max(sum(point[1:]) for point in broken.timeline)  # the timeline is the live tensors'
    assert broken.parts["allocator_reserve"] == at_cap.peak_bytes - outside - live_peak_bytes > 0
    assert at_cap.allocated_bytes is not None and live_peak_bytes <= at_cap.allocated_bytes
    # The plan: m x K x D = T with D = W / pp = 1 replica, K at most the one measured.
    plan = profile.plan
    assert plan is not None and plan.exact and (plan.micro_batch, plan.accumulation_steps) == (M_CAP, K)

    cpu = PipelineTrials(
        hf_task(folder).at_length(SEQ_LEN), FakeMeter(1 << 40, "cpu"), limit_bytes=1 << 40, stages=2,
        schedule="1f1b", microbatches=K,
    )  # fmt: skip
    cpu(M_CAP)
    print(f"card stages {stages.stage_peak_bytes} (outside {outside}); CPU stages {cpu.stage_peaks[M_CAP]}")
    for card_figure, cpu_peak in zip(stages.stage_peak_bytes, cpu.stage_peaks[M_CAP], strict=True):
        assert card_figure - outside >= cpu_peak


@pytest.mark.parametrize("tp", [1, 2])
def test_a_pipeline_over_fsdp_estimates_on_an_emulated_card(cuda_python: str, tmp_path: Path, tp: int) -> None:
    """--strategy fsdp --world-size 4 --pp 2 (and fsdp 2 x tp 2 x pp 2 at --world-size 8 --tp 2): each stage
    sharded over its 2 data-parallel ranks (and parallelized over its 2 tp ranks by the model's own plan) in the child
    (ShardedStage, whose CPU figures tests/autotune/test_pipeline_fsdp.py and bench/pipeline_meshes.py hold equal to
    real gloo ranks)."""
    import torch

    from autotune.core.mesh import Mesh
    from autotune.measure.strategy_choice import make_strategy

    folder = write_config(tmp_path, "llama", tie_word_embeddings=False, max_position_embeddings=SEQ_LEN, **TWO_LAYERS)
    out = tmp_path / "pp_fsdp.json"
    world = 4 * tp
    code = main(
        ["estimate", f"hf:{folder}", "--gpu", "h100", "--strategy", "fsdp", "--world-size", str(world), "--pp", "2",
         "--tp", str(tp), "--pp-microbatches", str(K), "--seq-len", str(SEQ_LEN), "--max-seq-len", str(SEQ_LEN),
         "--max-micro-batch", str(M_CAP), "--target-batch", str(M_CAP * K * 2), "--output", str(out)]
    )  # fmt: skip
    assert code == 0
    (raw,) = json.loads(out.read_text())
    profile = Profile.model_validate(raw)
    stages = profile.pipeline
    assert profile.max_micro_batch == M_CAP and stages is not None and len(stages.stage_peak_bytes) == 2
    at_cap = next(t for t in profile.trials if t.micro_batch == M_CAP)
    outside = at_cap.outside_allocator_bytes
    assert outside and at_cap.peak_bytes == max(stages.stage_peak_bytes)
    # D = 4 / 2 = 2 replicas: T = m x K x D with m = M_CAP, K.
    plan = profile.plan
    assert plan is not None and plan.exact
    assert (plan.micro_batch, plan.accumulation_steps, plan.world_size) == (M_CAP, K, 2)
    strategy = make_strategy("fsdp", world, Mesh(pp=2, tp=tp, pp_microbatches=K))
    with strategy.process_group(torch.device("cpu")):
        cpu = PipelineTrials(
            hf_task(folder).at_length(SEQ_LEN), FakeMeter(1 << 40, "cpu"), limit_bytes=1 << 40, stages=2,
            schedule="1f1b", microbatches=K, strategy=strategy,
        )  # fmt: skip
        cpu(M_CAP)
    print(f"card stages {stages.stage_peak_bytes} (outside {outside}); CPU stages {cpu.stage_peaks[M_CAP]}")
    for card_figure, cpu_peak in zip(stages.stage_peak_bytes, cpu.stage_peaks[M_CAP], strict=True):
        assert card_figure - outside >= cpu_peak


def test_a_pipeline_under_sequence_parallel_takes_the_extra_sizes_asked_for(cuda_python: str, tmp_path: Path) -> None:
    """--micro-batches on a pipeline's card estimate is tried besides the search's sizes (it was dropped), here
    under torchtitan's plan, whose stages send each rank's L / tp positions."""
    out = tmp_path / "pp.json"
    folder = write_config(tmp_path, "llama", **TWO_LAYERS)
    code = main(
        ["estimate", f"hf:{folder}", "--gpu", "h100", "--seq-len", "16", "--tp", "2",
         "--pp", "2", "--world-size", "4", "--tp-plan", "torchtitan", "--max-micro-batch", "8", "--micro-batches",
         "5", "--output", str(out)]
    )  # fmt: skip
    assert code == 0
    (raw,) = json.loads(out.read_text())
    profile = Profile.model_validate(raw)
    assert 5 in {t.micro_batch for t in profile.trials} and profile.pipeline is not None
    assert profile.tags["tp_plan"] == "torchtitan"
