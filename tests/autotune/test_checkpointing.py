"""Activation checkpointing as a memory policy: which blocks it wraps, fake equals real under it,
and each policy's exact m_max against real trials."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autotune.core.errors import TaskError
from autotune.core.schemas import Suggestion
from autotune.measure.meters import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.policies import (
    POLICIES,
    BlockCheckpointing,
    NoCheckpointing,
    OpCheckpointing,
    apply_policy,
    check_policy,
    policy_for,
    wrapped_blocks,
)
from autotune.measure.strategy_choice import make_strategy
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


@pytest.mark.parametrize(("policy", "marked"), [("every-3", [0, 3]), ("every-5", [0]), ("op", [0, 1, 2, 3])])
def test_every_k_wraps_the_first_block_and_every_kth_after_it_and_op_every_block(
    policy: str, marked: list[int]
) -> None:
    model = GPT(TINY)
    assert apply_policy(model, policy, None) == len(marked)
    assert [i for i, b in enumerate(model.blocks) if getattr(b, "_autotune_checkpointed", False)] == marked
    assert wrapped_blocks(policy, 4) == marked


def test_policies_are_objects_with_canonical_names() -> None:
    assert policy_for("every-2") == BlockCheckpointing(2) and policy_for("full") == BlockCheckpointing(1)
    assert policy_for("none") == NoCheckpointing()
    assert policy_for("op:aten.addmm.default/mm/addmm") == OpCheckpointing(("addmm", "mm"))
    assert policy_for("op").name == "op" and "mm" in policy_for("op").saved_ops  # type: ignore[attr-defined]
    # A task's policy is kept in its canonical spelling: the profile records it, /suggest matches it.
    assert tiny("op:aten.mm/aten.addmm").activation_checkpointing == "op:addmm/mm"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("every-1", "'every-1' checkpoints every block: that is full (every-K needs K >= 2)"),
        ("every-x", "'every-x': K of every-K must be a whole number from 2 to 9999"),
        ("every-02", "'every-02': write K without leading zeros (every-2)"),
        ("op:", "'op:': name the ops after the colon (op:mm/addmm), or write op for torchtitan's list"),
        ("op:foo", "'op:foo': unknown op 'foo': this torch"),
        ("op:mm/aten.mm.nope", "unknown op 'aten.mm.nope'"),
        ("half", "unknown policy 'half': choose from none, every-K (K from 2 to 9999), full, op, or op:OP/OP/..."),
    ],
)
def test_a_bad_policy_name_is_one_line_saying_the_rule(name: str, message: str) -> None:
    with pytest.raises(TaskError) as caught:
        check_policy(name)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_checkpointing_keeps_the_gradients() -> None:
    batch = make_task(TINY).batch(3)
    grads = []
    for policy in (*POLICIES, "every-3", "op:addmm/mm"):
        torch.manual_seed(0)
        model = GPT(TINY)
        apply_policy(model, policy, None)
        make_task(TINY).compute_loss(model, batch).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert all(torch.allclose(grads[0], other) for other in grads[1:])


SIZES = (2, 6)


@pytest.fixture(scope="module")
def plain_peaks() -> list[tuple[int, int | None]]:
    """The tiny GPT's real peaks without a policy at SIZES: one measurement for every policy's comparison."""
    return peaks(tiny(), CpuMeter(UNBOUNDED), SIZES)


@pytest.mark.parametrize("policy", ["every-2", "full", "op", "op:addmm/mm"])
def test_fake_peaks_equal_the_cpu_meter_under_checkpointing(
    policy: str, plain_peaks: list[tuple[int, int | None]]
) -> None:
    task = tiny(policy)
    fake = peaks(task, FakeMeter(UNBOUNDED), SIZES)
    assert fake == peaks(task, CpuMeter(UNBOUNDED), SIZES)
    # And the policy changed the figure: less memory per sample than without it.
    plain = plain_peaks
    assert fake[1][1] is not None and plain[1][1] is not None
    assert fake[1][1] - fake[0][1] < plain[1][1] - plain[0][1]  # type: ignore[operator]


@pytest.mark.parametrize("policy", ["full", "op:addmm/mm"])
def test_fake_equals_real_under_checkpointing_with_fsdp(policy: str) -> None:
    task = tiny(policy)
    strategy = make_strategy("fsdp", 2)
    with strategy.process_group(torch.device("cpu")):
        fake = peaks(task, FakeMeter(UNBOUNDED), (2, 4), strategy)
        real = peaks(task, CpuMeter(UNBOUNDED), (2, 4), strategy)
    assert fake == real


def test_each_policy_finds_its_own_exact_m_max_against_real_trials() -> None:
    """Real trials only (no pre-search: its fake trials took 60 % of this test's time); the pre-search under the
    policies is test_fake_peaks_equal_the_cpu_meter_under_checkpointing's and test_policy_truth's."""
    budget = 2 << 20
    found = {}
    for policy in POLICIES:
        task = tiny(policy)
        profile = probe(task, ProbeConfig(device="cpu", budget_bytes=budget, headroom=0.0, presearch=False))
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
    assert found["none"] < found["op"]


def test_the_policy_is_left_out_of_the_fingerprint() -> None:
    # Profiles of one setup under several policies share it; the profile's column tells them apart.
    assert task_fingerprint(tiny("full")) == task_fingerprint(tiny()) == task_fingerprint(tiny("op:mm"))


def test_an_unknown_policy_is_one_line() -> None:
    with pytest.raises(TaskError, match=r"^activation checkpointing: unknown policy 'half': choose from none, every-K"):
        tiny("half")


def test_full_on_a_model_without_blocks_names_shard_classes() -> None:
    task = linear_task(activation_checkpointing="full")
    with pytest.raises(TaskError, match="shard_classes") as caught:
        probe(task, ProbeConfig(device="cpu", budget_bytes=1 << 20))
    assert "\n" not in str(caught.value)
    assert apply_policy(nn.Linear(2, 2), "none", None) == 0


def test_the_hf_trainer_checkpoints_every_layer_for_a_policy_it_cannot_express() -> None:
    plan = {"micro_batch": 4, "accumulation_steps": 2, "world_size": 1, "effective_batch": 8, "target_batch": 8}
    plan |= {"exact": True, "max_micro_batch": 4, "source": "measured"}
    full = Suggestion.model_validate({**plan, "activation_checkpointing": "full"})
    assert full.as_hf_training_args()["gradient_checkpointing"] is True
    op = Suggestion.model_validate({**plan, "activation_checkpointing": "op"})
    # Every layer holds less than op does: the plan still fits, and the warning says what stands in for op.
    with pytest.warns(UserWarning, match=r"gradient_checkpointing=True \(every layer\) stands in for 'op'"):
        assert op.as_hf_training_args()["gradient_checkpointing"] is True
