"""Accumulation reproduces the large batch: normalization, scaler/clip order, scheduler, partial
groups and the OOM fallback, on the three examples (CPU)."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import nn

import autotune.loop.accumulate as accumulate_module
from autotune.core.plan import plan
from autotune.core.schemas import Observation, Plan
from autotune.loop.accumulate import (
    AccumulationError,
    Accumulator,
    PlanBatchSampler,
    SmallBatchNormWarning,
    batch_size,
    split_batch,
)
from examples import cnn, gpt, mlp
from tests.autotune._acc_helpers import (
    accumulated_grads,
    ce_mean,
    ce_sum,
    concat,
    full_batch_grads,
    gpt_count,
    gpt_micro_batches,
    grads,
    max_relative_error,
    mean_of_means_grads,
    mse_mean,
    mse_sum,
)

# float32 sums over a few hundred elements in a different order: ~1e-7 relative; the classic
# mistakes below are off by percent, five orders of magnitude more.
EXACT = 1e-5
MEASURABLE = 1e-2


def test_all_is_exported() -> None:
    for name in accumulate_module.__all__:
        assert hasattr(accumulate_module, name), name


# -- normalization: exact group denominator vs mean of micro-batch means -------------------


def test_gpt_variable_lengths_group_token_normalization_is_exact() -> None:
    torch.manual_seed(0)
    model = gpt.GPT()
    micro = gpt_micro_batches(4, 2)
    counts = [int(gpt_count(b)) for b in micro]
    assert len(set(counts)) > 1, "the test needs micro-batches with different token counts"

    full = full_batch_grads(model, concat(micro), gpt.token_mean_loss)
    exact = accumulated_grads(model, micro, loss_sum=gpt.loss_sum, count=gpt_count)
    naive = mean_of_means_grads(model, micro, gpt.token_mean_loss)

    exact_error = max_relative_error(exact, full)
    naive_error = max_relative_error(naive, full)
    print(f"gpt: group-token normalization {exact_error:.2e}, mean of means {naive_error:.2e}")
    assert exact_error < EXACT
    assert naive_error > MEASURABLE


def test_mlp_uneven_micro_batches_exact_with_sum_and_with_sample_weighted_mean() -> None:
    torch.manual_seed(0)
    model = mlp.MLP()
    full_batch = mlp.make_batch(10, seed=1)
    micro = split_batch(full_batch, 4)  # 4 + 4 + 2: a short last micro-batch
    assert [batch_size(b) for b in micro] == [4, 4, 2]

    full = full_batch_grads(model, full_batch, mse_mean)
    by_count = accumulated_grads(model, micro, loss_sum=mse_sum, count=lambda b: b[1].numel())
    by_mean = accumulated_grads(model, micro, mean_loss=mse_mean)
    naive = mean_of_means_grads(model, micro, mse_mean)

    assert max_relative_error(by_count, full) < EXACT
    assert max_relative_error(by_mean, full) < EXACT
    naive_error = max_relative_error(naive, full)
    print(f"mlp 4+4+2: exact {max_relative_error(by_count, full):.2e}, mean of means {naive_error:.2e}")
    assert naive_error > MEASURABLE


def test_mlp_equal_micro_batches_mean_path_is_loss_over_a() -> None:
    torch.manual_seed(0)
    model = mlp.MLP()
    micro = split_batch(mlp.make_batch(8, seed=2), 2)
    full = full_batch_grads(model, concat(micro), mse_mean)
    by_mean = accumulated_grads(model, micro, mean_loss=mse_mean)
    # With equal micro-batches, mean of means *is* the full mean: the simple path is exact.
    assert max_relative_error(by_mean, full) < EXACT
    assert max_relative_error(mean_of_means_grads(model, micro, mse_mean), full) < EXACT


def test_cnn_in_eval_mode_exact_and_mean_of_means_differs() -> None:
    torch.manual_seed(0)
    model = cnn.CNN().eval()  # BatchNorm on running statistics: per-sample, so accumulation is exact
    full_batch = cnn.make_batch(10, seed=3)
    micro = split_batch(full_batch, 4)

    full = full_batch_grads(model, full_batch, ce_mean)
    exact = accumulated_grads(model, micro, loss_sum=ce_sum)
    naive = mean_of_means_grads(model, micro, ce_mean)
    assert max_relative_error(exact, full) < EXACT
    assert max_relative_error(naive, full) > MEASURABLE


def test_cnn_in_train_mode_batchnorm_breaks_accumulation_and_warns() -> None:
    torch.manual_seed(0)
    model = cnn.CNN().train()
    full_batch = cnn.make_batch(8, seed=3)
    micro = split_batch(full_batch, 4)
    full = full_batch_grads(model, full_batch, ce_mean)
    with pytest.warns(SmallBatchNormWarning, match="BatchNorm"):
        exact = accumulated_grads(model, micro, loss_sum=ce_sum)
    # Not a normalization bug: BatchNorm normalizes each micro-batch with its own statistics.
    assert max_relative_error(exact, full) > MEASURABLE


def test_no_batchnorm_warning_for_large_micro_batches_or_models_without_batchnorm() -> None:
    model = cnn.CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = Accumulator(model, opt, accumulation_steps=1)
    big = cnn.make_batch(16)
    for group in acc.groups([big]):  # filterwarnings=error: any warning here fails the test
        for batch in group:
            with acc.micro_step():
                acc.backward(ce_sum(model, batch)[0])
        acc.step()
    assert acc.counters.updates == 1


# -- scaler, clipping, scheduler, zero_grad ----------------------------------------------------


def test_scaler_unscale_then_clip_once_then_step_update_scheduler_zero_grad(monkeypatch) -> None:
    torch.manual_seed(0)
    model = mlp.MLP()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda update: 1.0)
    # growth_interval=1: the scale doubles after each good update, so a scale that moved within a
    # group (an update per micro-batch) would show up.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    max_grad_norm = 1e-3
    calls: list[str] = []
    clip_norms: list[float] = []
    scales_seen: list[float] = []

    def record(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    real_clip = torch.nn.utils.clip_grad_norm_

    def clip(params, max_norm, *args, **kwargs):
        calls.append("clip")
        params = list(params)
        clip_norms.append(_total_norm(p.grad for p in params))
        return real_clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    real_scale = scaler.scale

    def scale(loss):
        scales_seen.append(scaler.get_scale())
        return real_scale(loss)

    scaler.scale = scale  # type: ignore[method-assign]
    scaler.unscale_ = record("unscale_", scaler.unscale_)  # type: ignore[method-assign]
    scaler.update = record("update", scaler.update)  # type: ignore[method-assign]
    # A step hook, not a wrapper: the scheduler checks that optimizer.step is its own wrapped method.
    opt.register_step_pre_hook(lambda *_: calls.append("optimizer.step"))
    opt.zero_grad = record("zero_grad", opt.zero_grad)  # type: ignore[method-assign]
    scheduler.step = record("scheduler.step", scheduler.step)  # type: ignore[method-assign]

    micro = split_batch(mlp.make_batch(12, seed=4), 2)  # 6 micro-batches, A=3: two groups
    acc = Accumulator(
        model, opt, accumulation_steps=3, scaler=scaler, scheduler=scheduler, max_grad_norm=max_grad_norm
    )
    expected_first_norm = None
    before = [p.detach().clone() for p in model.parameters()]
    calls.clear()
    for i, group in enumerate(acc.groups(micro)):
        for batch in group:
            with acc.micro_step():
                acc.backward(mse_sum(model, batch)[0])
        if i == 0:
            want = full_batch_grads(reference, concat(group.micro_batches), _mse_per_sample)
            expected_first_norm = _total_norm(want.values())
        norm = acc.step()
        if i == 0:
            assert norm is not None
            step_size = torch.linalg.vector_norm(
                torch.stack(
                    [(p.detach() - b).norm() for p, b in zip(model.parameters(), before, strict=True)]
                )
            )
            # SGD lr=1 moves by the clipped *unscaled* gradient: exactly max_grad_norm. Clipping the
            # scaled gradient and unscaling after would move by max_grad_norm / scale.
            assert float(step_size) == pytest.approx(max_grad_norm, rel=1e-3)

    one_group = ["unscale_", "clip", "optimizer.step", "update", "scheduler.step", "zero_grad"]
    assert calls == ["zero_grad"] + one_group * 2  # groups() starts from a clean gradient
    assert len(clip_norms) == 2  # once per group, not per micro-batch
    # The norm the clip saw is the unscaled accumulated gradient (not 1024x it).
    assert clip_norms[0] == pytest.approx(expected_first_norm, rel=1e-4)
    assert scales_seen == [1024.0] * 3 + [2048.0] * 3  # constant within a group, updated after it
    assert scheduler.last_epoch == 2 == acc.counters.updates
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)


def _total_norm(tensors) -> float:
    return float(torch.linalg.vector_norm(torch.stack([t.norm() for t in tensors])))


def _mse_per_sample(model: nn.Module, batch) -> torch.Tensor:
    # The normalization the accumulator applies to mse_sum with count=samples.
    total, _ = mse_sum(model, batch)
    return total / batch_size(batch)


def test_scheduler_and_counters_per_update_with_partial_last_group() -> None:
    model = gpt.GPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    micro = gpt_micro_batches(7, 2)  # A=3: groups of 3, 3 and a partial 1
    acc = Accumulator(model, opt, accumulation_steps=3, scheduler=scheduler)
    seen = []
    for group in acc.groups(micro, count=gpt_count):
        seen.append((len(group), group.partial))
        for batch in group:
            with acc.micro_step():
                total, n = gpt.loss_sum(model, batch)
                acc.backward(total, count=n)
        acc.step()
    assert seen == [(3, False), (3, False), (1, True)]
    tokens = sum(int(gpt_count(b)) for b in micro)
    assert (acc.counters.micro_batches, acc.counters.updates, acc.counters.samples) == (7, 3, 14)
    assert acc.counters.tokens == tokens
    assert scheduler.last_epoch == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_partial_last_group_uses_its_own_denominator() -> None:
    torch.manual_seed(0)
    model = gpt.GPT()
    micro = gpt_micro_batches(5, 2, seed=10)  # A=2: groups [0,1], [2,3], partial [4]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights fixed: every group compares to one model
    acc = Accumulator(model, opt, accumulation_steps=2)
    per_group = []
    for group in acc.groups(micro, count=gpt_count):
        assert group.denominator == sum(int(gpt_count(b)) for b in group.micro_batches)
        for batch in group:
            with acc.micro_step():
                total, n = gpt.loss_sum(model, batch)
                acc.backward(total, count=n)
        per_group.append((list(group.micro_batches), grads(model)))
        acc.step()
    assert len(per_group) == 3 and len(per_group[-1][0]) == 1
    for batches, got in per_group:
        want = full_batch_grads(model, concat(batches), gpt.token_mean_loss)
        assert max_relative_error(got, want) < EXACT


def test_partial_last_group_dropped_and_reported() -> None:
    model = mlp.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = split_batch(mlp.make_batch(10, seed=5), 2)  # 5 micro-batches, A=2: the 5th is dropped
    acc = Accumulator(model, opt, accumulation_steps=2, partial_last_group="drop")
    groups = 0
    for group in acc.groups(micro, count=lambda b: b[1].numel()):
        groups += 1
        for batch in group:
            with acc.micro_step():
                acc.backward(mse_sum(model, batch)[0])
        acc.step()
    assert groups == 2
    assert (acc.counters.micro_batches, acc.counters.samples) == (4, 8)
    dropped = acc.dropped
    assert (dropped.micro_batches, dropped.samples, dropped.tokens) == (1, 2, 2 * mlp.OUT_FEATURES)


# -- protocol errors: the classic mistakes fail loudly ---------------------------------------


def _mlp_acc(steps: int = 2) -> tuple[nn.Module, Accumulator, list]:
    model = mlp.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, Accumulator(model, opt, accumulation_steps=steps), split_batch(mlp.make_batch(8), 2)


def test_step_before_every_micro_batch_ran_backward_is_an_error() -> None:
    model, acc, micro = _mlp_acc()
    for group in acc.groups(micro):
        for batch in group:
            with acc.micro_step():
                acc.backward(mse_sum(model, batch)[0])
            with pytest.raises(AccumulationError, match="1 of 2 micro-batches"):
                acc.step()  # stepping inside the micro-batch loop: the per-micro-batch update mistake
            return


def test_missing_step_is_an_error_at_the_next_group() -> None:
    model, acc, micro = _mlp_acc()
    with pytest.raises(AccumulationError, match="not stepped"):
        for group in acc.groups(micro):
            for batch in group:
                with acc.micro_step():
                    acc.backward(mse_sum(model, batch)[0])


def test_backward_outside_micro_step_and_count_mismatch_are_errors() -> None:
    model, acc, micro = _mlp_acc()
    for group in acc.groups(micro, count=lambda b: b[1].numel()):
        with pytest.raises(AccumulationError, match="micro_step"):
            acc.backward(mse_sum(model, group.micro_batches[0])[0])
        for batch in group:
            with acc.micro_step():
                acc.backward(mse_sum(model, batch)[0], count=batch_size(batch))  # samples, not elements
        with pytest.raises(AccumulationError, match="wrong denominator"):
            acc.step()
        return


def test_constructor_rejects_nonsense() -> None:
    model = mlp.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="accumulation_steps"):
        Accumulator(model, opt, accumulation_steps=0)
    with pytest.raises(ValueError, match="partial_last_group"):
        Accumulator(model, opt, accumulation_steps=1, partial_last_group="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_grad_norm"):
        Accumulator(model, opt, accumulation_steps=1, max_grad_norm=0.0)


def test_split_batch_handles_nested_batches() -> None:
    batch = {"x": torch.arange(10).view(5, 2), "pair": (torch.arange(5), torch.tensor(3.0)), "tag": "t"}
    pieces = split_batch(batch, 2)
    assert [batch_size(p) for p in pieces] == [2, 2, 1]
    assert torch.equal(concat([p["x"] for p in pieces]), batch["x"])
    assert pieces[2]["pair"][1] == 3.0 and pieces[1]["tag"] == "t"
    with pytest.raises(AccumulationError, match="dim 0"):
        batch_size({"a": torch.zeros(2), "b": torch.zeros(3)})


# -- OOM fallback ----------------------------------------------------------------------------


class _OomAbove:
    """Forward pre-hook that raises torch.OutOfMemoryError for inputs above a size, from a chosen call on."""

    def __init__(self, limit: int, from_call: int = 1) -> None:
        self.limit = limit
        self.from_call = from_call
        self.calls = 0
        self.raised = 0
        self.activation: weakref.ref | None = None

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.calls += 1
        first = args[0]
        if first.shape[0] > self.limit and self.calls >= self.from_call:
            self.raised += 1
            held = torch.empty(first.shape[0], 1 << 16)  # what a real failed forward would pin
            self.activation = weakref.ref(held)
            raise torch.OutOfMemoryError(f"simulated: micro-batch {first.shape[0]} > {self.limit}")


def _train(model, micro, *, steps, count=None, loss_sum=None, mean_loss=None, **kwargs) -> Accumulator:
    # SGD, not Adam: Adam divides by sqrt(v), which turns float noise on a zero gradient (the key
    # bias of attention has one) into a full-size step and would hide what is compared.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, opt, accumulation_steps=steps, **kwargs)
    for group in acc.groups(micro, count=count):
        for batch in group:
            with acc.micro_step():
                if loss_sum is not None:
                    total, n = loss_sum(model, batch)
                    acc.backward(total, count=n)
                else:
                    acc.backward_mean(mean_loss(model, batch))
        acc.step()
    return acc


def test_oom_fallback_mid_group_gives_the_same_update_as_an_uninterrupted_group() -> None:
    torch.manual_seed(0)
    model = gpt.GPT()
    reference = copy.deepcopy(model)
    micro = gpt_micro_batches(4, 4, seed=20)  # m=4, A=2: two groups, T=8
    hook = _OomAbove(limit=2, from_call=2)  # the 2nd micro-batch of group 0 fails: grads are half-accumulated
    model.register_forward_pre_hook(hook)
    observations: list[Observation] = []
    plans: list[Plan] = []

    def observe(obs: Observation) -> None:
        # Called after recovery: the failed attempt's tensors must already be released.
        assert hook.activation is not None and hook.activation() is None
        observations.append(obs)

    acc = _train(
        model,
        micro,
        steps=2,
        count=gpt_count,
        loss_sum=gpt.loss_sum,
        oom_fallback=True,
        observe=observe,
        on_plan_change=plans.append,
    )
    ref = _train(reference, micro, steps=2, count=gpt_count, loss_sum=gpt.loss_sum)

    assert hook.raised == 1
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert [o.micro_batch for o in observations] == [4] and observations[0].oom
    assert [(p.micro_batch, p.accumulation_steps, p.effective_batch) for p in plans] == [(2, 4, 8)]
    assert acc.plan == plans[0] and acc.micro_batch_limit == 2
    # Nothing double-counted: the same samples and tokens, twice the micro-batches.
    assert (acc.counters.updates, acc.counters.samples, acc.counters.tokens) == (
        ref.counters.updates,
        ref.counters.samples,
        ref.counters.tokens,
    )
    assert acc.counters.micro_batches == 2 * ref.counters.micro_batches == 8


def test_oom_fallback_halves_repeatedly_on_the_mean_path() -> None:
    torch.manual_seed(0)
    model = mlp.MLP()
    reference = copy.deepcopy(model)
    micro = split_batch(mlp.make_batch(16, seed=6), 8)  # m=8, A=1, two groups
    hook = _OomAbove(limit=2)  # 8 fails, 4 fails, 2 fits
    model.net[0].register_forward_pre_hook(hook)
    acc = _train(model, micro, steps=1, mean_loss=mse_mean, oom_fallback=True)
    _train(reference, micro, steps=1, mean_loss=mse_mean)
    assert [(e.micro_batch, e.new_micro_batch) for e in acc.oom_events] == [(8, 4), (4, 2)]
    assert acc.plan is not None and (acc.plan.micro_batch, acc.plan.accumulation_steps) == (2, 4)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_oom_without_fallback_or_at_micro_batch_one_propagates() -> None:
    model = mlp.MLP()
    model.net[0].register_forward_pre_hook(_OomAbove(limit=0))
    micro = split_batch(mlp.make_batch(4), 2)
    with pytest.raises(torch.OutOfMemoryError):
        _train(model, micro, steps=2, mean_loss=mse_mean)
    with pytest.raises(torch.OutOfMemoryError, match="micro-batch 1 > 0"):
        _train(model, micro, steps=2, mean_loss=mse_mean, oom_fallback=True)


def test_non_oom_errors_are_not_swallowed_by_the_fallback() -> None:
    model = mlp.MLP()
    bad = [(torch.zeros(2, 3), torch.zeros(2, mlp.OUT_FEATURES))]  # wrong feature count: a shape error
    with pytest.raises(RuntimeError, match="shapes"):
        _train(model, bad, steps=1, mean_loss=mse_mean, oom_fallback=True)


# -- balanced plans: uneven micro-batches from PlanBatchSampler ------------------------------


class _Samples(torch.utils.data.Dataset):
    """A map-style dataset over a dict batch: item i is sample i of every tensor."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return batch_size(self.batch)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.batch.items()}


