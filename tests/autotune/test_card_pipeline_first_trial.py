"""A pipeline's search on a card (autotune/emulation/card_pipeline.py) carries no build artefact in its first trial.

The card's search of a whole model did (issue 34, fixed in 04ad14a): a fake sharded model was built whole inside
the first trial's recording, the whole model's storages went through the caching allocator's model and stayed
reserved, and Mixtral 8x7B under fsdp 8 read 99.37 GiB at its first trial at any size. A pipeline's stage is built
inside every trial's recording, from ``meta`` straight into what the rank holds (its blocks under ddp; its shards
under fsdp or tp, cut and sharded on ``meta`` first): every trial replays the same build, the first one included.
Here a Llama whose weights outweigh a stage's activations (wide, short sequences), each stage replayed through the
allocator's model as the card's child replays it (CPU semantics: the same trace without CUDA's kernels): the first
trial at m = 1 reads what a repeated trial at m = 1 reads after m = 2, and no more than m = 2, on every stage, under
pp 2 over ddp, over fsdp, with tp 2, and fsdp 2 x tp 2. Where a stage holds less than the whole model (with tp), a
whole model built and freed in the first trial shows (checked by hand: the model below built once inside the first
stage's build read 75,497,472 reserved bytes on stage 0 under tp 2, 33,554,432 without); where it holds more (ddp,
fsdp over 2 replicas: the stage's gradients and AdamW states), the freed blocks are reused and hide it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autotune.core.mesh import Mesh
from autotune.emulation.card_pipeline import replayed_stage
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.pipeline import PipelineTrials
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.trial import frozen_heap
from autotune.tasks.hf import hf_task

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]
CONFIG = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
CARD_BYTES = 8 << 30


@pytest.mark.parametrize(
    ("strategy_name", "world_size", "tp"), [("ddp", 2, 1), ("fsdp", 4, 1), ("ddp", 4, 2), ("fsdp", 8, 2)]
)
def test_a_pipelines_first_trial_on_a_card_reads_what_a_repeated_one_does(
    tmp_path: Path, strategy_name: str, world_size: int, tp: int
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    task = hf_task(tmp_path).at_length(8)
    strategy = make_strategy(strategy_name, world_size, Mesh(pp=2, tp=tp, pp_microbatches=2))
    meter = FakeMeter(CARD_BYTES, "cpu")
    figure = replayed_stage(meter, workspace_bytes=(), budget_bytes=CARD_BYTES, outside_bytes=0, alloc_conf=None)
    with strategy.process_group(torch.device("cpu")), frozen_heap():
        trials = PipelineTrials(
            task, meter, limit_bytes=CARD_BYTES, stages=2, schedule="1f1b", microbatches=2, strategy=strategy,
            stage_figure=figure,
        )  # fmt: skip
        try:
            read = []
            for m in (1, 2, 1):
                trials(m)
                read.append(list(trials.stage_peaks[m]))
        finally:
            trials.close()
    first, larger, again = read
    print(f"pp 2 over {strategy_name} (tp {tp}, W {world_size}): reserved by stage at m = 1 first {first}, m = 2 "
          f"{larger}, m = 1 again {again}")  # fmt: skip
    assert first == again
    assert all(a <= b for a, b in zip(first, larger, strict=True))
