"""AutotuneBatchSize on a real Lightning Trainer.fit (CPU, and 2 gloo ranks under DDP): a budget the
recipe's batch does not fit, a plan that keeps it, and the same training as the recipe unaccumulated."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("lightning", reason="the lightning extra is not installed")

from autotune_client import TunerUnavailableWarning  # noqa: E402
from autotune_client.integrations.lightning import AutotuneBatchSize, IntegrationError  # noqa: E402
from tests.client import _lightning_ddp_worker as worker  # noqa: E402
from tests.client import _lightning_job as job  # noqa: E402
from tests.ranks import spawn

WORLD_SIZE = 2


def _reference(batch_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    module = job.Classifier(batch_size=batch_size)
    job.fit(module, [])
    return module.losses, job.parameters(module)


def _assert_same_training(losses: list[float], params: dict[str, torch.Tensor], ref: Any) -> None:
    ref_losses, ref_params = ref
    assert len(losses) == len(ref_losses) == job.STEPS
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_the_callback_keeps_the_recipe_batch_and_trains_as_the_recipe() -> None:
    callback = AutotuneBatchSize(budget=job.BUDGET)
    module = job.Classifier()
    with pytest.warns(TunerUnavailableWarning, match="probing locally"):
        trainer = job.fit(module, [callback])
    s = callback.suggestion
    assert s is not None and s.source == "probed"
    assert callback.micro_batch is not None and callback.accumulation_steps is not None
    assert callback.micro_batch < job.RECIPE_BATCH  # the recipe's batch does not fit the budget
    assert callback.micro_batch * callback.accumulation_steps * 1 == job.RECIPE_BATCH
    assert module.batch_size == callback.micro_batch
    assert trainer.accumulate_grad_batches == callback.accumulation_steps
    assert len(module.losses) == job.STEPS * callback.accumulation_steps  # micro-batches really ran
    losses = job.update_losses(module, callback.accumulation_steps)
    _assert_same_training(losses, job.parameters(module), _reference(job.RECIPE_BATCH))


def test_no_batch_size_attribute_is_one_line_and_nothing_is_changed() -> None:
    module = job.Classifier()
    callback = AutotuneBatchSize(budget=job.BUDGET, batch_arg_name="micro_bs")
    with pytest.raises(IntegrationError, match="'micro_bs' \\(batch_arg_name\\) is neither an attribute") as caught:
        job.fit(module, [callback])
    assert "\n" not in str(caught.value)
    assert module.batch_size == job.RECIPE_BATCH and module.losses == []
    assert callback.suggestion is None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_under_ddp_rank0_decides_and_both_ranks_train_as_the_recipe(tmp_path: Path) -> None:
    spawn(worker.run, args=(WORLD_SIZE, _free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    zero, one = results
    assert [r["probes"] for r in results] == [1, 0]  # one decision per job
    for r in results:
        assert r["world_size"] == WORLD_SIZE and r["source"] == "probed"
        assert (r["micro_batch"], r["accumulation_steps"]) == (zero["micro_batch"], zero["accumulation_steps"])
        assert r["trainer_accumulation"] == r["accumulation_steps"]
        assert r["micro_batch"] * r["accumulation_steps"] * WORLD_SIZE == job.RECIPE_BATCH * WORLD_SIZE
        assert r["micro_batch"] < job.RECIPE_BATCH
        assert "not a multiple of the world size 2" in r["uneven"]
    # The recipe unaccumulated on one process: the same samples per update (the distributed sampler
    # interleaves them over the ranks), the mean of the ranks' losses is the big batch's loss.
    ref = _reference(job.RECIPE_BATCH * WORLD_SIZE)
    losses = [(a + b) / 2 for a, b in zip(zero["losses"], one["losses"], strict=True)]
    for r in range(WORLD_SIZE):
        _assert_same_training(losses, torch.load(tmp_path / f"rank{r}.pt"), ref)
