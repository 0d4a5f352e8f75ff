"""Suggestion adapters: the keys each framework reads, and that they multiply out as it checks."""

from __future__ import annotations

import warnings

import pytest

from autotune.core.plan import UnevenPlanWarning
from autotune.core.schemas import Suggestion
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


def _balanced(**overrides: object) -> Suggestion:
    """6 x 26 + 4 x 25 = 256 in 10 steps on one replica: what a balanced plan answers for m_max 26."""
    values: dict[str, object] = {
        "micro_batch": 26,
        "accumulation_steps": 10,
        "world_size": 1,
        "effective_batch": 256,
        "target_batch": 256,
        "max_micro_batch": 26,
        "micro_batches": [(26, 6), (25, 4)],
    }
    values.update(overrides)
    return make_suggestion(**values)


def test_adapters_of_a_balanced_plan_give_the_best_equal_one_and_name_the_balanced_one() -> None:
    s = _balanced()
    assert s.uneven
    with pytest.warns(UnevenPlanWarning, match=r"6×26 \+ 4×25 = 256 \(10 steps\)") as caught:
        hf = s.as_hf_training_args()
    assert "16 x 16 x 1 = 256 (16 steps)" in str(caught[0].message) and "Trainer" in str(caught[0].message)
    assert hf == {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 16}
    with pytest.warns(UnevenPlanWarning):
        assert s.as_lightning() == {"accumulate_grad_batches": 16, "batch_size": 16}
    with pytest.warns(UnevenPlanWarning, match="DeepSpeed"):
        ds = s.as_deepspeed()
    assert ds == {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 16, "train_batch_size": 256}


def test_the_equal_plan_keeps_multiple_of_and_world_size() -> None:
    # m_max 24 in multiples of 8 on 2 replicas, T = 176: balanced is 24, 24, 24, 16 per replica.
    s = _balanced(
        micro_batch=24,
        accumulation_steps=4,
        world_size=2,
        effective_batch=176,
        target_batch=176,
        max_micro_batch=24,
        multiple_of=8,
        micro_batches=[(24, 3), (16, 1)],
    )
    with pytest.warns(UnevenPlanWarning, match=r"\(3×24 \+ 1×16\) × 2 = 176") as caught:
        ds = s.as_deepspeed()
    micro, steps = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    assert micro % 8 == 0 and micro <= 24 and micro * steps * 2 == ds["train_batch_size"]
    # No equal plan in multiples of 8 reaches 176 (11 units per replica is prime): the nearest, said so.
    assert ds["train_batch_size"] == 192 and "target 176" in str(caught[0].message)


def test_adapters_of_an_equal_plan_do_not_warn() -> None:
    s = make_suggestion()  # 16 x 4 x 2, one pair
    assert not s.uneven and s.micro_batches == [(16, 4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert s.as_hf_training_args()["per_device_train_batch_size"] == 16
