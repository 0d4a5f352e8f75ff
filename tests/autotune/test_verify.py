"""``autotune verify``: passes on the GPT and the MLP, names BatchNorm on the CNN, and names the
other causes it knows (randomness, a mean of micro-batch means, a summed loss)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import autotune.loop.verify as verify_module
from autotune.core.errors import TaskError
from autotune.loop.verify import (
    CAUSE_BATCHNORM,
    CAUSE_MEAN_OF_MEANS,
    CAUSE_RANDOMNESS,
    CAUSE_SCALE,
    DEFAULT_TOLERANCE,
    verify_cli,
    verify_gradients,
)
from autotune.tasks.task import ProbeTask
from examples import cnn, gpt, mlp


def test_all_is_exported() -> None:
    for name in verify_module.__all__:
        assert hasattr(verify_module, name), name


def test_passes_on_the_gpt_with_variable_lengths_and_says_what_exactness_saves() -> None:
    report = verify_gradients(gpt.task, target_batch=8, micro_batch=2)
    assert report.ok and report.cause is None
    assert report.normalization == "group_count" and report.dtype == "float64"
    assert report.accumulation_steps == 4
    assert report.max_relative_error < 1e-10  # float64 arithmetic, nowhere near the tolerance
    # On the same batch a mean of micro-batch means is off by percent, not by rounding.
    assert report.mean_of_means_error is not None and report.mean_of_means_error > 1e-2
    assert "mean of micro-batch means would be off" in report.message


def test_names_batchnorm_on_the_cnn_and_confirms_it_in_eval_mode() -> None:
    report = verify_gradients(cnn.task, target_batch=8, micro_batch=2)
    assert not report.ok
    assert report.cause == CAUSE_BATCHNORM
    assert report.max_relative_error > 1e-2
    assert "BatchNorm" in report.message and "features.0.1" in report.message
    assert "in eval mode the gradients agree" in report.message


def test_passes_on_the_cnn_in_eval_mode_and_on_the_mlp_with_an_uneven_split() -> None:
    cnn_eval = ProbeTask(name="cnn-eval", model=lambda: cnn.CNN().eval(), batch=cnn.task.batch)
    assert verify_gradients(cnn_eval, target_batch=6, micro_batch=4).ok  # 4 + 2: weighted by samples
    report = verify_gradients(mlp.task, target_batch=10, micro_batch=4)
    assert report.ok and report.accumulation_steps == 3 and report.normalization == "sample_mean"


def test_names_a_mean_of_micro_batch_means_when_the_task_has_no_loss_sum() -> None:
    token_mean_only = ProbeTask(
        name="gpt-mean", model=gpt.GPT, batch=gpt.task.batch, loss=gpt.token_mean_loss
    )
    report = verify_gradients(token_mean_only, target_batch=8, micro_batch=2)
    assert not report.ok and report.cause == CAUSE_MEAN_OF_MEANS
    assert "loss_sum" in report.message


def test_names_dropout_as_randomness() -> None:
    with_dropout = ProbeTask(
        name="gpt-dropout",
        model=lambda: gpt.GPT(gpt.GPTConfig(dropout=0.1)),
        batch=gpt.task.batch,
        loss_sum=gpt.loss_sum,
    )
    report = verify_gradients(with_dropout, target_batch=4, micro_batch=2)
    assert not report.ok and report.cause == CAUSE_RANDOMNESS
    assert "blocks.0.dropout" in report.message


def test_names_a_summed_loss_as_a_scale_error() -> None:
    summed = ProbeTask(
        name="mlp-sum",
        model=mlp.MLP,
        batch=mlp.task.batch,
        loss=lambda model, batch: F.mse_loss(model(batch[0]), batch[1], reduction="sum"),
    )
    report = verify_gradients(summed, target_batch=8, micro_batch=2)
    assert not report.ok and report.cause == CAUSE_SCALE
    assert "0.25x" in report.message


def test_verify_leaves_the_callers_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    verify_gradients(mlp.task, target_batch=4, micro_batch=2)
    assert torch.equal(torch.rand(3), expected)


def test_verify_cli_defaults_and_one_line_messages() -> None:
    ok, line = verify_cli(gpt.task, None, None, None)
    assert ok and line.startswith("gpt-small: ok:") and "T=8 as 4 micro-batches of 2" in line
    assert "\n" not in line
    ok, line = verify_cli(cnn.task, 16, None, None)
    assert not ok and "FAILED (batchnorm)" in line and "T=16 as 4 micro-batches of 4" in line
    ok, line = verify_cli(mlp.task, None, 3, DEFAULT_TOLERANCE)
    assert ok and "T=12 as 4 micro-batches of 3" in line
    ok, line = verify_cli(mlp.task, 4, 8, None)
    assert not ok and "larger than target_batch" in line


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="nothing to accumulate"):
        verify_gradients(mlp.task, target_batch=4, micro_batch=4)
    with pytest.raises(ValueError, match="tolerance"):
        verify_gradients(mlp.task, target_batch=4, micro_batch=2, tolerance=0.0)
    fixed = ProbeTask(name="fixed", model=mlp.MLP, batch=lambda m: mlp.make_batch(3))
    with pytest.raises(TaskError, match="returned 3 samples"):
        verify_gradients(fixed, target_batch=4, micro_batch=2)
