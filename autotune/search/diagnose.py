"""A job that cannot fit even one micro-batch: what it needs, and what would fit it.

When m = multiple_of does not fit, the probe, ``autotune estimate`` and the client's local probe end
in one line (:class:`autotune.core.errors.CannotFitError`, exit status ``EXIT_NO_FIT`` in the CLI) that
says, from fake trials only (meters/fake.py: no device memory is spent):

- what micro-batch multiple_of needs, and of that what the job holds without activations (weights,
  gradients, optimizer state: the optimizer step's peak, its temporaries included);
- what would fit it, where the tool can tell: the smallest world size N (2, 4, 8, ... up to
  ``MAX_FSDP_WORLD_SIZE``) at which a fake ``--strategy fsdp --world-size N`` trial fits; ``--ac full``
  (activation checkpointing on every block) when a fake trial under it fits; and the budget at which
  the job as it is fits (its peak / (1 - headroom)).

Sharding divides the weights, gradients and optimizer state by N but not the activations, so N is
looked for from the smallest power of two where activations + static / N could fit, and none is
offered when the activations alone are over the limit. At most ``MAX_FSDP_TRIALS`` fake fsdp trials
run (a 100M-parameter GPT's fake trial takes a few seconds on a CPU).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from autotune.core import units
from autotune.core.errors import AutotuneError, CannotFitError
from autotune.core.mesh import Mesh
from autotune.core.schemas import MAX_BYTES, Trial
from autotune.core.units import format_bytes
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.runners import job_trials
from autotune.measure.strategies import Strategy
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.trial import frozen_heap
from autotune.search.presearch import fake_strategy
from autotune.tasks.task import ProbeTask

__all__ = [
    "MAX_FSDP_TRIALS",
    "MAX_FSDP_WORLD_SIZE",
    "NoFit",
    "cannot_fit",
    "diagnose_no_fit",
    "fake_trial",
    "job_strategy",
    "no_fit_error",
]

MAX_FSDP_WORLD_SIZE = 1024
MAX_FSDP_TRIALS = 3
# The policy that keeps the fewest activations (autotune/measure/policies.py, issue 19).
FULL_CHECKPOINTING = "full"


@dataclass(frozen=True)
class NoFit:
    """What a job that cannot fit micro-batch ``micro_batch`` needs, and what would fit it.

    Byte figures come from fake trials, plus ``unseen_bytes`` (what the device holds that fake
    tensors never show, the CUDA context) where a probe measured it.
    """

    micro_batch: int
    budget_bytes: int
    limit_bytes: int
    headroom: float
    # Micro-batch micro_batch's peak with no budget (None: the fake trial could not run).
    peak_bytes: int | None
    # Weights, gradients and optimizer state (the optimizer step's peak): what no micro-batch avoids.
    static_bytes: int | None
    strategy: str = "ddp"
    world_size: int = 1
    # The smallest fsdp world size found to fit, with its peak; None when none up to the cap did.
    fsdp_world_size: int | None = None
    fsdp_peak_bytes: int | None = None
    # Why no fsdp world size is offered (activations alone over the limit, a model with no block).
    fsdp_note: str = ""
    # The peak under --ac full when it fits; None when it does not, or the policy cannot apply.
    ac_full_peak_bytes: int | None = None
    # The job's mesh as Mesh.describe says it ('' for none): the figures are its most loaded rank's (a pipeline's
    # most loaded stage), DDP's buckets counted where the job holds them.
    mesh: str = ""
    # What the trial that did not fit measured on the device (None: not measured, an estimate's). Where it is over
    # the limit and the fake trial is not (a compiled step, whose buffers the eager fake trial does not hold), the
    # line says both and advises from the measurement, rather than "does not fit ... it needs" less than the limit.
    measured_bytes: int | None = None

    @property
    def budget_needed_bytes(self) -> int | None:
        """The smallest budget at which the job as it is fits: peak / (1 - headroom), rounded up to
        a MiB (a KiB under 1 GiB)."""
        peak = max(filter(None, (self.peak_bytes, self.measured_bytes)), default=None)
        if peak is None:
            return None
        needed = math.ceil(peak / (1.0 - self.headroom))
        unit = 2**20 if needed >= 2**30 else 2**10
        return -(-needed // unit) * unit

    def line(self) -> str:
        """The one line a user reads (every figure in bytes, with binary units beside it)."""
        where = f"world size {self.world_size}, " if self.strategy == "fsdp" else ""
        if self.mesh:
            where = f"{self.mesh} over world size {self.world_size} (the most loaded rank), "
        text = (
            f"micro-batch {self.micro_batch} does not fit: budget {_b(self.budget_bytes)}, "
            f"{where}limit {_b(self.limit_bytes)} with headroom {self.headroom:g}"
        )
        needs = []
        measured_over = self.measured_bytes is not None and self.measured_bytes > self.limit_bytes
        if measured_over and (self.peak_bytes is None or self.peak_bytes <= self.limit_bytes):
            assert self.measured_bytes is not None
            text += f"; it peaked at {_b(self.measured_bytes)} when measured"
            if self.peak_bytes is not None:
                text += (
                    f", where a fake trial of the eager step needs {_b(self.peak_bytes)}: the difference is what "
                    "the measured step holds beyond the eager one (a compiled step's buffers)"
                )
        elif self.peak_bytes is not None:
            needs.append(f"it needs {_b(self.peak_bytes)} by a fake trial")
        if self.static_bytes is not None:
            needs.append(
                f"weights, gradients and optimizer state alone take {_b(self.static_bytes)} without activations"
            )
        if needs:
            text += "; " + ", of which ".join(needs) if len(needs) == 2 else "; " + needs[0]
        options = []
        if self.fsdp_world_size is not None and self.fsdp_peak_bytes is not None:
            options.append(
                f"--strategy fsdp --world-size {self.fsdp_world_size} (estimated peak {_b(self.fsdp_peak_bytes)})"
            )
        if self.ac_full_peak_bytes is not None:
            options.append(f"--ac {FULL_CHECKPOINTING} (estimated peak {_b(self.ac_full_peak_bytes)})")
        needed = self.budget_needed_bytes
        if needed is not None:
            options.append(f"a budget of {_b(needed)}")
        if options:
            text += "; would fit: " + ", or ".join(options)
        if self.fsdp_note:
            text += f"; {self.fsdp_note}"
        return text


def _b(value: int) -> str:
    return f"{value} bytes ({format_bytes(value)})"


@frozen_heap()
def fake_trial(
    task: ProbeTask,
    micro_batch: int,
    *,
    device_type: str,
    strategy: Strategy,
    limit_bytes: int,
    mesh: Mesh | None = None,
) -> Trial:
    """One fake trial with no budget (it cannot run out), inside the strategy's process group, on a fake meter and a
    model of its own: the job's trials whatever the job (autotune/measure/runners.py), a pipeline's figure its most
    loaded stage's (``mesh`` lays it out; every stage's fake trial replays its schedule).

    Raises:
        AutotuneError: the trial cannot run fake (an op that needs data, a model FSDP cannot shard)."""
    meter = FakeMeter(MAX_BYTES, device_type)
    try:
        with strategy.process_group(meter.device):
            trials = job_trials(task, meter, strategy, mesh or Mesh(), limit_bytes=limit_bytes, reuse_model=False)
            try:
                return trials(micro_batch)
            finally:
                trials.close()
    finally:
        meter.close()


def _fake_trial(
    task: ProbeTask,
    micro_batch: int,
    *,
    device_type: str,
    strategy: Strategy,
    limit_bytes: int,
    mesh: Mesh | None = None,
) -> Trial | None:
    """:func:`fake_trial`, or None where it cannot run fake."""
    try:
        return fake_trial(
            task, micro_batch, device_type=device_type, strategy=strategy, limit_bytes=limit_bytes, mesh=mesh
        )
    except AutotuneError:
        return None


def job_strategy(strategy: str, world_size: int, mesh: Mesh) -> Strategy:
    """The strategy a fake trial of the job as it is runs under: its mesh's (tp, cp, a pipeline's stages), and under ddp
    with more than one replica DDP's buckets held as the fake trials of the search hold them
    (``presearch.fake_strategy``)."""
    return fake_strategy(make_strategy(strategy, world_size, mesh))


def diagnose_no_fit(
    task: ProbeTask,
    *,
    budget_bytes: int,
    headroom: float,
    micro_batch: int,
    device_type: str,
    strategy: str = "ddp",
    world_size: int = 1,
    unseen_bytes: int = 0,
    mesh: Mesh | None = None,
) -> NoFit:
    """What micro-batch ``micro_batch`` of ``task`` needs and what would fit it, by fake trials.

    Args:
        budget_bytes, headroom: the budget that did not fit; the limit is budget x (1 - headroom).
        micro_batch: the smallest micro-batch allowed (the probe's multiple_of).
        device_type: "cpu" or "cuda" (the fake tensors' device; "cuda" needs a torch with CUDA).
        strategy, world_size, mesh: how the job holds its model today: the figures are its most loaded rank's
            (under a pipeline, its most loaded stage's), DDP's buckets counted where it holds them, so the budget
            advised fits the job as it runs; the fsdp and checkpointing levers are offered without a mesh only.
        unseen_bytes: what the device holds that fake trials do not see (added to every figure).

    Returns:
        A :class:`NoFit`; figures are None where a fake trial could not run.
    """
    limit_bytes = units.limit_bytes(budget_bytes, headroom)
    fake_limit = max(1, limit_bytes - unseen_bytes)
    if device_type.startswith("cuda") and not torch.cuda.is_available():
        device_type = "cpu"  # a CPU build cannot run fake CUDA tensors through autograd (estimate.py)
    mesh = mesh or Mesh()

    def seen(value: int | None) -> int | None:
        return None if value is None else value + unseen_bytes

    if not mesh.trivial:
        trial = _fake_trial(
            task,
            micro_batch,
            device_type=device_type,
            strategy=job_strategy(strategy, world_size, mesh),
            limit_bytes=fake_limit,
            mesh=mesh,
        )
        peak = trial.peak_bytes if trial is not None else None
        static = trial.step_bytes if trial is not None else None
        return NoFit(
            micro_batch=micro_batch,
            budget_bytes=budget_bytes,
            limit_bytes=limit_bytes,
            headroom=headroom,
            peak_bytes=seen(peak),
            static_bytes=seen(static),
            strategy=strategy,
            world_size=world_size,
            mesh=mesh.describe(),
        )
    # DDP's constructor broadcasts over gloo/nccl, which cannot carry fake tensors: its buckets are held without it.
    current = job_strategy(strategy, world_size, mesh)
    trial = _fake_trial(task, micro_batch, device_type=device_type, strategy=current, limit_bytes=fake_limit)

    peak = seen(trial.peak_bytes) if trial is not None else None
    static = seen(trial.step_bytes) if trial is not None else None
    fsdp_n, fsdp_peak, fsdp_note = _fsdp_world_size(
        task, micro_batch, device_type, fake_limit, trial, strategy=strategy, world_size=world_size
    )
    return NoFit(
        micro_batch=micro_batch,
        budget_bytes=budget_bytes,
        limit_bytes=limit_bytes,
        headroom=headroom,
        peak_bytes=peak,
        static_bytes=static,
        strategy=strategy,
        world_size=world_size,
        fsdp_world_size=fsdp_n,
        fsdp_peak_bytes=seen(fsdp_peak),
        fsdp_note=fsdp_note,
        ac_full_peak_bytes=seen(_ac_full_peak(task, micro_batch, device_type, fake_limit, current)),
    )


def _fsdp_world_size(
    task: ProbeTask,
    micro_batch: int,
    device_type: str,
    limit_bytes: int,
    trial: Trial | None,
    *,
    strategy: str,
    world_size: int,
) -> tuple[int | None, int | None, str]:
    """(N, its peak, note): the smallest power-of-two fsdp world size whose fake trial fits."""
    start = 2 * world_size if strategy == "fsdp" else 2
    if trial is not None and trial.step_bytes is not None:
        static = trial.step_bytes
        activations = max(0, trial.peak_bytes - static)
        if activations >= limit_bytes:
            return None, None, f"no fsdp world size fits: the activations alone take about {_b(activations)}"
        # static / N + activations <= limit, for the smallest power of two N from `start`.
        while start < MAX_FSDP_WORLD_SIZE and static / start + activations > limit_bytes:
            start *= 2
    size, tried = start, 0
    while size <= MAX_FSDP_WORLD_SIZE and tried < MAX_FSDP_TRIALS:
        sharded = _fake_trial(
            task, micro_batch, device_type=device_type, strategy=make_strategy("fsdp", size), limit_bytes=limit_bytes
        )
        tried += 1
        if sharded is None:
            return None, None, "fsdp could not be estimated for this model"
        if sharded.fits:
            return size, sharded.peak_bytes, ""
        size *= 2
    return None, None, f"no fsdp world size from {start} to {min(size, MAX_FSDP_WORLD_SIZE)} fits by estimate"


def _ac_full_peak(
    task: ProbeTask, micro_batch: int, device_type: str, limit_bytes: int, strategy: Strategy
) -> int | None:
    """The fake peak under full activation checkpointing when it fits; None where it does not, where
    the task already checkpoints every block, or where this build has no such policy."""
    if getattr(task, "activation_checkpointing", FULL_CHECKPOINTING) == FULL_CHECKPOINTING:
        return None
    try:
        checkpointed = dataclasses.replace(task, activation_checkpointing=FULL_CHECKPOINTING)
    except (TypeError, ValueError, AutotuneError):
        return None
    trial = _fake_trial(checkpointed, micro_batch, device_type=device_type, strategy=strategy, limit_bytes=limit_bytes)
    return trial.peak_bytes if trial is not None and trial.fits else None


def cannot_fit(no_fit: NoFit) -> CannotFitError:
    """The error the probe, estimate and the client's local probe raise (its text is ``no_fit.line()``)."""
    return CannotFitError(no_fit.line(), no_fit)


def no_fit_error(
    task: ProbeTask,
    config: Any,
    *,
    budget_bytes: int,
    device_type: str,
    unseen_bytes: int = 0,
    measured_bytes: int | None = None,
) -> CannotFitError:
    """The error of a probe or an estimate (``config``: its ProbeConfig or EstimateConfig) where not
    even multiple_of fits, diagnosed by fake trials; call it outside the run's process group. ``measured_bytes``:
    what a probe's real trial at multiple_of peaked at."""
    diagnosis = diagnose_no_fit(
        task,
        budget_bytes=budget_bytes,
        headroom=config.headroom,
        micro_batch=config.multiple_of,
        device_type=device_type,
        strategy=config.strategy,
        world_size=config.world_size,
        unseen_bytes=unseen_bytes,
        mesh=config.mesh,
    )
    if measured_bytes is not None:
        diagnosis = dataclasses.replace(diagnosis, measured_bytes=measured_bytes)
    return cannot_fit(diagnosis)