def _loss_sum_float64(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    # gpt.loss_sum casts the logits to float32; this test holds everything in float64.
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    total = nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=gpt.IGNORE_INDEX, reduction="sum"
    )
    return total, int((labels != gpt.IGNORE_INDEX).sum())


def test_balanced_micro_batches_from_the_sampler_give_the_full_batch_gradient() -> None:
    torch.manual_seed(0)
    model = gpt.GPT().double()
    data = gpt.make_batch(256, seed=11, variable_lengths=True)
    the_plan = plan(26, 256)  # 6 x 26 + 4 x 25 in 10 steps
    sampler = PlanBatchSampler(len(data["labels"]), the_plan)
    loader = torch.utils.data.DataLoader(_Samples(data), batch_sampler=sampler)
    assert [batch_size(b) for b in loader] == [26] * 6 + [25] * 4
    counts = {int(gpt_count(b)) for b in loader}
    assert len(counts) > 1, "the test needs micro-batches with different token counts"

    full = full_batch_grads(model, data, lambda m, b: _loss_sum_float64(m, b)[0] / _loss_sum_float64(m, b)[1])
    got = accumulated_grads(
        model, loader, loss_sum=_loss_sum_float64, count=gpt_count, accumulation_steps=the_plan.accumulation_steps
    )
    error = max_relative_error(got, full)
    print(f"gpt float64, 6 x 26 + 4 x 25: relative error {error:.2e}")
    assert error < EXACT


