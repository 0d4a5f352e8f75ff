"""Faults the probe must survive or report: errors that are not OOMs, OOM text from CUDA libraries,
a budget too small for one sample, and OOMs raised inside backward and inside the optimizer step.

The common thread: only a real allocation failure may shrink m. Anything else treated as an OOM makes
the search return a confidently wrong answer, so it must stop the probe with the original error.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autotune.cli.common import EXIT_NO_FIT
from autotune.core.errors import BudgetError, TrialError
from autotune.measure.meters import CpuMeter, CpuOutOfMemoryError
from autotune.measure.oom import is_oom
from autotune.measure.trial import run_trial
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.task import ProbeTask

REPO = Path(__file__).resolve().parents[2]
KiB = 1 << 10
MiB = 1 << 20

# --------------------------------------------------------------------------- a non-OOM error mid-search

SHAPE_BREAKS_ABOVE = 8


def _loss_with_a_shape_bug(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A user's loss that slices the targets to a fixed size: right up to 8 samples, a shape error above."""
    inputs, targets = batch
    return ((model(inputs) - targets[:SHAPE_BREAKS_ABOVE]) ** 2).mean()


def test_shape_error_mid_search_stops_the_probe_with_that_error() -> None:
    task = ProbeTask(
        name="shape-bug",
        model=lambda: nn.Linear(64, 8),
        batch=lambda m: (torch.randn(m, 64), torch.randn(m, 8)),
        loss=_loss_with_a_shape_bug,
    )
    # m = 1 and 2 run; the first prediction lands far above 8 and hits the bug. Treated as an OOM, the
    # search would settle on 8 and report it as the memory limit.
    with pytest.raises(TrialError) as caught:
        probe(task, ProbeConfig(device="cpu", budget_bytes=4 * MiB))
    message = str(caught.value)
    assert "RuntimeError: The size of tensor a" in message
    failed_at = int(re.search(r"micro-batch (\d+) failed", message).group(1))  # type: ignore[union-attr]
    assert failed_at > SHAPE_BREAKS_ABOVE
    assert "\n" not in message  # one line for the CLI


# ------------------------------------------------------------------------------ OOM classification

CUDA_OOM_TEXTS = [
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.06 GiB "
    "is free. Of the allocated memory 76.90 GiB is allocated by PyTorch",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, "
    "so the stacktrace below might be incorrect.",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)",
]
NOT_OOM_TEXTS = [
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported "
    "at some other API call, so the stacktrace below might be incorrect.",
    "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, &alpha, a, "
    "lda, b, ldb, &beta, c, ldc)`",
    "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
    "CUDA error: misaligned address",
    "CUDA error: unspecified launch failure",
    "mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)",
    "The size of tensor a (16) must match the size of tensor b (8) at non-singleton dimension 0",
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
]


@pytest.mark.parametrize("text", CUDA_OOM_TEXTS)
def test_allocation_failures_reported_as_runtime_error_text_are_oom(text: str) -> None:
    assert is_oom(RuntimeError(text))


@pytest.mark.parametrize("text", NOT_OOM_TEXTS)
def test_other_cuda_errors_and_shape_errors_are_not_oom(text: str) -> None:
    assert not is_oom(RuntimeError(text))


@pytest.mark.parametrize(
    "exc",
    [torch.OutOfMemoryError(""), torch.cuda.OutOfMemoryError("no text to go by"), CpuOutOfMemoryError("budget")],
    ids=["torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError", "CpuOutOfMemoryError"],
)
def test_oom_by_type_whatever_the_message(exc: BaseException) -> None:
    assert is_oom(exc)


def test_a_real_shape_error_is_not_oom() -> None:
    with pytest.raises(RuntimeError) as caught:
        torch.ones(4, 3) @ torch.ones(5, 6)
    assert not is_oom(caught.value)


# ------------------------------------------------------------------ a budget too small for m = 1

LINEAR_WEIGHT_BYTES = (64 * 8 + 8) * 4
TOO_SMALL_BUDGET = 4 * KiB  # below weights + gradients + two AdamW moments (4 x 2080 bytes)


def _linear_task() -> ProbeTask:
    return ProbeTask(
        name="linear", model=lambda: nn.Linear(64, 8), batch=lambda m: (torch.randn(m, 64), torch.randn(m, 8))
    )


def _assert_static_bytes(static: int) -> None:
    """Weights, gradients and AdamW's two moments at least; at most that plus the step's own
    temporaries (single-tensor AdamW holds two parameter-sized ones at once) and its step counters.
    Nothing of a sample's activations."""
    assert 4 * LINEAR_WEIGHT_BYTES <= static <= 6 * LINEAR_WEIGHT_BYTES + 64
    assert static > TOO_SMALL_BUDGET


def _static_bytes_in(message: str) -> int:
    found = re.search(r"weights, gradients and optimizer state alone take (\d+) bytes", message)
    assert found is not None, message
    return int(found.group(1))


def test_budget_below_weights_and_optimizer_says_what_they_take() -> None:
    with pytest.raises(BudgetError) as caught:
        probe(_linear_task(), ProbeConfig(device="cpu", budget_bytes=TOO_SMALL_BUDGET))
    _assert_static_bytes(_static_bytes_in(str(caught.value)))
    assert str(TOO_SMALL_BUDGET) in str(caught.value)


