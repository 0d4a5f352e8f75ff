"""The CPU meter: exact live-storage accounting, an OOM that is a torch.OutOfMemoryError, clean release."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch

from autotune.core.errors import BudgetError, DeviceError
from autotune.measure.meters import CpuMeter, CpuOutOfMemoryError, describe_device, make_meter
from autotune.measure.trial import run_trial
from autotune.tasks.load import load_task

MiB = 1 << 20


def test_counts_every_storage_and_its_release() -> None:
    meter = CpuMeter(64 * MiB)
    with meter.measure():
        a = torch.empty(1024, dtype=torch.float32)  # 4 KiB
        b = torch.empty(2048, dtype=torch.float64)  # 16 KiB
        view = a[:10]  # a view shares a's storage: no new bytes
        del b
        c = torch.empty(256, dtype=torch.int8)  # 256 B
        assert meter.live_bytes == 4096 + 256
    assert meter.reading().peak_bytes == 4096 + 16384
    del a, view, c
    gc.collect()
    assert meter.live_bytes == 0


def test_budget_crossing_raises_a_torch_oom_at_that_allocation() -> None:
    meter = CpuMeter(10_000)
    assert issubclass(CpuOutOfMemoryError, torch.OutOfMemoryError)
    kept = []
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"), meter.measure():
        kept.append(torch.empty(2000))  # 8000 bytes: fits
        kept.append(torch.empty(1000))  # 12000 > 10000: raises here
    assert len(kept) == 1
    kept.clear()
    gc.collect()
    assert meter.live_bytes == 0


def test_oom_inside_backward_keeps_its_type() -> None:
    model = torch.nn.Linear(256, 256)
    meter = CpuMeter(model.weight.numel() * 4 + 300_000)
    x = torch.randn(64, 256)
    with pytest.raises(torch.OutOfMemoryError), meter.measure():
        for _ in range(4):
            model(x).sum().backward()  # gradients and saved activations push it over


def test_meter_requires_a_budget() -> None:
    with pytest.raises(BudgetError, match="needs a budget"):
        CpuMeter(None)
    with pytest.raises(BudgetError, match="positive"):
        CpuMeter(0)


def test_device_errors() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the no-CUDA message is for machines without it")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        make_meter("cuda:0", 1 << 30)
    with pytest.raises(DeviceError, match="unknown device"):
        make_meter("tpu", 1 << 30)
    assert describe_device("cpu").name == "cpu"


_FRESH = """
import json
from autotune.measure.meters import CpuMeter
from autotune.tasks.load import load_task
from autotune.measure.trial import run_trial
task = load_task("examples/gpt.py:task")
meter = CpuMeter(16 << 20)
t = run_trial(task, meter, 5, limit_bytes=15 << 20)
print(json.dumps([t.peak_bytes, t.forward_backward_bytes]))
"""


def test_measurement_after_oom_equals_fresh_process_byte_for_byte() -> None:
    task = load_task("examples/gpt.py:task")
    meter = CpuMeter(16 << 20)
    failed = run_trial(task, meter, 400, limit_bytes=15 << 20)
    assert failed.oom and not failed.fits
    assert meter.live_bytes == 0, "the failed trial left storages alive"
    after = run_trial(task, meter, 5, limit_bytes=15 << 20)
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, check=True)
    fresh_peak, fresh_fb = json.loads(out.stdout)
    assert (after.peak_bytes, after.forward_backward_bytes) == (fresh_peak, fresh_fb)
    assert after.fits and not after.oom


def test_the_recorded_streams_follow_each_allocation_not_its_address() -> None:
    """An allocation's stream is kept by its place in the events: a storage's key is its address, which the next
    storage of the same size usually takes again once it is freed (the streams keyed by address gave that storage
    the first one's stream, or took the first one's away: a replay that changed from run to run)."""
    from autotune.measure.meters.cpu import _StorageLedger

    ledger = _StorageLedger()
    ledger.events, ledger.streams = [], {}
    on = iter([77, 0, 77, 0])
    ledger.stream_of, ledger.default_stream = lambda: next(on), 0
    for _ in range(2):
        first = torch.empty(1024).untyped_storage()  # on stream 77
        ledger.add(first)
        del first
        second = torch.empty(1024).untyped_storage()  # on the default stream, most likely at the same address
        ledger.add(second)
        del second
    allocations = [i for i, (_, nbytes) in enumerate(ledger.events) if nbytes > 0]
    assert len(allocations) == 4 and ledger.streams == {allocations[0]: 77, allocations[2]: 77}
