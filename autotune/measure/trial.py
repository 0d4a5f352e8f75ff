"""One trial: the steady state of an accumulating job at micro-batch m, measured on one device.

The model (built once per probe, see TrialRunner) and a fresh optimizer, 2 micro-batches
forward+backward accumulating, optimizer step, zero_grad (set_to_none=True, or False for a task whose
``zero_grad`` is "keep": the gradients then stay allocated into the next forward), 2 more micro-batches,
a second step. Each micro-batch is made just before its forward and dropped after its backward.
The peak over all of it is the figure.

A job that does not accumulate (A = 1) runs the same cycle with one micro-batch per step (``accumulation=1``):
its second forward holds the optimizer state but no gradients (they were set to None after the first step),
so its peak is lower by up to one gradient set. The probe measures that case as trials of its own where the
target can be met without accumulating (autotune/orchestrate/probe.py).

An OOM is a result: everything the trial held is released before this function returns, and
the next measurement is as clean as a fresh process's. Any other error stops the probe.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune.core.consistency import exceeds_host_budget
from autotune.core.errors import TaskError, TrialError
from autotune.core.heap import FrozenHeap
from autotune.core.schemas import ATTENTION_NOTE, Trial
from autotune.measure.breakdown import with_host_parts
from autotune.measure.meters import FORWARD_BACKWARD, STEP, MemoryReading, Meter
from autotune.measure.meters.host import HOST
from autotune.measure.offload import apply_offload, offload_params_to_host, step_on_host
from autotune.measure.oom import is_oom, release_failed_backward
from autotune.measure.policies import apply_policy
from autotune.measure.strategies import Replicated, Strategy
from autotune.tasks.batches import has_tensor, map_tensors
from autotune.tasks.optimizers import eager_step
from autotune.tasks.task import ProbeTask, weights_dtype_refusal

__all__ = [
    "MICRO_BATCHES_PER_STEP",
    "OPTIMIZER_STEPS",
    "Span",
    "TrialRunner",
    "breakdown_recorder",
    "broken_down",
    "build_model",
    "build_on_meta",
    "frozen_heap",
    "materialize",
    "measure_weights",
    "measured_span",
    "move_to_device",
    "recorder_of",
    "run_trial",
    "trial_of",
]

MICRO_BATCHES_PER_STEP = 2
OPTIMIZER_STEPS = 2


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a nested batch to device, keeping the structure and the container types
    (the walker of :mod:`autotune.tasks.batches`)."""
    return map_tensors(lambda tensor: tensor.to(device, non_blocking=True), batch)


def make_batch(task: ProbeTask, micro_batch: int, device: torch.device) -> Any:
    batch = task.batch(micro_batch)
    if not has_tensor(batch):
        raise TaskError(
            f"batch({micro_batch}) of task {task.name!r} returned {type(batch).__name__} with no tensors: "
            "return a tensor or a dict/tuple/list of tensors"
        )
    moved = move_to_device(batch, device)
    if task.compile is not None:  # one compilation for every m >= 2 (autotune/measure/meters/compiled.py)
        from autotune.measure.meters.compiled import mark_dynamic_batch

        mark_dynamic_batch(moved)
    return moved


def _failing_module(exc: BaseException) -> str | None:
    """The class of the innermost nn.Module whose code raised exc (for a one-line message)."""
    name = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            name = type(owner).__name__
        tb = tb.tb_next
    return name


