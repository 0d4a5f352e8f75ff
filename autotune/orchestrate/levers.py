"""The levers: what each change of a job's setup would free at its peak, and the m_max it would give.

For a job that does not fit, and on request for one that does (``--levers``), every change below that applies to
the job is tried by fake trials of the changed setup (no device memory spent): the peak at the job's micro-batch
(its m_max, or the smallest size where none fits) against the job's own fake peak there, and the m_max of the
changed setup by an estimate. A change that cannot compose with the job (autotune/core/compositions.py), or that
the model refuses (a policy on a model with no blocks, tp on a model without a plan), is listed with the reason
and never crashes the rest.

The changes, cheapest first (the order of issue 42: what the job gives up grows down the list: the whole logits for
a fused loss, time for a memory policy, the optimizer state's precision, more ranks holding the job, host memory, a
compilation, the weights' precision, context):

    --loss fused-linear                 the LM head and the loss fused (Liger's form): the logits never whole, nothing
                                        recomputed (a causal LM computing the plain loss: where the logits hold the
                                        peak, this is what frees it)
    --ac every-2, --ac op, --ac full    recompute part or all of the forward in the backward
    --optimizer adamw8bit               8-bit AdamW state (bitsandbytes), for an AdamW job
    --strategy fsdp                     the same world size, sharded (a ddp job over more than one rank; a
                                        pipeline's stages over their data-parallel ranks)
    --tp 2                              tensor parallel over pairs of the same ranks
    --offload activations               the blocks' saved activations in host memory
    --compile                           listed, never estimated: fake trials run the eager model (probe it compiled)
    --weights-dtype bf16                the weights held in bf16 (their gradients and state follow)
    --seq-len L/2                       half the sequence (a sequence-aware job)

A pipeline's changes are tried on every stage, each change's peak its most loaded stage's, as the pipeline's search
decides. The no-fit diagnosis (exit 4) names the cheapest that makes the smallest micro-batch fit
(:func:`cheapest_lever`).
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Iterator

import torch

from autotune.core.compositions import composition_refusal
from autotune.core.errors import AutotuneError, CannotFitError
from autotune.core.loss_names import PLAIN_LOSS
from autotune.core.schemas import MAX_BYTES, Lever, Profile
from autotune.measure.trial import build_on_meta, frozen_heap
from autotune.orchestrate.config import EstimateConfig, ProbeConfig
from autotune.search.diagnose import fake_trial, job_strategy
from autotune.tasks.hf import is_hf_spec, with_options
from autotune.tasks.load import load_task
from autotune.tasks.losses import loss_refusal
from autotune.tasks.optimizers import optimizer_text
from autotune.tasks.task import ProbeTask

__all__ = ["cheapest_lever", "pull_levers", "with_cheapest_lever"]

# Set while levers are tried: an estimate of a changed setup that does not fit raises its own no-fit line without
# looking for a cheapest change of its own.
_TRYING = contextvars.ContextVar("autotune_levers_trying", default=False)
_COMPILE_NOTE = "a compiled step is measured, not estimated (fake trials run the eager model): probe it with --compile"


@dataclasses.dataclass(frozen=True)
class _Change:
    flags: str
    task: ProbeTask | None = None
    config: ProbeConfig | None = None
    note: str = ""


def _changes(task: ProbeTask, config: ProbeConfig) -> Iterator[_Change]:
    """Every change that applies to the job (task as config applies it), cheapest first."""
    if _takes_fused_loss(task):
        yield _Change("--loss fused-linear", task, config.with_setup(lm_loss="fused-linear"))
    policy = task.activation_checkpointing
    for name in ("every-2", "op"):
        if policy == "none":
            yield _Change(f"--ac {name}", task, config.with_setup(activation_checkpointing=name))
    if policy in ("none", "op") or policy.startswith("every-"):
        yield _Change("--ac full", task, config.with_setup(activation_checkpointing="full"))
    # None: the probe's default AdamW (autotune/tasks/task.py); a factory of the user's is not read.
    optimizer = "adamw" if task.optimizer is None else (optimizer_text(task.optimizer) or "").lower()
    if optimizer.startswith("adamw") and "8bit" not in optimizer and "4bit" not in optimizer:
        yield _Change("--optimizer adamw8bit", dataclasses.replace(task, optimizer="adamw8bit"), config)
    # A pipeline's stages sharded over its data-parallel ranks too (torchtitan's pp x fsdp).
    if config.strategy == "ddp" and config.world_size > 1 and config.mesh.tp == config.mesh.cp == 1:
        yield _Change(f"--strategy fsdp --world-size {config.world_size}", task, config.with_setup(strategy="fsdp"))
    if config.mesh.tp == 1 and config.world_size % (2 * config.mesh.pp * config.mesh.cp) == 0:
        # The rest of the mesh kept as it is (a pipeline's schedule, K and V with it).
        yield _Change("--tp 2", task, config.with_setup(mesh=dataclasses.replace(config.mesh, tp=2)))
    if task.offload == "none":
        yield _Change("--offload activations", task, config.with_setup(offload="activations"))
    if task.compile is None:
        yield _Change("--compile", note=_COMPILE_NOTE)
    if task.weights_dtype == "fp32" and task.precision != "fp16":
        yield _bf16_weights(task, config)
    if task.seq_len is not None and task.seq_len >= 2:
        yield _Change(f"--seq-len {task.seq_len // 2}", task.at_length(task.seq_len // 2), config)


def _takes_fused_loss(task: ProbeTask) -> bool:
    """Whether the job computes the plain loss over an LM head that Liger's form can fuse (its model on meta)."""
    if task.lm_loss != PLAIN_LOSS:
        return False
    model = build_on_meta(task)
    return model is not None and loss_refusal(model, "fused-linear") is None


