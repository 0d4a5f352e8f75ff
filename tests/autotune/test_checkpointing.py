"""Activation checkpointing as a memory policy: which blocks it wraps, fake equals real under it,
and each policy's exact m_max against real trials."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autotune.core.errors import TaskError
from autotune.measure.meters import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.policies import POLICIES, apply_policy, wrapped_blocks
from autotune.measure.strategies import make_strategy
from autotune.measure.trial import TrialRunner
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.task import ProbeTask
from examples.gpt import GPT, GPTConfig, make_task
from tests.autotune._tasks import linear_task

UNBOUNDED = 1 << 40
# Four small layers, short sequences: a policy's saving shows and a trial is cheap.
TINY = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=4)


def tiny(policy: str = "none") -> ProbeTask:
    return dataclasses.replace(make_task(TINY, name="gpt-tiny"), activation_checkpointing=policy)


def peaks(task: ProbeTask, meter: CpuMeter, sizes: tuple[int, ...], strategy=None) -> list[tuple[int, int | None]]:
    runner = TrialRunner(task, meter, limit_bytes=UNBOUNDED, strategy=strategy)
    try:
        return [(t.peak_bytes, t.forward_backward_bytes) for t in map(runner, sizes)]
    finally:
        runner.close()


def test_every_2_wraps_every_other_block_and_full_every_block() -> None:
    model = GPT(TINY)
    assert apply_policy(model, "every-2", None) == 2
    marked = [getattr(b, "_autotune_checkpointed", False) for b in model.blocks]
    assert marked == [True, False, True, False]
    assert apply_policy(GPT(TINY), "full", None) == 4
    assert apply_policy(GPT(TINY), "none", None) == 0
    assert wrapped_blocks("every-2", 3) == [0, 2]


def test_checkpointing_keeps_the_gradients() -> None:
    batch = make_task(TINY).batch(3)
    grads = []
    for policy in POLICIES:
        torch.manual_seed(0)
        model = GPT(TINY)
        apply_policy(model, policy, None)
        make_task(TINY).compute_loss(model, batch).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1]) and torch.allclose(grads[0], grads[2])


@pytest.mark.parametrize("policy", ["every-2", "full"])
def test_fake_peaks_equal_the_cpu_meter_under_checkpointing(policy: str) -> None:
    task = tiny(policy)
    sizes = (2, 6)
    fake = peaks(task, FakeMeter(UNBOUNDED), sizes)
    assert fake == peaks(task, CpuMeter(UNBOUNDED), sizes)
    # And the policy changed the figure: less memory per sample than without it.
    plain = peaks(tiny(), CpuMeter(UNBOUNDED), sizes)
    assert fake[1][1] is not None and plain[1][1] is not None
    assert fake[1][1] - fake[0][1] < plain[1][1] - plain[0][1]  # type: ignore[operator]


def test_fake_equals_real_under_full_checkpointing_with_fsdp() -> None:
    task = tiny("full")
    strategy = make_strategy("fsdp", 2)
    with strategy.process_group(torch.device("cpu")):
        fake = peaks(task, FakeMeter(UNBOUNDED), (2, 4), strategy)
        real = peaks(task, CpuMeter(UNBOUNDED), (2, 4), strategy)
    assert fake == real


def test_each_policy_finds_its_own_exact_m_max_against_real_trials() -> None:
    budget = 2 << 20
    found = {}
    for policy in POLICIES:
        task = tiny(policy)
        profile = probe(task, ProbeConfig(device="cpu", budget_bytes=budget, headroom=0.0))
        assert profile.activation_checkpointing == policy
        m = profile.max_micro_batch
        meter = CpuMeter(budget)
        runner = TrialRunner(task, meter, limit_bytes=budget)
        try:  # the answer fits for real and one more sample does not
            assert runner(m).fits and not runner(m + 1).fits
        finally:
            runner.close()
        found[policy] = m
    assert found["none"] < found["every-2"] < found["full"]


def test_the_policy_is_left_out_of_the_fingerprint() -> None:
    # Profiles of one setup under several policies share it; the profile's column tells them apart.
    assert task_fingerprint(tiny("full")) == task_fingerprint(tiny())


def test_an_unknown_policy_is_one_line() -> None:
    with pytest.raises(TaskError, match=r"must be one of none, every-2, full, got 'half'"):
        tiny("half")


def test_full_on_a_model_without_blocks_names_shard_classes() -> None:
    task = linear_task(activation_checkpointing="full")
    with pytest.raises(TaskError, match="shard_classes") as caught:
        probe(task, ProbeConfig(device="cpu", budget_bytes=1 << 20))
    assert "\n" not in str(caught.value)
    assert apply_policy(nn.Linear(2, 2), "none", None) == 0
