"""torchao's low-bit optimizers (``--optimizer adamw4bit``, any ``torchao.optim`` class): each parameter's step
runs through ``torch.compile(fullgraph=True)``, so the job is measured as a compiled one, by the CPU allocator's
own count (CompiledCpuMeter), and is exact there against the allocator's count (tests/autotune/_allocator_truth.py)
of the tiny GPT stepped the ordinary way by torchao's own ``AdamW4bit``. On fake tensors (``autotune estimate``, an
emulated card), where dynamo does not trace, torchao's own step runs eagerly (optimizers.eager_step): its states
are torchao's 4-bit ones, and the estimate is within a few percent of the allocator's count. Where it cannot run
(the CPU's dispatch meter, several ranks) it is refused in one line."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from autotune.core.errors import TaskError
from autotune.measure.meters.cpu import CpuMeter
from autotune.orchestrate.config import EstimateConfig
from autotune.orchestrate.estimate import estimate
from autotune.orchestrate.probe import ProbeConfig, probe, probe_with_meter
from autotune.tasks.optimizers import eager_step, optimizer_factory
from examples.gpt import GPTConfig, make_task
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._tasks import linear_task

pytest.importorskip("torchao")

MiB = 1 << 20
# Matrices of 4,096 elements and more get 4-bit states (torchao's rule, bitsandbytes' threshold); the step is
# compiled once per parameter shape: two here (seconds), where the GPT's eight took a minute.
SMALL = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=2, n_layers=2)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))


def _adamw4bit(params: Any) -> torch.optim.Optimizer:
    from torchao.optim import AdamW4bit

    return AdamW4bit(params)


def test_adamw4bit_is_exact_against_the_allocator_at_m_max_and_past_it() -> None:
    task = linear_task(name="mlp-ao", model=_mlp, batch=lambda m: (torch.randn(m, 128), torch.randn(m, 128)))
    task = dataclasses.replace(task, optimizer="adamw4bit")
    budget = 922_222  # m_max ~ 170: above the sizes where the step's peak (728,340 bytes) is the peak
    measured = probe(task, ProbeConfig(device="cpu", budget_bytes=budget, target_batch=256))
    m_max = measured.max_micro_batch
    assert 150 <= m_max < 256
    assert not any(t.fake for t in measured.trials)  # no fake pre-search: torchao cannot step fake tensors
    ordinary = SimpleNamespace(
        model=_mlp,
        batch=task.batch,
        compute_loss=task.compute_loss,
        shard_classes=None,
        make_optimizer=_adamw4bit,
    )
    # After the probe: torchao's step is compiled once per parameter shape in a process, as in a job's first step.
    at_max, past_max = (allocator_peak_bytes(ordinary, m) for m in (m_max, m_max + 1))
    peaks = {t.micro_batch: t.peak_bytes for t in measured.trials}
    print(f"adamw4bit: m_max {m_max}; probe {peaks[m_max]}, {peaks.get(m_max + 1)}; allocator {at_max}, {past_max}")
    assert (peaks[m_max], peaks[m_max + 1]) == (at_max, past_max)
    assert at_max <= measured.limit_bytes < past_max
    # The states are torchao's 4-bit ones (the weight's), not fp32 zeros.
    model = _mlp()
    optimizer = _adamw4bit(model.parameters())
    task.compute_loss(model, task.batch(2)).backward()
    optimizer.step()
    weight = next(model.parameters())  # the first layer's (128 x 128)
    assert type(optimizer.state[weight]["exp_avg"]).__name__ == "OptimState4bit"


def _mlp_task() -> Any:
    task = linear_task(name="mlp-ao", model=_mlp, batch=lambda m: (torch.randn(m, 128), torch.randn(m, 128)))
    return dataclasses.replace(task, optimizer="adamw4bit")


def test_on_fake_tensors_the_step_runs_eagerly_with_torchaos_own_4bit_states() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    factory = optimizer_factory("adamw4bit")
    compile_ = torch.compile
    with FakeTensorMode():
        model = _mlp()
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        # Without it: the code table's .tolist(), or dynamo not tracing (or, where this process compiled the step
        # for these shapes already, the compiled kernels run on the fake tensors' storage-free data: a crash).
        optimizer = factory(model.parameters())
        with eager_step(factory):
            optimizer.step()
    assert torch.compile is compile_
    weight, bias = model[0].weight, model[0].bias
    for key in ("exp_avg", "exp_avg_sq"):
        state = optimizer.state[weight][key]
        # torchao's layout (subclass_4bit.py): 16,384 moments, two 4-bit codes a byte, an fp32 scale per block of
        # 128 (AdamW4bit's default), a 16-entry fp32 code table.
        assert type(state).__name__ == "OptimState4bit"
        assert isinstance(state.codes, FakeTensor) and state.codes.dtype == torch.uint8
        assert (state.codes.numel(), state.scale.numel(), state.qmap.numel()) == (8192, 128, 16)
        assert type(optimizer.state[bias][key]) is FakeTensor  # 128 < 4,096 elements: fp32 zeros
    # The code tables were built on real tensors (lru_cached lists: no fake placeholder left behind).
    from torchao.optim.subclass_4bit import get_qmap_unsigned

    assert get_qmap_unsigned()[:2] == pytest.approx((0.0625, 0.125))


def test_the_fake_estimate_is_within_5_percent_of_the_allocator() -> None:
    task = _mlp_task()
    budget = 922_222  # the probe's test's budget (its m_max 172, exact)
    profile = estimate(task, EstimateConfig.of(budget_bytes=budget, device_kind="cpu", target_batch=256))
    assert "ran it eagerly" in profile.warnings[0]
    m_max = profile.max_micro_batch
    peaks = {t.micro_batch: t.peak_bytes for t in profile.trials}
    ordinary = SimpleNamespace(
        model=_mlp,
        batch=task.batch,
        compute_loss=task.compute_loss,
        shard_classes=None,
        make_optimizer=_adamw4bit,
    )
    # At m = 2 the step is the peak (torchao's compiled step against its eager ops); at m_max the backward (the
    # allocator counts a kernel's internal buffers a fake trial does not see: 3,072 against 2,560 bytes a sample).
    truths = {m: allocator_peak_bytes(ordinary, m) for m in (2, m_max)}
    print(f"adamw4bit fake: m_max {m_max}; fake {peaks[2]}, {peaks[m_max]}; allocator {truths}")
    for m, truth in truths.items():
        assert abs(peaks[m] / truth - 1) < 0.05, (m, peaks[m], truth)
    assert 160 <= m_max <= 190


def test_where_a_compiled_step_is_not_measured_it_is_refused_in_one_line() -> None:
    task = dataclasses.replace(make_task(SMALL, name="gpt-small-ao"), optimizer="adamw4bit")
    config = ProbeConfig(device="cpu", budget_bytes=6 * MiB, presearch=False)
    with pytest.raises(TaskError, match=r"^--optimizer adamw4bit: torchao's .* not under the CPU's dispatch") as caught:
        probe_with_meter(task, CpuMeter(6 * MiB), config)  # the dispatch meter
    assert "\n" not in str(caught.value)


def test_a_probe_over_lengths_gets_the_compiled_meter(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under the CPU's dispatch meter torchao's step is refused (above): each length's probe needs the allocator's
    # count, as a single-length probe picks it (probe.py). The meter's choice is all this checks (a probe over
    # lengths of a compiled step takes minutes: docs/recipes.md has one's figures against the estimate).
    import autotune.orchestrate.lengths as lengths
    from examples.gpt import make_seq_task

    asked: list[bool] = []

    class Chosen(Exception):
        pass

    def make_meter(device: str, budget_bytes: int | None, *, compiled: bool) -> Any:
        asked.append(compiled)
        raise Chosen

    monkeypatch.setattr(lengths, "make_meter", make_meter)
    task = make_seq_task(dataclasses.replace(SMALL, seq_len=64), name="gpt-seq-ao")
    config = ProbeConfig(device="cpu", budget_bytes=40 * MiB)
    for optimizer, compiled in (("adamw4bit", True), ("AdamW", False)):
        with pytest.raises(Chosen):
            lengths.probe_lengths(dataclasses.replace(task, optimizer=optimizer), config, [32, 64])
        assert asked.pop() is compiled
