"""On a real GPU: fake trials with CUDA semantics, the pre-search's real-trial count, and fsdp as
rank 0 of 8 through the fake process group on the cuda device."""

from __future__ import annotations

import pytest
import torch

from autotune.measure.meters import CudaMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.trial import TrialRunner
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task

GiB = 1 << 30


def _peak(meter, spec: str, micro_batch: int, strategy=None) -> tuple[int, int | None]:
    runner = TrialRunner(load_task(spec), meter, limit_bytes=1 << 50, strategy=strategy)
    try:
        trial = runner(micro_batch)
        return trial.peak_bytes, trial.allocated_bytes
    finally:
        runner.close()


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_fake_cuda_trials_count_close_to_the_allocators_allocated_bytes(name: str) -> None:
    spec = f"examples/{name}.py:task"
    fake_peak, _ = _peak(FakeMeter(1 << 50, "cuda"), spec, 64)
    meter = CudaMeter(0, None)
    try:
        _, allocated = _peak(meter, spec, 64)
    finally:
        meter.close()
    assert allocated is not None
    print(f"{name} m=64: fake {fake_peak} bytes, max_memory_allocated {allocated} bytes")
    # The allocator rounds every block up to 512 bytes and adds library workspaces; fake tensors do not.
    assert 0.5 * allocated <= fake_peak <= 1.05 * allocated


@pytest.mark.parametrize("name", ["gpt", "cnn", "mlp"])
def test_the_presearch_leaves_few_real_trials_on_cuda(name: str) -> None:
    profile = probe(load_task(f"examples/{name}.py:task"), ProbeConfig(device="cuda:0", budget_bytes=2 * GiB))
    real = [t for t in profile.trials if not t.fake]
    print(
        f"{name}: m={profile.max_micro_batch}, real trials {[t.micro_batch for t in real]}, warnings {profile.warnings}"
    )
    assert profile.max_micro_batch > 1
    assert len(real) <= 8


def test_fsdp_rank0_of_8_holds_less_than_one_ddp_replica_on_cuda() -> None:
    spec = "examples/gpt.py:task"
    meter = CudaMeter(0, None)
    try:
        ddp, _ = _peak(meter, spec, 32)
        strategy = make_strategy("fsdp", 8)
        with strategy.process_group(meter.device):
            fsdp, _ = _peak(meter, spec, 32, strategy)
    finally:
        meter.close()
    print(f"gpt m=32 on cuda: ddp {ddp} bytes, fsdp rank 0 of 8 {fsdp} bytes")
    assert 0 < fsdp <= ddp
    assert torch.cuda.is_available()
