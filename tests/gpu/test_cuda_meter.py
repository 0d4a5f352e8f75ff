"""The CUDA meter on a real GPU: allocator peaks, NVML facts, a budget through the memory fraction,
OOM recovery, and the probe's exactness on the examples."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from autotune.measure.meters import CudaMeter
from autotune.measure.trial import run_trial
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def meter_1gib():
    meter = CudaMeter(0, 1 * GiB)
    yield meter
    meter.close()


def test_peak_is_reserved_plus_outside_and_allocated_is_beside_it() -> None:
    meter = CudaMeter(0, None)
    try:
        with meter.measure():
            block = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
            del block
        reading = meter.reading()
        assert reading.allocated_bytes is not None and reading.allocated_bytes >= 256 * MiB
        assert reading.outside_allocator_bytes is not None and reading.outside_allocator_bytes > 0  # the context
        assert reading.peak_bytes >= reading.allocated_bytes + reading.outside_allocator_bytes
        assert meter.budget_bytes <= torch.cuda.get_device_properties(0).total_memory
    finally:
        meter.close()


def test_nvml_facts() -> None:
    meter = CudaMeter(0, None)
    try:
        device = meter.describe()
        assert device.kind == "cuda" and device.name == torch.cuda.get_device_name(0)
        assert device.uuid and device.driver_version and device.compute_capability
        assert device.total_bytes == torch.cuda.mem_get_info(0)[1]
        assert meter.nvml_device_used_bytes() is not None
    finally:
        meter.close()


def test_budget_below_the_card_is_enforced(meter_1gib: CudaMeter) -> None:
    with pytest.raises(torch.OutOfMemoryError), meter_1gib.measure():
        torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    with meter_1gib.measure():  # and the device is usable right after
        torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert meter_1gib.reading().peak_bytes <= 1 * GiB


_FRESH = """
import json
from autotune.measure.meters import CudaMeter
from autotune.tasks.load import load_task
from autotune.measure.trial import run_trial
meter = CudaMeter(0, 1 << 30)
t = run_trial(load_task("examples/gpt.py:task"), meter, 16, limit_bytes=1 << 30)
print(json.dumps([t.allocated_bytes, t.peak_bytes - t.outside_allocator_bytes]))
"""


def test_measurement_after_oom_equals_a_fresh_process(meter_1gib: CudaMeter) -> None:
    task = load_task("examples/gpt.py:task")
    failed = run_trial(task, meter_1gib, 100_000, limit_bytes=1 * GiB)
    assert failed.oom
    after = run_trial(task, meter_1gib, 16, limit_bytes=1 * GiB)
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, check=True)
    fresh_allocated, fresh_reserved = json.loads(out.stdout)
    assert after.allocated_bytes == fresh_allocated
    assert after.outside_allocator_bytes is not None
    assert after.peak_bytes - after.outside_allocator_bytes == fresh_reserved


@pytest.mark.parametrize(("spec", "cap"), [("examples/gpt.py:task", 4096), ("examples/cnn.py:task", 4096)])
def test_probe_is_exact_on_the_gpu(spec: str, cap: int) -> None:
    task = load_task(spec)
    budget = 1 * GiB
    profile = probe(task, ProbeConfig(device="cuda:0", budget_bytes=budget, max_micro_batch=cap))
    m = profile.max_micro_batch
    assert profile.device.kind == "cuda"
    meter = CudaMeter(0, budget)
    try:
        limit = int(budget * (1 - profile.headroom))
        assert run_trial(task, meter, m, limit_bytes=limit).fits
        if m < cap:
            assert not run_trial(task, meter, m + 1, limit_bytes=limit).fits
    finally:
        meter.close()