def _initialise(model: nn.Module) -> None:
    """Values for storage that to_empty left uninitialised: a small normal for parameters, zeros for
    buffers, then each module's own reset_parameters. Garbage could hold NaN or inf, and a GradScaler
    that sees them skips the optimizer step, whose state then never exists: the peak would be low."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.normal_(0.0, 0.02)
            else:
                param.zero_()
        for buffer in model.buffers():
            buffer.zero_()
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                try:
                    reset()
                except TypeError:  # a reset_parameters of the model's own that wants arguments
                    continue


def materialize(model: nn.Module, device: torch.device, keep: Collection[str] | None = None) -> nn.Module:
    """Give every parameter and buffer of a meta model uninitialised storage on ``device``, in place.

    What was one tensor on ``meta`` stays one tensor on the device: a tied embedding and LM head
    (GPT-2, Qwen2, Gemma, Llama 3.2) keep sharing one Parameter. ``nn.Module.to_empty`` makes a new
    Parameter per module that holds it, which unties them and counts their weights, gradients and
    optimizer state twice. ``keep``: the qualified names of the only parameters to give storage (a pipeline
    stage's: autotune/measure/pipeline/cutting.py), the others left on ``meta``; every buffer gets storage.
    """
    made: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module_name, module in model.named_modules(remove_duplicate=False):
            for name, param in module._parameters.items():
                if param is None:
                    continue
                full = f"{module_name}.{name}" if module_name else name
                if keep is not None and full not in keep and id(param) not in made:
                    continue
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(
                        torch.empty_like(param, device=device), requires_grad=param.requires_grad
                    )
                module._parameters[name] = made[id(param)]  # type: ignore[assignment]
            for name, buffer in module._buffers.items():
                if buffer is None:
                    continue
                if id(buffer) not in made:
                    made[id(buffer)] = torch.empty_like(buffer, device=device)
                module._buffers[name] = made[id(buffer)]
    return model


def build_on_meta(task: ProbeTask, warnings: list[str] | None = None) -> nn.Module | None:
    """The task's model on the ``meta`` device (shapes, no memory), or None with a warning naming the
    module that failed when the factory cannot run there. Call it outside any meter's span: under
    the fake meter's mode, meta tensors would come out fake."""
    try:
        with torch.device("meta"):
            model = task.model()
    except Exception as exc:
        if warnings is not None:
            where = _failing_module(exc)
            first_line = (str(exc).strip().splitlines() or [""])[0]
            warnings.append(
                f"model() of task {task.name!r} could not be built on the meta device"
                + (f" (in {where})" if where else "")
                + f": {type(exc).__name__}: {first_line}; built on the probe's device instead"
            )
        return None
    _require_module(task, model)
    return model


def build_model(task: ProbeTask, meter: Meter, meta_model: nn.Module | None = None) -> nn.Module:
    """The task's model on the meter's device, in train mode, its weights counted by the meter, its
    blocks checkpointed as the task's ``activation_checkpointing`` says.

    meta_model (from :func:`build_on_meta`) is materialized on the meter's device by
    :func:`materialize` and the modules' own ``reset_parameters``, so that a large model is never first built on the
    CPU; without one the factory is called on the device.

    Raises:
        TaskError: the device cannot hold the task's ``weights_dtype`` (bf16 on a card before Ampere).
    """
    refusal = weights_dtype_refusal(task.weights_dtype, meter.device)
    if refusal is not None:
        raise TaskError(refusal)
    with meter.hold():
        if meta_model is None:
            with torch.device(meter.device):
                model = task.model()
            _require_module(task, model)
            # Only what the factory put elsewhere moves (a fake model is on the device already, and
            # _apply cannot swap fake parameters for themselves).
            if any(t.device != meter.device for t in (*model.parameters(), *model.buffers())):
                model = model.to(meter.device)
        else:
            model = materialize(meta_model, meter.device)
            _initialise(model)
        model.train()
        meter.adopt(model)
    # The task's memory policy, before any strategy wraps the blocks (FSDP2 shards checkpointed ones).
    apply_policy(model, task.activation_checkpointing, task.shard_classes, task_name=task.name)
    # Offload of the blocks' saved activations, around the policy's wrapper (autotune/measure/offload.py).
    apply_offload(model, task.offload, task.shard_classes, task_name=task.name)
    return model


def _require_module(task: ProbeTask, model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TaskError(f"model() of task {task.name!r} returned {type(model).__name__}, not an nn.Module")


class _NoRecorder:
    """What _cycle tells a recorder, heard by nobody (a trial without a breakdown)."""

    def phase(self, name: str) -> None:
        pass

    def classify_model(self, model: nn.Module) -> None:
        pass

    def classify_gradients(self, model: nn.Module) -> None:
        pass

    def classify_optimizer(self, optimizer: Any) -> None:
        pass

    def classify(self, tensors: Any, part: str) -> None:
        pass


_NO_RECORDER = _NoRecorder()


def recorder_of(meter: Meter) -> Any:
    """The breakdown's recorder (autotune/measure/breakdown.py) a meter carries while its trial is recorded: told
    each phase and what the model's, the gradients' and the optimizer's storages are; else one that hears nothing."""
    return getattr(meter, "recorder", None) or _NO_RECORDER


def _cycle(
    task: ProbeTask,
    meter: Meter,
    micro_batch: int,
    strategy: Strategy,
    model: nn.Module,
    accumulation: int = MICRO_BATCHES_PER_STEP,
) -> None:
    """The measured work: OPTIMIZER_STEPS steps of ``accumulation`` micro-batches each. Everything it creates
    (optimizer and its state, batches, activations) lives in this frame and dies with it; the model's
    gradients are dropped by the caller."""
    device = meter.device
    recorder = recorder_of(meter)
    recorder.classify_model(model)
    recorder.phase("step")  # the optimizer's construction
    optimizer = task.make_optimizer(model)
    scaler = torch.amp.GradScaler(device.type) if task.precision == "fp16" else None
    for _ in range(OPTIMIZER_STEPS):
        for index in range(accumulation):
            with strategy.sync(model, last=index == accumulation - 1):
                recorder.phase("inputs")
                batch = make_batch(task, micro_batch, device)
                recorder.phase("forward")
                with strategy.loss_context():
                    with strategy.autocast(task.precision, device):
                        loss = task.compute_loss(model, batch) / accumulation
                    recorder.phase("backward")
                    if scaler is not None:
                        scaler.scale(loss).backward()
                    else:
                        loss.backward()
                del batch, loss
            recorder.classify_gradients(model)
        meter.checkpoint(FORWARD_BACKWARD)
        recorder.phase("step")
        # Under --offload params the step runs on the CPU: what it makes is host memory.
        with step_on_host(task.offload, optimizer), _fake_step(task, meter):
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            recorder.classify_optimizer(optimizer)
            optimizer.zero_grad(set_to_none=task.zero_grad_to_none)
        meter.checkpoint(STEP)


def _fresh_cycle(
    task: ProbeTask,
    meter: Meter,
    micro_batch: int,
    strategy: Strategy,
    meta_model: nn.Module | None,
    accumulation: int = MICRO_BATCHES_PER_STEP,
) -> None:
    model = strategy.wrap(build_model(task, meter, meta_model), task, meter.device)
    offload_params_to_host(model, task.offload, meter)
    _cycle(task, meter, micro_batch, strategy, model, accumulation)


# A foreach (or fused) optimizer step over a tensor-parallel model: the parameters outside the tp plan (the norms)
# stay plain tensors beside the DTensors, and DTensor refuses the mixed lists, on a card (where AdamW defaults to
# foreach) as in the real job. Said as what to change, not as the op's error.
_MIXED_DTENSOR = "got mixed torch.Tensor and DTensor"
MIXED_DTENSOR_STEP = (
    "the optimizer's foreach step got DTensors beside plain tensors (the parameters outside the tp plan, the norms, "
    "stay plain), which DTensor refuses as the real job's step would: give the optimizer foreach=False "
    "(hf: tasks: ?optimizer=AdamW:foreach=false)"
)


def run_trial(
    task: ProbeTask,
    meter: Meter,
    micro_batch: int,
    *,
    limit_bytes: int,
    strategy: Strategy | None = None,
    model: nn.Module | None = None,
    accumulation: int = MICRO_BATCHES_PER_STEP,
    host_limit_bytes: int | None = None,
) -> Trial:
    """Measure one trial at micro_batch.

    Args:
        task: the job setup.
        meter: the device and its budget; crossing the budget is an OOM.
        micro_batch: m.
        limit_bytes: the peak that still fits (budget x (1 - headroom)).
        strategy: how the job holds the model (ddp by default, at world size 1); its process group
            must be entered.
        model: a model built by ``build_model`` and wrapped by the strategy, reused across trials
            (see :class:`TrialRunner`); None builds a fresh one inside the measured span.
        accumulation: micro-batches per optimizer step (2: an accumulating job; 1: a job that does not
            accumulate, whose forwards never hold a gradient set).
        host_limit_bytes: under an offload, the host bytes that still fit (--host-budget); None: no limit.

    Returns:
        A Trial; ``oom`` when the budget was crossed, ``fits`` when the peak is within limit_bytes.

    Raises:
        TaskError: the task misbehaves (no tensors in the batch, non-scalar loss).
        TrialError: any other non-OOM failure, with the original error in one line.
    """
    strategy = strategy or Replicated(1)
    # A fresh model's meta copy, handed to the work, whose frame it dies with.
    meta_models = [build_on_meta(task)] if model is None else []
    started = time.perf_counter()

    def steps() -> None:
        if model is None:
            _fresh_cycle(task, meter, micro_batch, strategy, meta_models.pop(), accumulation)
        else:
            _cycle(task, meter, micro_batch, strategy, model, accumulation)

    span = measured_span(task, meter, micro_batch, steps)
    if model is not None:
        model.zero_grad(set_to_none=True)
    meter.release()
    return trial_of(
        micro_batch,
        span,
        limit_bytes=limit_bytes,
        host_limit_bytes=host_limit_bytes,
        seconds=time.perf_counter() - started,
    )


@dataclass(frozen=True)
class Span:
    """What one measured span of a trial read (a whole model's steps, a pipeline stage's): the meter's reading,
    whether it ran out of memory, and the host's peak under an offload (None without one)."""

    reading: MemoryReading
    oom: bool
    host_peak_bytes: int | None


def measured_span(task: ProbeTask, meter: Meter, micro_batch: int, work: Callable[[], None], where: str = "") -> Span:
    """The one envelope of a trial's measured work, whatever the work: the host's peak restarted with the device's,
    ``work`` run inside ``meter.measure()``, an error classified (an OOM is a result; a task's own error is raised as
    it is; any other one is a TrialError in one line), a failed backward's graph let go, the reading and the host's
    peak taken. The caller releases the meter once it has dropped what it holds of the work.

    ``where``: what the line names beside the size (a pipeline's stage)."""
    oom = False
    failure: str | None = None
    try:
        with meter.measure():
            HOST.take_peak()  # the host's peak restarts with the device's
            work()
    except TaskError:
        meter.release()
        raise
    except Exception as exc:  # classified below; only its text survives the except block
        release_failed_backward()  # a graph whose backward raised is autograd's until the next backward
        if is_oom(exc):
            oom = True
        else:
            failure = _failure_line(exc, micro_batch, where)
    # Out of the except block the traceback, and with it every frame of the work, is gone.
    reading = meter.reading()
    host_peak = HOST.take_peak() if task.offload != "none" else None
    if failure is not None:
        meter.release()
        raise TrialError(failure)
    return Span(reading, oom, host_peak)


def _failure_line(exc: BaseException, micro_batch: int, where: str) -> str:
    """A trial's failure that is not an OOM, in one line: the size (and where), the error's type and first line."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    at = f"trial at micro-batch {micro_batch}{where} failed"
    if _MIXED_DTENSOR in first_line:
        return f"{at}: {MIXED_DTENSOR_STEP}"
    failure = f"{at}: {type(exc).__name__}: {first_line}"
    if micro_batch == 1:
        failure += " (a model that cannot train on one sample, BatchNorm1d say, needs --multiple-of 2)"
    return failure


def trial_of(
    micro_batch: int,
    span: Span,
    *,
    limit_bytes: int,
    host_limit_bytes: int | None,
    seconds: float,
    fake: bool = False,
) -> Trial:
    """The Trial of a size from the span that decides it (a pipeline's most loaded stage's): it fits where it did not
    run out of memory, its peak is within limit_bytes and its host bytes within host_limit_bytes (--host-budget)."""
    reading, oom = span.reading, span.oom
    over_host = exceeds_host_budget(span.host_peak_bytes, host_limit_bytes)
    return Trial(
        micro_batch=micro_batch,
        peak_bytes=reading.peak_bytes,
        fits=(not oom) and reading.peak_bytes <= limit_bytes and not over_host,
        host_peak_bytes=span.host_peak_bytes,
        oom=oom,
        seconds=round(seconds, 6),
        forward_backward_bytes=None if oom else reading.forward_backward_bytes,
        step_bytes=None if oom else reading.step_bytes,
        allocated_bytes=reading.allocated_bytes,
        outside_allocator_bytes=reading.outside_allocator_bytes,
        fake=fake,
    )


# What a trial imports on first use: the optimizers' compile guards pull in torch._dynamo (and
# sympy with it), the strategies torch.distributed's DDP, FSDP2 and DTensor. Imported before the
# heap is frozen, their ~120,000 objects are frozen with it; imported inside the first trial, every
# later gc.collect() walks them (0.05-0.15 s a collection, two per trial: more than a small model's
# trial itself).
_TRIAL_IMPORTS = (
    "torch._dynamo",
    "torch._subclasses.fake_tensor",
    "torch.nn.parallel",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
)


def _import_trial_modules() -> None:
    for name in _TRIAL_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # a torch built without distributed: the trial will not import it either
            continue


def frozen_heap() -> FrozenHeap:
    """Objects alive now (modules, the task, torch's own) are never garbage of a trial: freezing them
    makes the collection after every trial walk only what the trial made (autotune/core/heap.py). The
    modules a trial imports on first use are imported first, so that they are frozen too. Spans nest; a
    process that froze its own heap (some servers do) is left as it was."""
    return FrozenHeap(before=_import_trial_modules)


def _fake_step(task: ProbeTask, meter: Meter) -> contextlib.AbstractContextManager[None]:
    """A compiled optimizer step (torchao's) run eagerly where the trial is fake: dynamo does not trace fake
    tensors (autotune/tasks/optimizers.py, eager_step)."""
    from autotune.measure.meters.fake import FakeMeter

    return eager_step(task.optimizer) if isinstance(meter, FakeMeter) else contextlib.nullcontext()


def _fake_and_sharded(meter: Meter, strategy: Strategy) -> bool:
    from autotune.measure.meters.fake import FakeMeter

    return isinstance(meter, FakeMeter) and not strategy.describes_replicas


# How long a settling trial waits for gloo's worker thread to let go of DDP's bucket-rebuild broadcast
# (TrialRunner._settle): microseconds once the thread is scheduled; past this the trials go on regardless.
_SETTLE_TIMEOUT_S = 10.0


class TrialRunner:
    """Trials of one task on one meter, with the model built once and reused.

    Between trials the gradients are set to None and the optimizer, its state, the batches and the
    activations die with the trial, so every trial starts from the state a fresh model would: the
    weights (and, under a wrapper, what the wrapper keeps: DDP's buckets, FSDP2's sharded
    parameters) and nothing else. A test shows the peaks equal a fresh model's byte for byte on the
    CPU meter. What a trial changes in place and that takes no memory (BatchNorm running statistics,
    the weights' values after two optimizer steps) is not restored: it cannot change a peak. After an
    OOM the wrapper may be stopped mid-step (FSDP2's units unsharded, DDP waiting for a reduction),
    so the next trial gets a newly built model.

    Use inside ``strategy.process_group(meter.device)``; ``close()`` drops the model.
    """

    def __init__(
        self,
        task: ProbeTask,
        meter: Meter,
        *,
        limit_bytes: int,
        strategy: Strategy | None = None,
        reuse_model: bool = True,
        accumulation: int = MICRO_BATCHES_PER_STEP,
        host_limit_bytes: int | None = None,
    ) -> None:
        self.task, self.meter, self.limit_bytes = task, meter, limit_bytes
        self.host_limit_bytes = host_limit_bytes  # --host-budget under an offload (run_trial)
        self.strategy = strategy or Replicated(1)
        # A compiled model is compiled once per probe and reused (autotune/measure/meters/compiled.py).
        self.reuse_model = reuse_model or task.compile is not None
        # Seconds the compilation took (its warm-up), apart from the trials'; None for an eager task.
        self.compile_seconds: float | None = None
        # Micro-batches per step of every trial (1: the job that does not accumulate, see run_trial).
        self.accumulation = accumulation
        self.warnings: list[str] = []
        self._model: nn.Module | None = None
        # With a dict here, each trial on a CPU or fake meter is recorded and its peak broken down
        # (autotune/measure/breakdown.py), kept by micro-batch (the latest trial of each size).
        self.breakdowns: dict[int, Any] | None = None

    def _ensure_model(self) -> nn.Module | None:
        if not self.reuse_model:
            return None
        if self._model is None:
            # A sharded job (fsdp, tp) never holds its whole model on one device: a fake model is built whole and
            # then sharded, so its build runs past the budget (Mixtral 8x7B's 93 GB on an 80 GB card under fsdp 8);
            # what the trials start from is the shards. A real device cannot do that and keeps the budget.
            whole = self.meter.unbounded() if _fake_and_sharded(self.meter, self.strategy) else contextlib.nullcontext()
            with whole:
                model = build_model(self.task, self.meter, build_on_meta(self.task, self.warnings))
                with self.meter.hold():
                    self._model = self.strategy.wrap(model, self.task, self.meter.device)
                    offload_params_to_host(self._model, self.task.offload, self.meter)
                del model
            self._settle(self._model)
            if self.task.compile is not None:
                from autotune.measure.meters.compiled import compile_and_warm, compiles_on

                if compiles_on(self.meter):
                    self._model, self.compile_seconds = compile_and_warm(
                        self.task,
                        self.meter,
                        self._model,
                        self.strategy,
                        make_batch,
                        getattr(self, "_first_micro_batch", None),
                    )
        return self._model

    def _settle(self, model: nn.Module) -> None:
        """DDP over the probe's one-process gloo group, settled before its first measured trial: its reducer rebuilds
        its buckets at the second forward after construction, broadcasting their indices (int32s, 72 B for 17
        parameters) over gloo, whose worker thread holds the broadcast until after it has signalled completion. Under
        load it could free them after the trial's peak: one probe in about 2,700 read 72 B high, only in the first
        trial after a build. So one unmeasured trial at the first size asked for (one the task can train on: m = 1
        is not, for a BatchNorm1d model) makes the rebuild here, and the next trial starts once the live bytes are
        back where they were (gloo has let go): every measured trial is a rebuilt DDP's, as all but the first already
        were (a job's steady state). The CPU's gloo only (a card's NCCL has no such thread); a compiled model's
        warm-up already ran its first steps. An error here is the one the first trial would raise."""
        from autotune.measure.meters.cpu import CpuMeter

        meter = self.meter
        if not (getattr(self.strategy, "measures_buckets", False) and isinstance(meter, CpuMeter)):
            return
        if self.task.compile is not None:
            return
        before = meter.live_bytes
        with meter.unbounded():
            run_trial(
                self.task,
                meter,
                getattr(self, "_first_micro_batch", 1),
                limit_bytes=self.limit_bytes,
                strategy=self.strategy,
                model=model,
                accumulation=self.accumulation,
            )
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        while meter.live_bytes != before and time.monotonic() < deadline:
            time.sleep(0)  # gloo's worker thread lets go of its last work once scheduled

    @property
    def model(self) -> nn.Module | None:
        """The reused model as the strategy wrapped it, once built (None before, and after ``close()``)."""
        return self._model

    def build(self) -> float:
        """Build the reused model now (the first trial would); the seconds it took."""
        started = time.perf_counter()
        self._ensure_model()
        return time.perf_counter() - started

    def __call__(self, micro_batch: int) -> Trial:
        self._first_micro_batch = getattr(self, "_first_micro_batch", micro_batch)  # a compiled model's warm-up
        try:
            model = self._ensure_model()
        except Exception as exc:
            if not is_oom(exc):
                raise
            # The model alone does not fit: the trial builds it inside its measured span, where
            # the OOM is a result (an OOM trial with the meter's reading), not a crash.
            self.close()
            model = None
        del_model = False
        recorder = self._recorder()
        try:
            with recorder.recording(self.meter) if recorder is not None else contextlib.nullcontext():
                trial = run_trial(
                    self.task,
                    self.meter,
                    micro_batch,
                    limit_bytes=self.limit_bytes,
                    strategy=self.strategy,
                    model=model,
                    accumulation=self.accumulation,
                    host_limit_bytes=self.host_limit_bytes,
                )
            if recorder is not None and self.breakdowns is not None:
                found = broken_down(recorder, micro_batch, trial.fits, trial.peak_bytes, trial.host_peak_bytes)
                if found is not None:
                    self.breakdowns[micro_batch] = found
            self._note_attention()
            del_model = trial.oom
            return trial
        except BaseException:
            del_model = True
            raise
        finally:
            del model
            if del_model:
                self.close()

    def _note_attention(self) -> None:
        """The datasheet's line on the attention kernel the trials ran (one line, kept current)."""
        line = attention_line(getattr(self.meter, "attention_kernels", set()), self.task.sdpa_backend)
        if line is None:
            return
        self.warnings[:] = [w for w in self.warnings if not w.startswith(ATTENTION_NOTE)] + [line]

    def _recorder(self) -> Any:
        return breakdown_recorder(self.task, self.meter) if self.breakdowns is not None else None

    def close(self) -> None:
        """Drop the reused model (the next trial builds a new one)."""
        self._model = None
        self.meter.release()


def breakdown_recorder(task: ProbeTask, meter: Meter) -> Any:
    """A breakdown's recorder (autotune/measure/breakdown.py) for a trial's (or a pipeline stage's) steps, where the
    meter sees every allocation: the CPU and fake meters' storages (an eager job: a compiled job's fake trials run it
    eager, and are not broken down), the compiled meter's allocator events (a compiled job); None elsewhere."""
    from autotune.measure.breakdown import BreakdownRecorder
    from autotune.measure.meters.compiled import CompiledCpuMeter
    from autotune.measure.meters.cpu import CpuMeter

    if not isinstance(meter, CpuMeter) or (task.compile is not None) != isinstance(meter, CompiledCpuMeter):
        return None
    return BreakdownRecorder()


def broken_down(recorder: Any, micro_batch: int, fits: bool, peak_bytes: int, host_peak_bytes: int | None) -> Any:
    """The recorded steps' peak broken down (None where the recorder could not), the host's peak by part beside it:
    the ledger's parts at the take the span made at its end."""
    found = recorder.breakdown(micro_batch, fits, peak_bytes)
    return None if found is None else with_host_parts(found, host_peak_bytes, HOST.peak_parts)


def attention_line(kernels: set[str], backend: str | None) -> str | None:
    """What the datasheet says of the attention kernel (its ``attention`` row): the fused kernels
    scaled_dot_product_attention dispatched to in the trials, and whether the job chose it (``--sdpa-backend``) or
    torch did; None where SDPA ran no fused kernel and none was asked for (an eager attention, or none)."""
    sdpa = "scaled_dot_product_attention"
    if not kernels:
        return f"{ATTENTION_NOTE}math path of {sdpa} (--sdpa-backend math)" if backend == "math" else None
    ran = ", ".join(sorted(kernels)) + (" kernels" if len(kernels) > 1 else " kernel")
    if backend is not None:
        return f"{ATTENTION_NOTE}{ran} of {sdpa} (--sdpa-backend {backend})"
    return f"{ATTENTION_NOTE}{ran} of {sdpa}, torch's pick for these inputs here (--sdpa-backend to run another)"


def measure_weights(task: ProbeTask, meter: Meter) -> int | None:
    """Bytes of weights + gradients + optimizer state alone (no activations), or None if even that
    cannot be measured on this device. Used to explain a budget where m=1 does not fit."""

    def static() -> None:
        model = build_model(task, meter)
        optimizer = task.make_optimizer(model)
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        with _fake_step(task, meter):
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
