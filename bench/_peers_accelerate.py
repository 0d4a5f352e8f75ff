"""Accelerate's ``find_executable_batch_size`` around the training step of an autotune ProbeTask.

The decorated function is what Accelerate's documentation asks for: everything that depends on the
batch size is built inside it. It builds a fresh model and optimizer and runs autotune's trial cycle
written as a user's loop (2 micro-batches accumulated, step, ``zero_grad(set_to_none=True)``, 2 more,
step), each micro-batch made just before its forward and dropped after its backward, the model on the
meter's device (moved there as a user would, ``model.to(device)``). On an OOM
Accelerate multiplies the batch size by 0.9 and calls it again; the first size that runs is its answer.
"""

from __future__ import annotations

import time

import torch
from _peers_lightning import PeerRun, PeerTrial
from _peers_meter import CudaPeerMeter, PeerMeter
from accelerate.utils import find_executable_batch_size
from accelerate.utils.memory import should_reduce_batch_size

from autotune.measure.trial import MICRO_BATCHES_PER_STEP, OPTIMIZER_STEPS, move_to_device
from autotune.tasks.task import ProbeTask


def training_step(task: ProbeTask, micro_batch: int, device: torch.device) -> None:
    """Autotune's trial as a plain training loop: fresh model and optimizer, 2 x (2 accumulated, step)."""
    model = task.model().train()
    if device.type != "cpu":
        model = model.to(device)
    optimizer = task.make_optimizer(model.parameters())
    for _ in range(OPTIMIZER_STEPS):
        for _ in range(MICRO_BATCHES_PER_STEP):
            batch = move_to_device(task.batch(micro_batch), next(model.parameters()).device)
            loss = task.compute_loss(model, batch) / MICRO_BATCHES_PER_STEP
            loss.backward()
            del batch, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def run_accelerate(task: ProbeTask, meter: PeerMeter | CudaPeerMeter, *, starting_batch_size: int) -> PeerRun:
    """Run ``find_executable_batch_size(starting_batch_size=...)`` with every call under ``meter.enforcing()``."""
    if task.precision != "fp32":
        raise NotImplementedError("the Accelerate runner drives fp32 tasks only (the examples are fp32)")
    run = PeerRun(name="accelerate", micro_batch=None)

    @find_executable_batch_size(starting_batch_size=starting_batch_size)
    def attempt(batch_size: int) -> int:
        baseline = meter.live_bytes
        started = time.perf_counter()
        oom = False
        try:
            with meter.enforcing():
                training_step(task, batch_size, meter.device)
        except Exception as exc:
            oom = should_reduce_batch_size(exc)
            raise
        finally:
            run.trials.append(PeerTrial(batch_size, oom, round(time.perf_counter() - started, 4), baseline))
        return batch_size

    wall, cpu = time.perf_counter(), time.process_time()
    try:
        with meter.measure():
            run.micro_batch = attempt()
    except Exception as exc:  # a peer that crashes is a result to report, not a bench failure
        run.error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    finally:
        run.seconds = round(time.perf_counter() - wall, 3)
        run.cpu_seconds = round(time.process_time() - cpu, 3)
    return run