def _bf16_weights(task: ProbeTask, config: ProbeConfig) -> _Change:
    """The job with its weights in bf16: an hf: spec loaded again with ``weights_dtype=bf16`` (its factory names
    the dtype), a task file's factory run under bf16 as the default dtype; left out where the model built on the
    meta device is not bf16 then (a factory that names its own dtype)."""
    flags = "--weights-dtype bf16"
    try:
        if task.source is not None and is_hf_spec(task.source):
            changed = load_task(with_options(task.source, weights_dtype="bf16"))
            changed = changed if task.seq_len is None else changed.at_length(task.seq_len)
            changed = dataclasses.replace(
                changed,
                activation_checkpointing=task.activation_checkpointing,
                offload=task.offload,
                compile=task.compile,
                precision=task.precision,
                lm_loss=task.lm_loss,
            )
        else:
            changed = dataclasses.replace(task, weights_dtype="bf16")
        model = build_on_meta(changed)
    except AutotuneError as exc:
        return _Change(flags, note=_first_line(exc))
    if model is None or not any(p.dtype == torch.bfloat16 for p in model.parameters()):
        return _Change(flags, note="the task's model factory names its own dtype: give the weights' dtype in the task")
    return _Change(flags, changed, config)


def _fake_peak(task: ProbeTask, config: ProbeConfig, micro_batch: int, device_type: str) -> int:
    """The peak of one fake trial of the job at micro_batch, with no budget (its whole peak); a pipeline's, its most
    loaded stage's (every stage's fake trial replaying its schedule).

    Raises:
        AutotuneError: the job cannot run a fake trial (the line says why)."""
    strategy = job_strategy(config.strategy, config.world_size, config.mesh)
    trial = fake_trial(
        task, micro_batch, device_type=device_type, strategy=strategy, limit_bytes=MAX_BYTES, mesh=config.mesh
    )
    return trial.peak_bytes


