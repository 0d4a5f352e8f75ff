"""tune_trainer on a real Hugging Face Trainer.train (CPU): a budget the recipe's batch does not fit, a
plan that keeps it, and the same training as the recipe unaccumulated; auto_find_batch_size turned off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")

from autotune_client import TunerUnavailableWarning  # noqa: E402
from autotune_client.integrations.transformers import (  # noqa: E402
    AutoFindBatchSizeWarning,
    IntegrationError,
    tune_trainer,
)
from tests.client import _hf_job as job  # noqa: E402


def test_tune_trainer_keeps_the_recipe_batch_and_trains_as_the_recipe(tmp_path: Path) -> None:
    ref_losses, ref_params = job.train(job.trainer(tmp_path / "ref"))
    trainer = job.trainer(tmp_path / "tuned")
    with pytest.warns(TunerUnavailableWarning, match="probing locally"):
        s = tune_trainer(trainer, budget=job.BUDGET)
    micro, steps = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    assert (micro, steps) == (s.micro_batch, s.accumulation_steps)
    assert micro < job.RECIPE_BATCH <= s.max_micro_batch * steps  # the budget binds
    assert micro * steps * 1 == job.RECIPE_BATCH
    assert s.source == "probed" and s.exact
    losses, params = job.train(trainer)
    assert len(losses) == len(ref_losses) == job.STEPS
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_auto_find_batch_size_is_turned_off_with_the_reason(tmp_path: Path) -> None:
    trainer = job.trainer(tmp_path, auto_find_batch_size=True)
    with pytest.warns(AutoFindBatchSizeWarning, match="leaves gradient_accumulation_steps alone"):
        with pytest.warns(TunerUnavailableWarning):
            tune_trainer(trainer, budget=job.BUDGET)
    assert trainer.args.auto_find_batch_size is False
    assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == job.RECIPE_BATCH


class _Texts(torch.utils.data.Dataset[str]):
    """Raw text that nobody tokenized: the default collator has nothing to stack."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> str:
        return f"sentence {index}"


def test_an_item_the_collator_cannot_batch_is_one_line_and_nothing_is_changed(tmp_path: Path) -> None:
    trainer = job.trainer(tmp_path, auto_find_batch_size=True)
    trainer.train_dataset = _Texts()
    with pytest.raises(IntegrationError, match="the data collator cannot batch a train_dataset item") as caught:
        tune_trainer(trainer, budget=job.BUDGET)
    assert "\n" not in str(caught.value) and "(str)" in str(caught.value)
    assert trainer.args.per_device_train_batch_size == job.RECIPE_BATCH
    assert trainer.args.gradient_accumulation_steps == 1 and trainer.args.auto_find_batch_size is True


def test_a_target_batch_is_kept_over_the_arguments(tmp_path: Path) -> None:
    trainer = job.trainer(tmp_path)
    with pytest.warns(TunerUnavailableWarning):
        s = tune_trainer(trainer, target_batch=24, budget=job.BUDGET)
    args = trainer.args
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 24 == s.effective_batch
    assert trainer._train_batch_size == args.per_device_train_batch_size
