"""On one GPU, for each example: probe under a budget, then train 50 real steps at the chosen m and
check the peak stays within budget x (1 - headroom) with no OOM, that m + multiple_of does not fit,
and print the CUDA meter's figure beside NVML's reading of the device.

Run by bench/gpu_check.sh; prints a table, exits non-zero when a check fails.
"""

from __future__ import annotations

import sys
import time

import torch

from autotune.core.units import format_bytes
from autotune.measure.meters import CudaMeter
from autotune.measure.strategies import Replicated
from autotune.measure.trial import build_model, make_batch, run_trial
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task

GiB = 1 << 30
STEPS = 50
ACCUMULATION_STEPS = 2
# (task, budget, cap): the MLP is tiny per sample, so its cap is raised to reach a real boundary.
CASES = [
    ("examples/gpt.py:task", 1 * GiB, 4096),
    ("examples/cnn.py:task", 1 * GiB, 4096),
    ("examples/mlp.py:task", 1 * GiB, 1 << 18),
]


def train_steps(spec: str, meter: CudaMeter, micro_batch: int) -> tuple[int, float]:
    """STEPS optimizer updates of ACCUMULATION_STEPS micro-batches; returns (peak bytes, seconds)."""
    task = load_task(spec)
    started = time.perf_counter()
    with meter.measure():
        model = build_model(task, meter)
        optimizer = task.make_optimizer(model.parameters())
        scaler = torch.amp.GradScaler("cuda") if task.precision == "fp16" else None
        for _ in range(STEPS):
            for _ in range(ACCUMULATION_STEPS):
                batch = make_batch(task, micro_batch, meter.device)
                with Replicated(1).autocast(task.precision, meter.device):
                    loss = task.compute_loss(model, batch) / ACCUMULATION_STEPS
                (scaler.scale(loss) if scaler else loss).backward()
                del batch, loss
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del model, optimizer
    return meter.reading().peak_bytes, time.perf_counter() - started


def main() -> int:
    failures = []
    print(
        "| task | budget | m | trials | OOMs | peak in 50 steps | limit | m+1 fits? | NVML device used "
        "| meter figure |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec, budget, cap in CASES:
        profile = probe(load_task(spec), ProbeConfig(device="cuda:0", budget_bytes=budget, max_micro_batch=cap))
        m = profile.max_micro_batch
        limit = int(budget * (1 - profile.headroom))
        meter = CudaMeter(0, budget)
        try:
            try:
                peak, _ = train_steps(spec, meter, m)
                oom = False
            except torch.OutOfMemoryError:
                peak, oom = -1, True
            nvml = meter.nvml_device_used_bytes()
            step_past = m + profile.multiple_of
            past = run_trial(load_task(spec), meter, step_past, limit_bytes=limit) if m < cap else None
        finally:
            meter.close()
        past_fits = "cap" if past is None else ("yes" if past.fits else "no")
        print(
            f"| {profile.task} | {format_bytes(budget)} | {m} | {profile.trial_count} | {profile.oom_count} | "
            f"{'OOM' if oom else format_bytes(peak)} | {format_bytes(limit)} | {past_fits} | "
            f"{format_bytes(nvml)} | {format_bytes(profile.peak_at(m))} |"
        )
        if oom or peak > limit:
            failures.append(f"{profile.task}: 50 steps at m={m} peaked at {peak} > limit {limit} (oom={oom})")
        if past is not None and past.fits:
            failures.append(f"{profile.task}: m+{profile.multiple_of}={step_past} also fits")
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
