"""One trial: the accumulate-and-step cycle, classification of failures, DDP buckets counted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.core.errors import TaskError, TrialError
from autotune.measure.meters import CpuMeter
from autotune.measure.strategies import Replicated
from autotune.measure.trial import run_trial

from ._tasks import linear_task

MiB = 1 << 20


def test_trial_counts_weights_gradients_and_optimizer_state() -> None:
    task = linear_task()
    meter = CpuMeter(64 * MiB)
    trial = run_trial(task, meter, 4, limit_bytes=64 * MiB)
    weights = (64 * 8 + 8) * 4
    # weights + gradients + two AdamW moments are alive together during the second step
    assert trial.peak_bytes >= 4 * weights
    assert trial.fits and not trial.oom
    assert meter.live_bytes == 0


def test_peak_grows_with_micro_batch() -> None:
    task = linear_task()
    meter = CpuMeter(64 * MiB)
    small = run_trial(task, meter, 8, limit_bytes=64 * MiB)
    large = run_trial(task, meter, 512, limit_bytes=64 * MiB)
    assert large.forward_backward_bytes is not None and small.forward_backward_bytes is not None
    assert large.forward_backward_bytes > small.forward_backward_bytes


def test_shape_error_is_not_an_oom() -> None:
    task = linear_task(batch=lambda m: (torch.randn(m, 63), torch.randn(m, 8)))
    with pytest.raises(TrialError, match="micro-batch 4 failed: RuntimeError"):
        run_trial(task, CpuMeter(64 * MiB), 4, limit_bytes=64 * MiB)


def test_batch_without_tensors() -> None:
    task = linear_task(batch=lambda m: [1, 2, 3])
    with pytest.raises(TaskError, match="no tensors"):
        run_trial(task, CpuMeter(64 * MiB), 2, limit_bytes=64 * MiB)


def test_non_scalar_loss() -> None:
    task = linear_task(loss=lambda model, batch: model(batch[0]))
    with pytest.raises(TaskError, match="scalar"):
        run_trial(task, CpuMeter(64 * MiB), 2, limit_bytes=64 * MiB)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trials_run(precision: str) -> None:
    task = linear_task(precision=precision)
    trial = run_trial(task, CpuMeter(64 * MiB), 16, limit_bytes=64 * MiB)
    assert trial.fits and trial.peak_bytes > 0


def test_ddp_gradient_buckets_are_counted() -> None:
    task = linear_task(model=lambda: nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 8)))
    meter = CpuMeter(64 * MiB)
    alone = run_trial(task, meter, 4, limit_bytes=64 * MiB)
    strategy = Replicated(2)
    with strategy.process_group(torch.device("cpu")) as group:
        assert group is not None and strategy.measures_buckets
        wrapped = run_trial(task, meter, 4, limit_bytes=64 * MiB, strategy=strategy)
    weights = (64 * 256 + 256 + 256 * 8 + 8) * 4
    # DDP's flat gradient buckets hold a copy of every gradient
    assert wrapped.peak_bytes >= alone.peak_bytes + weights


def test_the_first_trial_after_a_ddp_build_allocates_what_every_later_one_does() -> None:
    """DDP's reducer rebuilds its buckets at the second forward after its construction, broadcasting their indices over
    the probe's one-process gloo group; gloo's worker thread could free them after the trial's peak (one probe in
    about 2,700 read 72 B high). The runner settles DDP before its first measured trial (TrialRunner._settle): the
    first trial's allocations are then the same sizes, in the same numbers, as the next one's."""
    from collections import Counter

    from autotune.measure.trial import TrialRunner

    task = linear_task(model=lambda: nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 8)))
    strategy = Replicated(2)
    with strategy.process_group(torch.device("cpu")):
        meter = CpuMeter(64 * MiB)
        runner = TrialRunner(task, meter, limit_bytes=64 * MiB, strategy=strategy)
        runner.build()
        sizes, peaks = [], []
        for _ in range(2):
            with meter.record_events() as recorded:
                peaks.append(runner(4).peak_bytes)
            sizes.append(Counter(nbytes for _, nbytes in recorded.events if nbytes > 0))
        runner.close()
    assert sizes[0] == sizes[1] and peaks[0] == peaks[1]
