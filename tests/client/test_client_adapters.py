"""Suggestion adapters: the keys each framework reads, and that they multiply out as it checks."""

from __future__ import annotations

import pytest

from tests.client._factories import make_suggestion


@pytest.mark.parametrize(("m", "a", "d"), [(16, 4, 2), (1, 1, 1), (7, 3, 5), (512, 1, 8)])
def test_adapters(m: int, a: int, d: int) -> None:
    s = make_suggestion(
        micro_batch=m, accumulation_steps=a, world_size=d, effective_batch=m * a * d, target_batch=m * a * d
    )
    assert s.as_hf_training_args() == {"per_device_train_batch_size": m, "gradient_accumulation_steps": a}
    assert s.as_lightning() == {"accumulate_grad_batches": a, "batch_size": m}
    ds = s.as_deepspeed()
    assert ds == {
        "train_micro_batch_size_per_gpu": m,
        "gradient_accumulation_steps": a,
        "train_batch_size": m * a * d,
    }
    # DeepSpeed refuses a config where these disagree with the data-parallel world size.
    assert (
        ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * d
    )


def test_an_inexact_plan_reports_the_batch_it_really_trains_with() -> None:
    s = make_suggestion(
        micro_batch=7, accumulation_steps=3, world_size=2, effective_batch=42, target_batch=40, exact=False
    )
    # DeepSpeed gets the effective batch the job will really run, not the target it could not reach.
    assert s.as_deepspeed()["train_batch_size"] == 42