def test_plan_batch_sampler_groups_order_tail_and_length() -> None:
    sampler = PlanBatchSampler(256 * 2 + 60, [(26, 6), (25, 4)])
    batches = list(sampler)
    sizes = [len(b) for b in batches]
    # Two whole groups in the plan's order, then the last 60 as evenly as the largest size allows.
    assert sizes == ([26] * 6 + [25] * 4) * 2 + [20, 20, 20]
    assert [i for b in batches for i in b] == list(range(572)) and len(sampler) == len(batches)
    dropped = PlanBatchSampler(range(572), plan(26, 256), drop_last=True)
    assert [len(b) for b in dropped] == ([26] * 6 + [25] * 4) * 2 and len(dropped) == 20
    # A sampler's own order (shuffled, or a DistributedSampler's shard) is kept.
    order = torch.randperm(100, generator=torch.Generator().manual_seed(1)).tolist()
    assert [i for b in PlanBatchSampler(order, plan(8, 24)) for i in b] == order
    assert [len(b) for b in PlanBatchSampler(10, plan(8, 24))] == [5, 5]  # 10 < 24: one short group
    for bad in ([], [(0, 1)], [(4, 0)]):
        with pytest.raises(ValueError, match="micro-batches"):
            PlanBatchSampler(10, bad)


def test_accumulator_takes_one_balanced_group_per_update() -> None:
    torch.manual_seed(0)
    model = mlp.MLP()
    x, y = mlp.make_batch(60, seed=4)
    dataset = torch.utils.data.TensorDataset(x, y)
    the_plan = plan(8, 20)  # A = 3: sizes 7, 7, 6
    assert the_plan.micro_batches == [(7, 2), (6, 1)]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=PlanBatchSampler(len(dataset), the_plan))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3)
    for group in acc.groups(loader):
        assert group.samples == 20 and [batch_size(b) for b in group] == [7, 7, 6]
        for batch in group:
            with acc.micro_step():
                acc.backward(mse_sum(model, batch)[0])
        acc.step()
    assert (acc.counters.updates, acc.counters.micro_batches, acc.counters.samples) == (3, 9, 60)