def _peak_among(
    found: Profile, micro_batch: int, config: ProbeConfig, device_type: str, on_card: EstimateConfig | None = None
) -> int | None:
    """The whole peak at micro_batch where the changed setup's estimate already ran it (a fake trial on the CPU that
    fit: an OOM stops at the budget, short of the peak; on a card, its figure there, which the estimate was asked
    for); None where it did not (a pipeline's trials on the CPU are its stages')."""
    if on_card is not None:
        at = [t for t in found.trials if t.micro_batch == micro_batch and not t.oom]
        return at[-1].peak_bytes if at else None
    if device_type != "cpu" or config.mesh.pp > 1:
        return None
    for trial in found.trials:
        if trial.fake and trial.micro_batch == micro_batch and trial.fits:
            return trial.peak_bytes
    return None


def _refusal(change: _Change) -> str | None:
    assert change.task is not None and change.config is not None
    return composition_refusal(change.config.dimensions(change.task))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:400]


@frozen_heap()
def pull_levers(
    task: ProbeTask,
    config: ProbeConfig,
    *,
    at_micro_batch: int,
    device_type: str = "cpu",
    only: tuple[str, ...] | None = None,
    estimator: Callable[[ProbeTask, EstimateConfig], Profile],
    on_card: EstimateConfig | None = None,
    job_peak_bytes: int | None = None,
) -> list[Lever]:
    """Each applicable change's peak at at_micro_batch, the bytes it frees there and its m_max, best first (the
    largest m_max, then the most freed); the changes left out, with why, after them. ``only``: the changes whose
    flags are among these (None: every one that applies). ``estimator``: the estimate that gives a changed setup's
    m_max (autotune.orchestrate.estimate.estimate, handed in by its callers: it calls here too).

    ``on_card``: the estimate's config of an emulated card (``--gpu``): each changed setup is estimated on that card,
    with at_micro_batch among its sizes, so its m_max and its peak there are the card's figures (reserved + outside
    the allocator), as the job's own, ``job_peak_bytes``, is (the job's trial at at_micro_batch on the card).

    Raises:
        AutotuneError: the job itself cannot run a fake trial (the line says why)."""
    token = _TRYING.set(True)
    try:
        return _pull(task, config, at_micro_batch, device_type, only, estimator, on_card, job_peak_bytes)
    finally:
        _TRYING.reset(token)


def _lever_config(setup: ProbeConfig, at_micro_batch: int, on_card: EstimateConfig | None) -> EstimateConfig:
    """The estimate of a changed setup: with CPU semantics, or on the job's card with at_micro_batch among its sizes
    (the card's figure there is the lever's peak)."""
    if on_card is None:
        return EstimateConfig(probe=setup, device_kind="cpu")
    return dataclasses.replace(on_card, probe=setup, micro_batches=(at_micro_batch,), predict=False)


