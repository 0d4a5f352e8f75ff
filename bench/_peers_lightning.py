"""Lightning's BatchSizeFinder (``Tuner.scale_batch_size``) on an autotune ProbeTask, under the peer meter.

The LightningModule wraps the task's own model, batch(m), loss and optimizer. What one Lightning trial
runs is made to match autotune's trial, so that the two answer the same question:

- ``accumulate_grad_batches=2`` and ``steps_per_trial=2``: 2 micro-batches accumulated, a step, 2 more,
  a step (Lightning's ``max_steps`` counts optimizer steps);
- ``optimizer_step`` calls ``zero_grad(set_to_none=True)`` right after the step, as autotune's trial
  does; Lightning's own zero_grad comes later, before the next group's backward, and would keep the
  gradients alive through the next forward;
- the DataLoader whose ``batch_size`` Lightning scales yields the micro-batch size m (``collate_fn=len``)
  and ``training_step`` makes ``task.batch(m)`` just before its forward and drops it after its
  backward, as autotune's trial does; Lightning's fetcher prefetches one batch ahead, which would
  otherwise keep a second batch alive;
- ``margin=0``: the peer meter's budget already carries the headroom.

Differences that remain are Lightning's: the model and optimizer state live across trials (autotune
builds both afresh per trial; the peak, reached in the second group, holds the same tensors either way)
and the search policy itself.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch
from _peers_meter import CudaPeerMeter, PeerMeter
from pytorch_lightning.tuner import Tuner
from pytorch_lightning.tuner import batch_size_scaling as scaling
from pytorch_lightning.utilities.memory import is_oom_error
from torch.utils.data import DataLoader

from autotune.measure.trial import move_to_device
from autotune.tasks.task import ProbeTask

# Samples the DataLoader pretends to have: Lightning stops scaling at the dataset's length.
DATASET_LENGTH = 1 << 24
_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


@dataclass
class PeerTrial:
    """One trial a peer ran: m, whether it ended in an OOM, wall seconds, live bytes when it started."""

    micro_batch: int
    oom: bool
    seconds: float
    baseline_bytes: int


@dataclass
class PeerRun:
    """What a peer answered and what it cost."""

    name: str
    micro_batch: int | None
    trials: list[PeerTrial] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    error: str | None = None

    @property
    def oom_count(self) -> int:
        return sum(1 for t in self.trials if t.oom)


class TaskModule(pl.LightningModule):
    """The task's model, loss and optimizer as a LightningModule."""

    def __init__(self, task: ProbeTask) -> None:
        super().__init__()
        self.task = task
        self.model = task.model()
        self._live_batch: Any = None

    def training_step(self, micro_batch: int, batch_idx: int) -> torch.Tensor:
        self._live_batch = None  # a batch left by a trial that ended in an OOM
        batch = move_to_device(self.task.batch(micro_batch), self.device)
        # Held until after backward, as a loop holding the batch it got from a DataLoader does (and
        # as autotune's trial does): the targets would otherwise be freed early in backward.
        self._live_batch = batch
        return self.task.compute_loss(self.model, batch)

    def on_after_backward(self) -> None:
        self._live_batch = None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.task.make_optimizer(self.model.parameters())

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)
        # Free the gradients now, as autotune's trial does, not before the next group's backward.
        optimizer.zero_grad(set_to_none=True)


class SizesDataModule(pl.LightningDataModule):
    """A DataLoader whose batch_size Lightning scales; each batch is its own size m."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader[int]:
        return DataLoader(range(DATASET_LENGTH), batch_size=self.batch_size, collate_fn=len)  # type: ignore[arg-type]


def run_lightning(
    task: ProbeTask, meter: PeerMeter | CudaPeerMeter, *, mode: str, max_trials: int = 25, init_val: int = 2
) -> PeerRun:
    """Run ``Tuner(trainer).scale_batch_size(mode=mode)`` with every trial under ``meter.enforcing()``.

    Trials are counted by wrapping Lightning's ``_try_loop_run`` (one call per batch size tried),
    which is also where the budget is switched on. The Trainer runs on the meter's device (the CPU, or
    the one CUDA device of a CudaPeerMeter).
    """
    run = PeerRun(name=f"lightning-{mode}", micro_batch=None)
    datamodule = SizesDataModule(init_val)
    original = scaling._try_loop_run

    def counted(trainer: pl.Trainer, params: dict[str, Any]) -> None:
        m = int(datamodule.batch_size)
        baseline = meter.live_bytes
        started = time.perf_counter()
        oom = False
        try:
            with meter.enforcing():
                original(trainer, params)
        except RuntimeError as exc:
            oom = is_oom_error(exc)
            raise
        finally:
            run.trials.append(PeerTrial(m, oom, round(time.perf_counter() - started, 4), baseline))

    with tempfile.TemporaryDirectory(prefix="peers-lightning-") as root, warnings.catch_warnings():
        # Lightning advises on workers, loggers and the like; none of it concerns the search.
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator=meter.device.type,
            devices=1 if meter.device.type == "cpu" else [meter.device.index],
            precision=_PRECISION[task.precision],  # type: ignore[arg-type]
            accumulate_grad_batches=2,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=root,
        )
        scaling._try_loop_run = counted
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            with meter.measure():
                module = TaskModule(task)
                meter.adopt(module)
                run.micro_batch = Tuner(trainer).scale_batch_size(
                    module,
                    datamodule=datamodule,
                    mode=mode,
                    steps_per_trial=2,
                    init_val=init_val,
                    max_trials=max_trials,
                    margin=0.0,
                )
        except Exception as exc:  # a peer that crashes is a result to report, not a bench failure
            run.error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        finally:
            scaling._try_loop_run = original
            run.seconds = round(time.perf_counter() - wall, 3)
            run.cpu_seconds = round(time.process_time() - cpu, 3)
    return run
