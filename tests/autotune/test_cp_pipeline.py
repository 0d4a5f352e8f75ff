"""--cp with --pp (issue 41): a pipeline whose stages run context parallelism, each stage's ring over a cp group of its
own (torchtitan's pp x cp), over ddp and over fsdp (FSDP2 over the cp ranks).

The truth (tests/autotune/_cp_pipeline_worker.py, no measuring code of the probe): 4 real gloo processes, pp 2 x cp 2,
transformers' Llama cut by hand into two stages, ``PipelineStage`` / ``Schedule1F1B`` (K = 2) inside PyTorch's
``context_parallel`` for each step. The probe's real stages (the CPU meter) and the estimate's fake ones must read
each stage's most loaded real rank (cp rank 0, which the head-tail balancer gives the partial merges) at m_max and
m_max + 1, and the probe answer the real job's m_max.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from autotune.cli import main
from autotune.core.mesh import Mesh
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.hf import hf_task
from tests.autotune._hf_configs import CONFIGS, write_config
from tests.ranks import spawn_or_fail

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
    ),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]

SEQ_LEN, K, WORLD = 64, 2, 4
MESH = Mesh(pp=2, cp=2, pp_schedule="1f1b", pp_microbatches=K)
BUDGET = 2_000_000  # between m = 7 and m = 8 of the most loaded stage, over ddp and over fsdp
# The probe's stages read 16 bytes above the real ranks (the fake group's scalar of --cp and --tp: docs/meshes.md).
SLACK_BYTES = 64
INNERS = ("ddp", "fsdp")


# Longer than SEQ_LEN: each cp rank's part of the sequence (L / cp) is shorter than the model's maximum, and what a
# stage past the first computes from its arriving part (the causal mask) must see the part's length (issue 61).
MAX_POSITIONS = 128
SHAPE = {"tie_word_embeddings": False, "num_hidden_layers": 2, "max_position_embeddings": MAX_POSITIONS}


def _config(tmp_path: Path) -> Path:
    return write_config(tmp_path, "llama", **SHAPE)


def _stage_peaks(task: Any, inner: str, sizes: list[int], fake: bool) -> dict[int, list[int]]:
    """Every stage's peak at each size with no budget: the probe's real stages (the CPU meter) or the estimate's
    fake ones."""
    from autotune.measure.meters import CpuMeter
    from autotune.measure.meters.fake import FakeMeter
    from autotune.measure.pipeline import PipelineTrials
    from autotune.measure.strategy_choice import make_strategy

    strategy = make_strategy(inner, WORLD, MESH)
    meter: Any = FakeMeter(1 << 40, "cpu") if fake else CpuMeter(1 << 40)
    with strategy.process_group(meter.device):
        trials = PipelineTrials(
            task, meter, limit_bytes=1 << 40, stages=2, schedule="1f1b", microbatches=K, strategy=strategy
        )
        for m in sizes:
            trials(m)
    return {m: trials.stage_peaks[m] for m in sizes}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Over ddp and fsdp: the probe at BUDGET, every stage's real and fake peaks at m_max and m_max + 1, and the real
    ranks' (one spawn of 4 processes for both)."""
    from tests.autotune import _cp_pipeline_worker

    tmp_path = tmp_path_factory.mktemp("cp_pipeline")
    task = hf_task(_config(tmp_path)).at_length(SEQ_LEN)
    found: dict[str, Any] = {}
    for inner in INNERS:
        config = ProbeConfig(
            device="cpu", budget_bytes=BUDGET, headroom=0.0, strategy=inner, world_size=WORLD, mesh=MESH
        )
        measured = probe(task, config)
        sizes = [measured.max_micro_batch, measured.max_micro_batch + 1]
        found[inner] = {
            "measured": measured,
            "sizes": sizes,
            "real": _stage_peaks(task, inner, sizes, fake=False),
            "fake": _stage_peaks(task, inner, sizes, fake=True),
        }
    worker_config = {k: v for k, v in CONFIGS["llama"].items() if k != "model_type"}
    worker_config.update(SHAPE)
    out = tmp_path / "truth"
    out.mkdir()
    jobs = [(inner, found[inner]["sizes"]) for inner in INNERS]
    args = (WORLD, str(out / "rendezvous"), str(out), worker_config, SEQ_LEN, K, jobs)
    spawn_or_fail(_cp_pipeline_worker.run, args, WORLD, out)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    for inner in INNERS:
        found[inner]["ranks"] = {m: [r[inner][str(m)] for r in ranks] for m in found[inner]["sizes"]}
    return found


@pytest.mark.parametrize("inner", INNERS)
def test_each_stage_equals_its_most_loaded_real_rank(inner: str, job: dict[str, Any]) -> None:
    found = job[inner]
    measured, real, fake, ranks = found["measured"], found["real"], found["fake"], found["ranks"]
    m_max = measured.max_micro_batch
    assert measured.mesh == {"pp": 2, "cp": 2, "pp_schedule": "1f1b", "pp_microbatches": K}, measured.mesh
    print(f"pp 2 x cp 2 ({inner}): m_max {m_max}; probe's stages {real}, fake {fake}; real ranks {ranks}")
    for m in found["sizes"]:
        # Rank r runs stage r // 2 as cp rank r % 2; cp rank 0 is its stage's most loaded.
        stages = [ranks[m][0:2], ranks[m][2:4]]
        assert all(stage[0] == max(stage) for stage in stages), (m, stages)
        for stage, peaks in enumerate(stages):
            assert 0 <= real[m][stage] - max(peaks) <= SLACK_BYTES, (m, stage, real[m], stages)
        assert fake[m] == real[m]  # the estimate's fake stages, to the byte
    truth = {m: max(ranks[m]) for m in found["sizes"]}
    assert truth[m_max] <= measured.limit_bytes < truth[m_max + 1]
    assert measured.pipeline is not None and measured.pipeline.stage_peak_bytes == real[m_max]


def test_pp_with_cp_is_no_longer_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI takes the composition (it was refused in one line) and estimates it."""
    folder = _config(tmp_path)
    code = main(
        ["estimate", f"hf:{folder}", "--device-kind", "cpu", "--budget", "2000000", "--headroom", "0", "--seq-len",
         str(SEQ_LEN), "--max-seq-len", str(SEQ_LEN), "--world-size", str(WORLD), "--pp", "2", "--cp", "2",
         "--pp-microbatches", str(K)]
    )  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "refused" not in out.err and "not measured" not in out.err


def test_a_stage_past_the_first_sees_its_part_of_the_sequence(tmp_path: Path) -> None:
    """Under a memory policy a stage past the first computed its causal mask over the whole length (the embedding's
    stand-in had the whole model's shape, the position ids the rank's part) and raised IndexError, fake and real: the
    levers' fake trials of a job that did not fit crashed the probe (issue 61). Its stages now run, the estimate's fake
    ones equal to the probe's real ones."""
    import dataclasses

    task = dataclasses.replace(hf_task(_config(tmp_path)).at_length(SEQ_LEN), activation_checkpointing="full")
    real = _stage_peaks(task, "ddp", [1], fake=False)
    assert real == _stage_peaks(task, "ddp", [1], fake=True)
    assert all(peak > 0 for peak in real[1]), real