def _pull(
    task: ProbeTask,
    config: ProbeConfig,
    at_micro_batch: int,
    device_type: str,
    only: tuple[str, ...] | None,
    estimate: Callable[[ProbeTask, EstimateConfig], Profile],
    on_card: EstimateConfig | None = None,
    job_peak_bytes: int | None = None,
) -> list[Lever]:
    task = config.applied_to(task)
    job_peak = job_peak_bytes if job_peak_bytes is not None else _fake_peak(task, config, at_micro_batch, device_type)
    pulled: list[Lever] = []
    left_out: list[Lever] = []
    for change in _changes(task, config):
        if only is not None and change.flags not in only:
            continue
        if change.task is None or change.config is None:
            left_out.append(Lever(flags=change.flags, at_micro_batch=at_micro_batch, note=change.note))
            continue
        refusal = _refusal(change)
        if refusal is not None:
            left_out.append(Lever(flags=change.flags, at_micro_batch=at_micro_batch, note=refusal))
            continue
        setup = change.config.with_setup(breakdown=False, levers=False, target_batch=None)
        try:
            try:
                found = estimate(change.task, _lever_config(setup, at_micro_batch, on_card))
                m_max, peak = found.max_micro_batch, _peak_among(found, at_micro_batch, setup, device_type, on_card)
            except CannotFitError:
                m_max, peak = 0, None
            if peak is None and on_card is not None:  # not even its smallest size fits the card: nothing to read
                left_out.append(Lever(flags=change.flags, at_micro_batch=at_micro_batch, max_micro_batch=0,
                                      note=f"does not fit the {on_card.card.short_name if on_card.card else 'card'} "
                                      f"at micro-batch {at_micro_batch} either"))  # fmt: skip
                continue
            if peak is None:
                peak = _fake_peak(setup.applied_to(change.task), setup, at_micro_batch, device_type)
        except (AutotuneError, ValueError, RuntimeError) as exc:  # a change the model refuses: said, not raised
            left_out.append(Lever(flags=change.flags, at_micro_batch=at_micro_batch, note=_first_line(exc)))
            continue
        pulled.append(
            Lever(
                flags=change.flags,
                at_micro_batch=at_micro_batch,
                peak_bytes=peak,
                freed_bytes=job_peak - peak,
                max_micro_batch=m_max,
            )
        )
    pulled.sort(key=lambda lever: (-(lever.max_micro_batch or 0), -(lever.freed_bytes or 0)))
    return pulled + left_out


@frozen_heap()
def cheapest_lever(
    task: ProbeTask,
    config: ProbeConfig,
    *,
    micro_batch: int,
    limit_bytes: int,
    device_type: str = "cpu",
    skip: tuple[str, ...] = (),
) -> Lever | None:
    """The first change, cheapest first, under which micro_batch's fake peak is within limit_bytes (None: none
    of them): one fake trial each, no search. ``skip``: changes whose flags start with one of these."""
    task = config.applied_to(task)
    for change in _changes(task, config):
        if change.task is None or change.config is None or _refusal(change) is not None:
            continue
        if change.flags.startswith(skip):
            continue
        setup = change.config.with_setup(breakdown=False, levers=False)
        try:
            peak = _fake_peak(setup.applied_to(change.task), setup, micro_batch, device_type)
        except (AutotuneError, ValueError, RuntimeError):
            continue
        if peak <= limit_bytes:
            return Lever(flags=change.flags, at_micro_batch=micro_batch, peak_bytes=peak)
    return None


# The changes that act on activations only: no help where the weights, gradients and optimizer state alone are over.
_ACTIVATION_ONLY = ("--loss ", "--ac ", "--offload activations", "--seq-len ")


def with_cheapest_lever(
    error: CannotFitError,
    task: ProbeTask,
    config: ProbeConfig,
    *,
    budget_bytes: int,
    device_type: str,
    unseen_bytes: int = 0,
) -> CannotFitError:
    """error's line with the cheapest change that makes the smallest micro-batch fit (or that none autotune knows
    does), by fake trials: the no-fit diagnosis's last word."""
    from autotune.core import units

    if _TRYING.get():
        return error
    limit = units.limit_bytes(budget_bytes, config.headroom) - unseen_bytes
    static = getattr(error.diagnosis, "static_bytes", None)
    skip = _ACTIVATION_ONLY if static is not None and static > limit else ()
    token = _TRYING.set(True)
    try:
        lever = cheapest_lever(
            task, config, micro_batch=config.multiple_of, limit_bytes=limit, device_type=device_type, skip=skip
        )
    except AutotuneError:
        return error
    finally:
        _TRYING.reset(token)
    text = str(error)
    if lever is not None and lever.peak_bytes is not None:
        text += (
            f"; the cheapest change that fits micro-batch {config.multiple_of}: {lever.flags} "
            f"(peak {lever.peak_bytes} bytes by a fake trial)"
        )
    else:
        text += "; no single change autotune knows fits it (--levers lists what each frees)"
    return CannotFitError(text, error.diagnosis)
