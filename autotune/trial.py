"""One trial: the steady state of an accumulating job at micro-batch m, measured on one device.

Fresh model and optimizer, 2 micro-batches forward+backward accumulating, optimizer step,
zero_grad(set_to_none=True), 2 more micro-batches, a second step. Each micro-batch is made just
before its forward and dropped after its backward. The peak over all of it is the figure.

An OOM is a result: everything the trial held is released before this function returns, and
the next measurement is as clean as a fresh process's. Any other error stops the probe.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from autotune.errors import TaskError, TrialError
from autotune.meters import FORWARD_BACKWARD, Meter
from autotune.oom import is_oom
from autotune.schemas import Trial
from autotune.task import ProbeTask

__all__ = ["MICRO_BATCHES_PER_STEP", "OPTIMIZER_STEPS", "measure_weights", "move_to_device", "run_trial"]

MICRO_BATCHES_PER_STEP = 2
OPTIMIZER_STEPS = 2

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a nested dict/tuple/list to device, keeping the structure."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(value, device) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_to_device(value, device) for value in batch)
    return batch


def _has_tensor(batch: Any) -> bool:
    if isinstance(batch, torch.Tensor):
        return True
    if isinstance(batch, Mapping):
        return any(_has_tensor(value) for value in batch.values())
    if isinstance(batch, (tuple, list)):
        return any(_has_tensor(value) for value in batch)
    return False


def make_batch(task: ProbeTask, micro_batch: int, device: torch.device) -> Any:
    batch = task.batch(micro_batch)
    if not _has_tensor(batch):
        raise TaskError(
            f"batch({micro_batch}) of task {task.name!r} returned {type(batch).__name__} with no tensors: "
            "return a tensor or a dict/tuple/list of tensors"
        )
    return move_to_device(batch, device)


def build_model(task: ProbeTask, meter: Meter) -> nn.Module:
    """A fresh model on the meter's device, in train mode, its weights counted by the meter."""
    with torch.device(meter.device):
        model = task.model()
    if not isinstance(model, nn.Module):
        raise TaskError(f"model() of task {task.name!r} returned {type(model).__name__}, not an nn.Module")
    model = model.to(meter.device).train()
    meter.adopt(model)
    return model


def _autocast(task: ProbeTask, device: torch.device) -> AbstractContextManager[Any]:
    dtype = _AUTOCAST_DTYPES.get(task.precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _cycle(task: ProbeTask, meter: Meter, micro_batch: int, process_group: Any) -> None:
    """The measured work. Everything it creates lives in this frame and dies with it."""
    device = meter.device
    model = build_model(task, meter)
    if process_group is not None:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids, process_group=process_group)
    optimizer = task.make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler(device.type) if task.precision == "fp16" else None
    for _ in range(OPTIMIZER_STEPS):
        for index in range(MICRO_BATCHES_PER_STEP):
            last = index == MICRO_BATCHES_PER_STEP - 1
            # Under DDP only the last micro-batch of a group all-reduces, as a correct job does.
            sync: AbstractContextManager[Any] = (
                model.no_sync() if process_group is not None and not last else nullcontext()  # type: ignore[operator]
            )
            with sync:
                batch = make_batch(task, micro_batch, device)
                with _autocast(task, device):
                    loss = task.compute_loss(model, batch) / MICRO_BATCHES_PER_STEP
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
                del batch, loss
        meter.checkpoint(FORWARD_BACKWARD)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        meter.checkpoint("step")


def run_trial(
    task: ProbeTask,
    meter: Meter,
    micro_batch: int,
    *,
    limit_bytes: int,
    process_group: Any = None,
) -> Trial:
    """Measure one trial at micro_batch.

    Args:
        task: the job setup.
        meter: the device and its budget; crossing the budget is an OOM.
        micro_batch: m.
        limit_bytes: the peak that still fits (budget x (1 - headroom)).
        process_group: a single-process group to wrap the model in DDP (world size > 1).

    Returns:
        A Trial; ``oom`` when the budget was crossed, ``fits`` when the peak is within limit_bytes.

    Raises:
        TaskError: the task misbehaves (no tensors in the batch, non-scalar loss).
        TrialError: any other non-OOM failure, with the original error in one line.
    """
    oom = False
    failure: str | None = None
    started = time.perf_counter()
    try:
        with meter.measure():
            _cycle(task, meter, micro_batch, process_group)
    except TaskError:
        meter.release()
        raise
    except Exception as exc:  # classified below; only its text survives the except block
        if is_oom(exc):
            oom = True
        else:
            first_line = (str(exc).strip().splitlines() or [""])[0]
            failure = f"trial at micro-batch {micro_batch} failed: {type(exc).__name__}: {first_line}"
            if micro_batch == 1:
                failure += " (a model that cannot train on one sample, BatchNorm1d say, needs --multiple-of 2)"
    # Out of the except block the traceback, and with it every frame of _cycle, is gone.
    seconds = time.perf_counter() - started
    reading = meter.reading()
    meter.release()
    if failure is not None:
        raise TrialError(failure)
    return Trial(
        micro_batch=micro_batch,
        peak_bytes=reading.peak_bytes,
        fits=(not oom) and reading.peak_bytes <= limit_bytes,
        oom=oom,
        seconds=round(seconds, 6),
        forward_backward_bytes=None if oom else reading.forward_backward_bytes,
        allocated_bytes=reading.allocated_bytes,
        outside_allocator_bytes=reading.outside_allocator_bytes,
    )


def measure_weights(task: ProbeTask, meter: Meter) -> int | None:
    """Bytes of weights + gradients + optimizer state alone (no activations), or None if even that
    cannot be measured on this device. Used to explain a budget where m=1 does not fit."""

    def static() -> None:
        model = build_model(task, meter)
        optimizer = task.make_optimizer(model.parameters())
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        optimizer.step()  # creates the lazily allocated optimizer state
        optimizer.zero_grad(set_to_none=True)

    measured = True
    try:
        with meter.unbounded(), meter.measure():
            static()
    except Exception as exc:
        if not is_oom(exc):
            raise
        measured = False
    reading = meter.reading()
    meter.release()
    return reading.peak_bytes if measured else None
