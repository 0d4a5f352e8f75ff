"""torchao's low-bit optimizers (``--optimizer adamw4bit``, any ``torchao.optim`` class): each parameter's step
runs through ``torch.compile(fullgraph=True)``, so the job is measured as a compiled one, by the CPU allocator's
own count (CompiledCpuMeter), and is exact there against the allocator's count (tests/autotune/_allocator_truth.py)
of the tiny GPT stepped the ordinary way by torchao's own ``AdamW4bit``. Where it cannot run (the CPU's dispatch
meter, fake tensors, several ranks) it is refused in one line."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from autotune.core.errors import TaskError
from autotune.measure.meters.cpu import CpuMeter
from autotune.orchestrate.probe import ProbeConfig, probe, probe_with_meter
from examples.gpt import GPTConfig, make_task
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._tasks import linear_task

pytest.importorskip("torchao")
# Warnings a job sees once while inductor compiles torchao's step (its state subclasses have no stable hash for AOT
# autograd's cache; a module inductor imports uses torch.jit.script_method): under the suite's warnings-as-errors
# the compile would fail.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not implement _stable_hash_for_caching:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

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


def test_where_a_compiled_step_is_not_measured_it_is_refused_in_one_line() -> None:
    task = dataclasses.replace(make_task(SMALL, name="gpt-small-ao"), optimizer="adamw4bit")
    config = ProbeConfig(device="cpu", budget_bytes=6 * MiB, presearch=False)
    with pytest.raises(TaskError, match=r"^--optimizer adamw4bit: torchao's .* not on fake tensors") as caught:
        probe_with_meter(task, CpuMeter(6 * MiB), config)  # the dispatch meter (and an emulated card's fake one)
    assert "\n" not in str(caught.value)
    with pytest.raises(TaskError, match=r"^--optimizer adamw4bit --world-size 2: .* one device only"):
        probe(task, dataclasses.replace(config, world_size=2))
