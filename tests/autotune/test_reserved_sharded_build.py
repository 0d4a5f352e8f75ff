"""The fake search on a card (autotune/search/reserved.py) under a sharded strategy starts its trials from the
shards: the whole model a fake trial builds before sharding it is not replayed through the allocator's model.

It was (issue 34): built inside the first trial's recording, the whole model's storages stayed reserved in the
allocator's cache, and Mixtral 8x7B's first trial under fsdp 8 read 99.37 GiB at any size, every later one ~33 GiB
less. Here a tiny Mixtral-shaped model whose weights outweigh a rank's trial (8 experts, wide, short sequences):
under fsdp 8 rank 0 never holds the whole model, so no trial's reserved bytes reach the whole model's bytes
(counted from the model transformers builds), and the first trial (m = 1) reads no more than the next (m = 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autotune.measure.strategies import Sharded
from autotune.measure.trial import frozen_heap
from autotune.search.reserved import reserved_search
from autotune.tasks.hf import hf_task

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]
CONFIG = {
    "model_type": "mixtral",
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def test_a_sharded_search_starts_from_the_shards_not_the_whole_build(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    task = hf_task(tmp_path).at_length(8)
    strategy = Sharded(8)
    with strategy.process_group(torch.device("cpu")), frozen_heap():
        found = reserved_search(
            task,
            device_type="cpu",
            device_name="cpu",
            budget_bytes=8 << 30,
            limit_bytes=8 << 30,
            outside_bytes=0,
            workspace_bytes=(),
            strategy=strategy,
            max_micro_batch=1,
            multiple_of=1,
            extra_sizes=(2,),
        )
    first, second = found.trials[1].peak_bytes, found.trials[2].peak_bytes
    print(f"whole model {whole:,} B; reserved at m = 1 (first trial) {first:,}, m = 2 {second:,}")
    assert first <= second < whole
