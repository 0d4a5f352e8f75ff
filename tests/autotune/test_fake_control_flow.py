"""A fake trial takes the branch a healthy real run takes wherever a scalar read gates memory.

GradScaler calls ``optimizer.step()`` only when its inf check reads 0; a fake trial used to read 1.0 there and
never allocated the optimizer's state. Checked against the real CPU trial and the CPU allocator's own count
(``torch.profiler`` memory events) of the model built the ordinary way and a step written out by hand: fp16
(autocast and GradScaler on the CPU) through the probe at m_max and m_max + 1, and bf16 with GradScaler and
``clip_grad_norm_(..., error_if_nonfinite=True)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from autotune.loop.accumulate import Accumulator
from autotune.measure.meters import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.trial import TrialRunner
from autotune.orchestrate.estimate import EstimateConfig, estimate
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.task import ProbeTask

KiB = 1 << 10
UNBOUNDED = 1 << 40
WIDTH, HIDDEN = 128, 512
# The model below holds 0.5 MiB of weights, as much again in gradients and twice that in AdamW's moments,
# which live through the second step's forward and backward: at this budget m_max is about a hundred, and
# some three hundred if the moments were left out.
BUDGET_BYTES = 3072 * KiB
HEADROOM = 0.1


@pytest.fixture(autouse=True)
def _native_reduced_precision_gemm() -> Any:
    """oneDNN off for the matmuls here. On a CPU with AVX512-FP16/BF16 (this project's CI machines have them)
    oneDNN runs fp16/bf16 addmm with scratch buffers it takes from the CPU allocator inside the kernel
    (366,656 bytes for the second layer's fp16 addmm at m = 99), which no dispatched op returns and the CPU
    meter does not see, like mse_loss's unreduced loss (docs/probing.md, "What the CPU meter does not
    see"). This file is about the control flow of scaled steps, so its truth and its trials take ATen's
    own GEMM, which allocates nothing of its own; on CPUs without those instructions both paths agree."""
    # torch.backends.mkldnn.flags() also sets oneDNN's TF32 flag, which warns on a CPU-only build.
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))


def _batch(micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(micro_batch, WIDTH), torch.randn(micro_batch, WIDTH)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    # Written out: nn.functional.mse_loss's CPU kernel allocates its unreduced loss inside the kernel, a
    # temporary that no dispatched op returns and that the CPU meter (real or fake) does not count.
    return ((model(x).float() - y) ** 2).mean()


def _task(precision: str) -> ProbeTask:
    return ProbeTask(name=f"mlp-{precision}", model=_model, batch=_batch, loss=_loss, precision=precision)


def _scaled_steps(micro_batch: int, dtype: torch.dtype, *, clip: bool) -> torch.optim.Optimizer:
    """The training loop as torch's AMP recipe writes it: the model built the ordinary way, autocast on the
    CPU, GradScaler, two micro-batches per AdamW step, two steps (docs/design.md, "The trial"). Returns the
    optimizer, whose state says whether the steps ran."""
    model = _model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):
        for _ in range(2):
            batch = _batch(micro_batch)
            with torch.autocast("cpu", dtype=dtype):
                loss = _loss(model, batch) / 2
            scaler.scale(loss).backward()
            del batch, loss
        if clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def _allocator_peak_bytes(run: Callable[[], Any]) -> int:
    """The CPU allocator's own peak of live bytes over run(): its memory events summed in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def _metered(meter: CpuMeter, run: Callable[[], torch.optim.Optimizer]) -> tuple[int, int]:
    """(peak bytes, tensors in the optimizer's state) of run() under meter."""
    with meter.measure():
        optimizer = run()
        states = sum(len(state) for state in optimizer.state.values())
        del optimizer
    meter.release()
    return meter.reading().peak_bytes, states


def test_fp16_fake_trials_equal_the_real_trial_and_the_allocator_at_m_max_and_past_it() -> None:
    task = _task("fp16")
    config = ProbeConfig(device="cpu", budget_bytes=BUDGET_BYTES, headroom=HEADROOM, target_batch=256)
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    assert 8 <= m_max < 256, m_max
    real = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.fake}
    assert sorted(real) == [m_max, m_max + 1]
    runner = TrialRunner(task, FakeMeter(UNBOUNDED), limit_bytes=UNBOUNDED)
    try:
        fake = {m: runner(m).peak_bytes for m in (m_max, m_max + 1)}
    finally:
        runner.close()
    truth = {m: _allocator_peak_bytes(lambda m=m: _scaled_steps(m, torch.float16, clip=False)) for m in fake}
    assert fake == real == truth
    limit = int(BUDGET_BYTES * (1 - HEADROOM))
    assert truth[m_max] <= limit < truth[m_max + 1]
    # The estimate (fake trials only) finds the same boundary: with the optimizer's state left out it was above.
    estimated = estimate(
        task, EstimateConfig.of(budget_bytes=BUDGET_BYTES, device_kind="cpu", headroom=HEADROOM, target_batch=256)
    )
    assert estimated.max_micro_batch == m_max


def test_bf16_with_a_scaler_and_a_nonfinite_check_clips_and_steps_in_a_fake_trial() -> None:
    # Large enough that the peak is the second step's backward, over the moments the first step made (at
    # the step itself AdamW's wrapped Python numbers, a few bytes no dispatched op returns, are live).
    micro_batch = 128
    params = len(list(_model().parameters()))

    def run() -> torch.optim.Optimizer:
        return _scaled_steps(micro_batch, torch.bfloat16, clip=True)

    fake_peak, fake_states = _metered(FakeMeter(UNBOUNDED), run)
    real_peak, real_states = _metered(CpuMeter(UNBOUNDED), run)
    assert fake_states == real_states == 3 * params  # step, exp_avg, exp_avg_sq: every step ran
    assert fake_peak == real_peak == _allocator_peak_bytes(run)


def test_the_accumulator_steps_with_a_scaler_and_clipping_in_a_fake_trial() -> None:
    def run() -> torch.optim.Optimizer:
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        acc = Accumulator(model, optimizer, accumulation_steps=2, scaler=torch.amp.GradScaler("cpu"), max_grad_norm=1.0)
        loader = [_batch(8) for _ in range(4)]
        for group in acc.groups(loader):
            for batch in group:
                with acc.micro_step(), torch.autocast("cpu", dtype=torch.bfloat16):
                    acc.backward(_loss(model, batch) * len(batch[0]), count=len(batch[0]))
            acc.step()
        assert acc.counters.updates == 2 and acc.counters.skipped_updates == 0
        return optimizer

    fake_peak, fake_states = _metered(FakeMeter(UNBOUNDED), run)
    real_peak, real_states = _metered(CpuMeter(UNBOUNDED), run)
    assert fake_states == real_states > 0
    assert fake_peak == real_peak


def _norm() -> torch.Tensor:
    return torch.linalg.vector_norm(torch.randn(64))


CHECKS: list[tuple[str, Callable[[torch.Tensor], object], object]] = [
    ("isnan", lambda x: bool(torch.isnan(x).any()), False),
    ("isinf", lambda x: bool(torch.isinf(x).any()), False),
    ("isfinite", lambda x: bool(torch.isfinite(x).all()), True),  # Lightning's check_finite_loss
    ("x != x", lambda x: bool((x != x).any()), False),
    ("abs == inf", lambda x: int((x.abs() == float("inf")).sum()), 0),
    ("> -inf", lambda x: bool((x > float("-inf")).all()), True),
    ("clip's check", lambda _: bool(torch.logical_or(_norm().isnan(), _norm().isinf())), False),
    ("HF's filter", lambda x: bool(torch.isnan(x.sum()) or torch.isinf(x.sum())), False),
    ("a scaler's found_inf", lambda _: torch.full((), 0.0).item(), 0.0),
    ("Lightning's SIGTERM flag", lambda _: torch.tensor([0]).item(), 0),
    ("a loss read", lambda x: x.sum().item(), 1.0),  # a placeholder: data, read for arithmetic
    ("a count read", lambda x: int((x > 0).sum()), 1),
]


@pytest.mark.parametrize(("what", "read", "answer"), CHECKS, ids=[c[0] for c in CHECKS])
def test_scalar_reads_answer_what_a_healthy_run_reads(what: str, read: Callable[[Any], object], answer: object) -> None:
    meter = FakeMeter(UNBOUNDED)
    with meter.measure():
        got = read(torch.randn(4, 8))
    assert got == answer and type(got) is type(answer), (what, got)


def test_an_unscale_finds_no_inf_and_the_scale_updates_as_in_a_real_run() -> None:
    meter = FakeMeter(UNBOUNDED)
    with meter.measure():
        weight = nn.Parameter(torch.randn(4))
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
        scaler.scale(weight.sum()).backward()
        optimizer = torch.optim.SGD([weight], lr=0.1)
        scaler.unscale_(optimizer)
        found = scaler._found_inf_per_device(optimizer)
        assert [t.item() for t in found.values()] == [0.0]
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == 2048.0  # grown after a clean step, as the real one would