def test_cli_budget_below_weights_is_one_error_line_and_exit_no_fit(tmp_path: Path) -> None:
    task_file = tmp_path / "linear_task.py"
    task_file.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn
            from autotune.tasks.task import ProbeTask

            task = ProbeTask(
                name="linear", model=lambda: nn.Linear(64, 8), batch=lambda m: (torch.randn(m, 64), torch.randn(m, 8))
            )
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "probe", f"{task_file}:task", "--device", "cpu", "--budget", "4KiB"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == EXIT_NO_FIT, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if line.startswith("autotune: error:")]
    assert len(errors) == 1, done.stderr
    # The error is the last thing said, after the progress lines of the trial that did not fit.
    assert done.stderr.rstrip("\n").splitlines()[-1] == errors[0]
    _assert_static_bytes(_static_bytes_in(errors[0]))


# ------------------------------------------------- OOMs inside backward and inside the optimizer step


class _Sites:
    """Where OOMs passed through, by micro-batch: filled by the fault tasks below."""

    def __init__(self) -> None:
        self.micro_batch = 0
        self.backward: list[int] = []
        self.step: list[int] = []


SCRATCH_FLOATS_PER_SAMPLE = 4096  # 16 KiB per sample, far above this model's activations


class _WorkspaceInBackward(torch.autograd.Function):
    """Identity forward; backward takes a per-sample workspace, as some kernels' backward passes do."""

    sites: _Sites

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        try:
            workspace = torch.ones(grad.shape[0], SCRATCH_FLOATS_PER_SAMPLE)
        except torch.OutOfMemoryError:
            _WorkspaceInBackward.sites.backward.append(grad.shape[0])
            raise
        return grad + workspace.sum() * 0


class _BackwardHeavy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WorkspaceInBackward.apply(self.linear(x))


STEP_TEMPORARY_COPIES = 4  # whole-model temporaries, as foreach / fused optimizers allocate


class _StepHeavySGD(torch.optim.SGD):
    """SGD with a lazily created per-parameter buffer and whole-model temporaries in every step."""

    sites: _Sites

    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        try:
            for p in params:
                if "shadow" not in self.state[p]:
                    self.state[p]["shadow"] = torch.zeros_like(p)
            temporaries = [torch.empty_like(p) for p in params for _ in range(STEP_TEMPORARY_COPIES)]
        except torch.OutOfMemoryError:
            _StepHeavySGD.sites.step.append(_StepHeavySGD.sites.micro_batch)
            raise
        del temporaries
        return super().step(closure)


class _KeepsLastOutput(nn.Module):
    """A model that keeps its last output (for metrics, say): m-dependent memory alive through the step."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 256)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.last = out.detach()
        return out


def _backward_task(sites: _Sites) -> ProbeTask:
    _WorkspaceInBackward.sites = sites
    return ProbeTask(
        name="oom-in-backward", model=_BackwardHeavy, batch=lambda m: (torch.randn(m, 16), torch.randn(m, 16))
    )


def _step_task(sites: _Sites) -> ProbeTask:
    _StepHeavySGD.sites = sites

    def batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        sites.micro_batch = m
        return torch.randn(m, 256), torch.randn(m, 256)

    return ProbeTask(
        name="oom-in-step",
        model=_KeepsLastOutput,
        batch=batch,
        optimizer=lambda params: _StepHeavySGD(params, lr=0.1),
    )


def _budget_for(task: ProbeTask, micro_batches: float) -> int:
    """A budget whose boundary falls between ceil(micro_batches) - 1 and ceil(micro_batches), from two trials."""
    meter = CpuMeter(256 * MiB)
    one = run_trial(task, meter, 1, limit_bytes=256 * MiB).peak_bytes
    two = run_trial(task, meter, 2, limit_bytes=256 * MiB).peak_bytes
    return one + int((micro_batches - 1) * (two - one))


def _assert_exact(task: ProbeTask, budget: int, m_max: int) -> None:
    """m_max fits and m_max + 1 is an OOM, each on a fresh meter (headroom 0: the budget is the limit)."""
    assert run_trial(task, CpuMeter(budget), m_max, limit_bytes=budget).fits
    over = run_trial(task, CpuMeter(budget), m_max + 1, limit_bytes=budget)
    assert over.oom and not over.fits


def test_oom_inside_backward_is_an_oom_and_the_answer_is_exact() -> None:
    sites = _Sites()
    task = _backward_task(sites)
    budget = _budget_for(task, 12.5)
    profile = probe(task, ProbeConfig(device="cpu", budget_bytes=budget, headroom=0.0))
    m_max = profile.max_micro_batch
    assert m_max == 12  # the boundary _budget_for aimed at (memory is affine in m here)
    assert profile.oom_count >= 1
    # The miss that proves m_max is the largest was an OOM raised inside backward.
    assert m_max + 1 in sites.backward
    # Every OOM of the probe was raised inside backward, and every one was taken as an OOM.
    assert [t.micro_batch for t in profile.trials if t.oom] == sites.backward
    _assert_exact(task, budget, m_max)


def test_oom_inside_optimizer_step_is_an_oom_and_the_answer_is_exact() -> None:
    sites = _Sites()
    task = _step_task(sites)
    meter = CpuMeter(256 * MiB)
    trial = run_trial(task, meter, 4, limit_bytes=256 * MiB)
    # Precondition: the step, not forward/backward, is where this task peaks.
    assert trial.forward_backward_bytes is not None and trial.peak_bytes > trial.forward_backward_bytes
    budget = _budget_for(task, 20.5)
    profile = probe(task, ProbeConfig(device="cpu", budget_bytes=budget, headroom=0.0))
    m_max = profile.max_micro_batch
    assert m_max == 20
    assert profile.oom_count >= 1
    assert m_max + 1 in sites.step
    assert [t.micro_batch for t in profile.trials if t.oom] == sites.step
    _assert_exact(task, budget, m_max)
