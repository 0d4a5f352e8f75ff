"""--ep on a DeepSeek-V3-shaped model (issue 63): MLA attention, shared experts beside the routed ones, the first
block dense, a grouped sigmoid router, under op-level checkpointing (torchtitan's recipe: ``--ac op``), whose
checkpointed blocks hold the experts' own FSDP2 unit. The fake trial counts what the real CPU trial routed alike
does (tests/autotune/_ep_worker.py's forced assignment)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from autotune.measure.meters.cpu import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.tasks.hf import hf_task
from tests.autotune.test_experts import LIMIT_BYTES, _probe

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
EXPERTS, TOP_K = 8, 2
DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": EXPERTS,
    "n_shared_experts": 2,
    "num_experts_per_tok": TOP_K,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "rope_scaling": None,
}


def _deepseek(tmp_path: Path) -> Any:
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    return dataclasses.replace(hf_task(tmp_path).at_length(16), activation_checkpointing="op")


def _routed_as_forced(task: Any, sizes: tuple[int, ...]) -> Any:
    from tests.autotune import _ep_worker

    for m in sizes:
        _ep_worker._FORCED[m * 16] = _ep_worker.forced_assignment(m * 16, EXPERTS, TOP_K, None)

    def model() -> Any:
        built = task.model()
        for layer in built.model.layers[1:]:  # the first block is dense
            _ep_worker._forced_router(layer.mlp.gate)
        return built

    return dataclasses.replace(task, model=model)


def test_a_deepseek_v3_under_op_checkpointing_fake_counts_what_real_does(tmp_path: Path) -> None:
    task = _deepseek(tmp_path)
    fake = _probe(FakeMeter(LIMIT_BYTES, "cpu"), task, 2, 2, (1, 2))
    real = _probe(CpuMeter(LIMIT_BYTES), _routed_as_forced(task, (1, 2)), 2, 2, (1, 2))
    print(f"deepseek-v3 ep 2 x fsdp 2, --ac op: fake {fake}, real {real}")
    assert fake == real
    assert real[2] > real[1]
