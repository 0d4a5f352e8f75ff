"""One rank of a real tensor-parallel Mixtral job on gloo (spawned by test_tp_moe.py): the truth for --tp on a
mixture of experts. Shares no code with the probe: a tiny Mixtral built the ordinary way
(``MixtralForCausalLM(MixtralConfig(...))``) and parallelized by transformers' own tp path, the one
``from_pretrained(tp_plan="auto")`` takes (the model's plan with its stars expanded, then
``apply_tensor_parallelism``: q/k/v column-wise, o row-wise, the experts' ``gate_up_proj`` packed column-wise,
``down_proj`` row-wise, ``moe_tp_experts`` on the experts). The steps and the peak (the CPU allocator's own running
total) are tests/autotune/_tp_worker.py's.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.autotune import _tp_worker


def _model(mesh: Any, config: dict[str, Any]) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    model = MixtralForCausalLM(MixtralConfig(**config))
    plan = model._expand_parallel_plan(dict(model.tp_plan))
    apply_tensor_parallelism(model, mesh["tp"], plan)
    model.train()
    return model


def run(
    rank: int, world_size: int, tp: int, rendezvous: str, out_dir: str, config: dict[str, Any], sizes: list[int]
) -> None:
    _tp_worker._model = _model  # type: ignore[assignment]
    _tp_worker.run(rank, world_size, tp, rendezvous, out_dir, config, sizes)
