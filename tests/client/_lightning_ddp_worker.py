"""Each of the 2 gloo processes of the Lightning DDP test: a torchrun-like rank that fits with the callback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import autotune.orchestrate.probe
from autotune_client.integrations.lightning import AutotuneBatchSize, IntegrationError
from tests.client import _lightning_job as job


def run(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes on a shared CPU: no oversubscription
    job.ddp_env(rank, world_size, port)
    probes: list[int] = []
    real_probe = autotune.orchestrate.probe.probe

    def counted(*args: Any, **kwargs: Any) -> Any:
        probes.append(1)
        return real_probe(*args, **kwargs)

    autotune.orchestrate.probe.probe = counted
    result: dict[str, Any] = {}
    try:
        callback = AutotuneBatchSize(budget=job.BUDGET)
        module = job.Classifier()
        trainer = job.fit(module, [callback], devices=world_size, strategy="ddp", use_distributed_sampler=False)
        assert callback.suggestion is not None
        result.update(
            micro_batch=callback.micro_batch,
            accumulation_steps=callback.accumulation_steps,
            trainer_accumulation=trainer.accumulate_grad_batches,
            world_size=callback.suggestion.world_size,
            source=callback.suggestion.source,
            probes=len(probes),
            losses=job.update_losses(module, int(callback.accumulation_steps or 1)),
        )
        torch.save(job.parameters(module), Path(out_dir, f"rank{rank}.pt"))
        try:  # a recipe that two replicas cannot share equally
            job.fit(job.Classifier(), [AutotuneBatchSize(target_batch=33, budget=job.BUDGET)], devices=world_size)
        except IntegrationError as exc:
            result["uneven"] = str(exc)
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
