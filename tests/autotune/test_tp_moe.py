"""--tp on a mixture of experts (issue 34): transformers' Mixtral plan shards the experts with ``moe_tp_experts``
(the fused ``gate_up_proj`` packed column-wise, ``down_proj`` row-wise, both 3-D), translated by
autotune/measure/tensor_parallel.py into a torch ParallelStyle. A tiny Mixtral-shaped config (8 experts, top-2):
each rank holds its share of every expert, the trial runs, a fake trial counts what the real CPU trial does, and
the real trial's figures are those of rank 0 of two real gloo processes parallelized by transformers' own tp path
(tests/autotune/_tp_moe_worker.py), less the same 8 bytes as the Llama's (tests/autotune/test_tensor_parallel.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessException

from autotune.core.mesh import Mesh
from autotune.measure.meters.cpu import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.strategies import TensorParallel
from autotune.measure.trial import TrialRunner
from autotune.tasks.hf import hf_task
from tests.autotune._tp_trials import LIMIT_BYTES, tp_peaks
from tests.ranks import spawn

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]
EXPERTS, HIDDEN, WIDTH = 8, 32, 48
SLACK_BYTES = 64  # the probe holds 8 bytes the ordinary loop does not (as for the Llama)
CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": HIDDEN,
    "intermediate_size": WIDTH,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def _mixtral(tmp_path: Path) -> Path:
    where = tmp_path / "mixtral"
    where.mkdir()
    (where / "config.json").write_text(json.dumps({"model_type": "mixtral", **CONFIG}))
    return where


def test_each_rank_holds_its_share_of_every_expert(tmp_path: Path) -> None:
    task = hf_task(_mixtral(tmp_path)).at_length(16)
    strategy = TensorParallel(2, Mesh(tp=2))
    with strategy.process_group(torch.device("cpu")):
        model = strategy.wrap(task.model(), task, torch.device("cpu"))
        experts = model.model.layers[0].mlp.experts
        assert tuple(experts.gate_up_proj.to_local().shape) == (EXPERTS, WIDTH, HIDDEN)  # 2 * WIDTH / 2
        assert tuple(experts.down_proj.to_local().shape) == (EXPERTS, HIDDEN, WIDTH // 2)
        assert tuple(model.model.layers[0].mlp.gate.weight.shape) == (EXPERTS, HIDDEN)  # the router: whole
        batch = task.batch(2)
        loss = model(**batch).loss
        loss.backward()
        assert experts.gate_up_proj.grad is not None
        assert tuple(experts.gate_up_proj.grad.to_local().shape) == (EXPERTS, WIDTH, HIDDEN)


@pytest.mark.parametrize(("inner", "world_size"), [("ddp", 2), ("fsdp", 4)])
def test_a_fake_moe_tp_trial_counts_what_the_real_one_does(tmp_path: Path, inner: str, world_size: int) -> None:
    task = hf_task(_mixtral(tmp_path)).at_length(16)
    real = tp_peaks(CpuMeter(LIMIT_BYTES), task, inner, world_size, (1, 2))
    fake = tp_peaks(FakeMeter(LIMIT_BYTES, "cpu"), task, inner, world_size, (1, 2))
    print(f"mixtral tp 2 x {inner} {world_size}: real {real}, fake {fake}")
    assert fake == real
    assert real[2] > real[1]


def test_the_real_trial_is_rank_0_of_a_real_job_on_transformers_own_tp_path(tmp_path: Path) -> None:
    from tests.autotune import _tp_moe_worker

    task = hf_task(_mixtral(tmp_path)).at_length(16)
    probed = tp_peaks(CpuMeter(LIMIT_BYTES), task, "ddp", 2, (1, 2))
    out = tmp_path / "truth"
    out.mkdir()
    try:  # one run per size: gloo's late releases fenced off (tests/autotune/_ordered_gloo.py)
        spawn(_tp_moe_worker.run, args=(2, 2, str(out / "rendezvous"), str(out), CONFIG, list(probed)), nprocs=2)
    except ProcessException as exc:
        errors = "\n".join(path.read_text() for path in sorted(out.glob("rank*.error")))
        pytest.fail(f"the 2-process job failed: {exc}\n{errors}")
    real = {int(m): peak for m, peak in json.loads((out / "peaks.json").read_text()).items()}
    print(f"mixtral tp 2: probe {probed}, most loaded real rank {real}")
    for m, figure in probed.items():
        assert 0 <= figure - real[m] <= SLACK_BYTES


def test_the_experts_weights_come_back_after_a_checkpoints_recomputation(tmp_path: Path) -> None:
    """Under --ac full a checkpoint's recomputation stops by raising once it has what it needs: the experts'
    weights must be their DTensors again all the same (they stayed the local shards, non-leaf tensors, and the
    next trial's AdamW refused them: Mixtral 8x7B's tp 8 estimate failed at its second trial)."""
    from torch.distributed.tensor import DTensor

    task = dataclasses.replace(hf_task(_mixtral(tmp_path)).at_length(16), activation_checkpointing="full")
    meter = CpuMeter(LIMIT_BYTES)
    strategy = TensorParallel(2, Mesh(tp=2))
    with strategy.process_group(meter.device):
        runner = TrialRunner(task, meter, limit_bytes=LIMIT_BYTES, strategy=strategy)
        try:
            peaks = [runner(m).peak_bytes for m in (1, 2)]
            experts = runner._model.model.layers[0].mlp.experts  # type: ignore[union-attr]
            for weight in (experts.gate_up_proj, experts.down_proj):
                assert isinstance(weight, DTensor) and weight.is_leaf
        finally:
            runner.close()
    assert peaks[1] > peaks[0]
