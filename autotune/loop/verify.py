"""``autotune verify``: prove on the user's own model that accumulation reproduces the large batch.

One fixed batch of T samples from ``task.batch(T)``, one fresh model from ``task.model()``: the
gradient accumulated over T/m micro-batches by :class:`~autotune.loop.accumulate.Accumulator` is
compared with the gradient of the whole batch at once. The figure is the worst relative error over
parameters, ``||g_acc - g_full|| / ||g_full||`` per parameter tensor.

The comparison runs on the CPU in float64 (``task.precision`` is not applied: the question is the
arithmetic of accumulation, not the rounding of bf16), so an exact loop agrees to about 1e-12, or to
about 1e-7 when the task's loss casts to float32 itself (the GPT example does). The default
tolerance, 1e-4, sits far above both and far below what the real mistakes cost (percent level).

When the gradients differ, the report names the cause it can establish:

- ``"randomness"``: two full-batch gradients of the same batch differ (dropout, random augmentation);
- ``"batchnorm"``: BatchNorm in train mode normalizes each micro-batch with its own statistics
  (confirmed when putting those layers in eval mode makes the gradients agree);
- ``"scale"``: the accumulated gradient is a constant multiple of the full one (a summed loss
  treated as a mean);
- ``"mean_of_means"``: the task's loss is a mean over something that varies between
  micro-batches (tokens, unmasked elements) and the task gives no ``loss_sum`` to divide the whole
  group by its total count.

    >>> from examples.gpt import task
    >>> verify_gradients(task, target_batch=8, micro_batch=2).ok
    True
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from autotune.core.errors import TaskError
from autotune.loop.accumulate import (
    Accumulator,
    SmallBatchNormWarning,
    batch_size,
    batchnorm_layers,
    split_batch,
)
from autotune.tasks.batches import map_tensors, samples
from autotune.tasks.task import ProbeTask

__all__ = [
    "CAUSE_BATCHNORM",
    "CAUSE_MEAN_OF_MEANS",
    "CAUSE_RANDOMNESS",
    "CAUSE_SCALE",
    "DEFAULT_MICRO_BATCH",
    "DEFAULT_TARGET_BATCH",
    "DEFAULT_TOLERANCE",
    "VerifyReport",
    "verify_cli",
    "verify_gradients",
    "verify_micro_batches",
]

CAUSE_BATCHNORM = "batchnorm"
CAUSE_RANDOMNESS = "randomness"
CAUSE_SCALE = "scale"
CAUSE_MEAN_OF_MEANS = "mean_of_means"

DEFAULT_TARGET_BATCH = 8
DEFAULT_MICRO_BATCH = 2
# See the module docstring: float64 arithmetic (1e-12) or a float32 loss (1e-7) << 1e-4 << percent.
DEFAULT_TOLERANCE = 1e-4
# A parameter whose true gradient is ~0 (attention's key bias, say) would otherwise divide noise
# by noise: its error is measured against this fraction of the whole gradient's norm at least.
_NORM_FLOOR = 1e-8

Grads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of :func:`verify_gradients`.

    Attributes:
        ok: the accumulated gradient matches the full-batch one within ``tolerance``.
        max_relative_error: worst ``||g_acc - g_full|| / ||g_full||`` over parameter tensors.
        worst_parameter: the parameter where that worst error occurs (None without gradients).
        cause: one of the ``CAUSE_*`` names when the failure could be explained, else None.
        message: one line for a human, saying what was compared and what was found.
        target_batch, micro_batch, accumulation_steps: the split compared (the last
            micro-batch is shorter when micro_batch does not divide target_batch).
        tolerance: the bound on max_relative_error.
        normalization: ``"group_count"`` (``task.loss_sum``, divided by the group's count) or
            ``"sample_mean"`` (``task.loss`` weighted by each micro-batch's share of samples).
        dtype: the floating dtype the comparison ran in.
        mean_of_means_error: with ``loss_sum``, the error a mean of micro-batch means would
            have had on this batch (what exact normalization saves), else None.
    """

    ok: bool
    max_relative_error: float
    worst_parameter: str | None
    cause: str | None
    message: str
    target_batch: int
    micro_batch: int
    accumulation_steps: int
    tolerance: float
    normalization: Literal["group_count", "sample_mean"]
    dtype: str
    mean_of_means_error: float | None = None


def _model_and_batch(task: ProbeTask, target_batch: int, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """A fresh model and one batch of target_batch samples, both in dtype (integer tensors stay as they
    are). Called under the caller's forked and seeded RNG: the model is drawn first, then the batch."""
    model = task.model()
    batch = task.batch(target_batch)
    if batch_size(batch) != target_batch:
        raise TaskError(f"task {task.name!r}: batch({target_batch}) returned {batch_size(batch)} samples")
    model = model.to(dtype=dtype)
    batch = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)
    return model, batch


def _grads(model: nn.Module) -> Grads:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _count(value: int | torch.Tensor) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _relative_errors(got: Grads, want: Grads) -> dict[str, float]:
    scale = math.sqrt(sum(float(g.double().norm()) ** 2 for g in want.values()))
    floor = max(_NORM_FLOOR * scale, torch.finfo(torch.float64).tiny)
    errors: dict[str, float] = {}
    for name in want.keys() | got.keys():
        if name not in want or name not in got:
            errors[name] = 1.0  # a gradient on one side only: nothing comparable, count it as all wrong
            continue
        diff = float((got[name].double() - want[name].double()).norm())
        errors[name] = diff / max(float(want[name].double().norm()), floor)
    return errors


def _worst(errors: dict[str, float]) -> tuple[float, str | None]:
    if not errors:
        return 0.0, None
    name = max(errors, key=lambda k: errors[k])
    return errors[name], name


class _Comparison:
    """Computes the gradients being compared, on one model and one split batch."""

    def __init__(self, task: ProbeTask, model: nn.Module, batch: Any, micro: list[Any]) -> None:
        self.task = task
        self.model = model
        self.batch = batch
        self.micro = micro

    def full(self) -> Grads:
        self.model.zero_grad(set_to_none=True)
        if self.task.loss_sum is not None:
            total, count = self.task.loss_sum(self.model, self.batch)
            (total / max(_count(count), 1)).backward()
        else:
            self.task.compute_loss(self.model, self.batch).backward()
        out = _grads(self.model)
        self.model.zero_grad(set_to_none=True)
        return out

    def accumulated(self) -> Grads:
        task, model = self.task, self.model
        model.zero_grad(set_to_none=True)
        count_fn: Callable[[Any], int] | None = None
        if task.loss_sum is not None:
            # The accumulator needs each micro-batch's count before the first backward; the task
            # only reports it with the loss, so take it from a gradient-free pass.
            with torch.no_grad():
                counts = iter([_count(task.loss_sum(model, b)[1]) for b in self.micro])
            count_fn = lambda _batch: next(counts)  # noqa: E731  (groups() calls it in order)
        # lr=0: the step leaves the weights as they are; the gradient is read just before it.
        acc = Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.0), accumulation_steps=len(self.micro)
        )
        out: Grads = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SmallBatchNormWarning)  # verify names BatchNorm itself
            for group in acc.groups(self.micro, count=count_fn):
                for micro_batch in group:
                    with acc.micro_step():
                        if task.loss_sum is not None:
                            total, count = task.loss_sum(model, micro_batch)
                            acc.backward(total, count=_count(count))
                        else:
                            acc.backward_mean(task.compute_loss(model, micro_batch))
                out = _grads(model)
                acc.step()
        return out

    def mean_of_means(self) -> Grads:
        """The classic mistake, for the record: backward(mean loss of each micro-batch / A)."""
        assert self.task.loss_sum is not None
        self.model.zero_grad(set_to_none=True)
        for micro_batch in self.micro:
            total, count = self.task.loss_sum(self.model, micro_batch)
            (total / max(_count(count), 1) / len(self.micro)).backward()
        out = _grads(self.model)
        self.model.zero_grad(set_to_none=True)
        return out


def _check_sizes(target_batch: int, micro_batch: int, tolerance: float) -> None:
    for name, value in (("target_batch", target_batch), ("micro_batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if micro_batch > target_batch:
        raise ValueError(f"micro_batch {micro_batch} is larger than target_batch {target_batch}")
    if micro_batch == target_batch:
        raise ValueError(f"micro_batch {micro_batch} equals target_batch: there is nothing to accumulate")
    if not tolerance > 0:
        raise ValueError(f"tolerance must be positive, got {tolerance!r}")


def verify_gradients(
    task: ProbeTask,
    *,
    target_batch: int,
    micro_batch: int,
    tolerance: float = DEFAULT_TOLERANCE,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> VerifyReport:
    """Compare the gradient accumulated over micro-batches of m with the full-batch gradient.

    Args:
        task: the user's task; a fresh ``task.model()`` and one ``task.batch(target_batch)`` are used.
            With ``task.loss_sum`` each group is divided by its total count (exact for token
            losses); without it ``task.loss`` is weighted by each micro-batch's share of samples.
        target_batch: T, the samples of the full batch.
        micro_batch: m, the micro-batch size (T/m micro-batches; the last is shorter if m does not divide T).
        tolerance: the largest acceptable worst relative error over parameters.
        dtype: floating dtype for model and batch (float64 by default, see the module docstring).
        seed: seeds the RNG (forked, the caller's RNG state is untouched) for model and batch.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is the verdict, ``report.cause`` the diagnosis.

    Raises:
        ValueError: non-positive sizes, m >= T, or a non-positive tolerance.
        TaskError: the task's batch does not have target_batch samples.

    Example::

        report = verify_gradients(task, target_batch=32, micro_batch=8)
        if not report.ok:
            print(report.cause, report.message)
    """
    _check_sizes(target_batch, micro_batch, tolerance)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, batch = _model_and_batch(task, target_batch, dtype)
        micro = split_batch(batch, micro_batch)
        return _verify(task, model, batch, micro, target_batch, micro_batch, tolerance, dtype)


def _verify(
    task: ProbeTask,
    model: nn.Module,
    batch: Any,
    micro: list[Any],
    target_batch: int,
    micro_batch: int,
    tolerance: float,
    dtype: torch.dtype,
    split: str | None = None,
) -> VerifyReport:
    comparison = _Comparison(task, model, batch, micro)
    full = comparison.full()
    accumulated = comparison.accumulated()
    error, worst = _worst(_relative_errors(accumulated, full))
    normalization: Literal["group_count", "sample_mean"] = (
        "group_count" if task.loss_sum is not None else "sample_mean"
    )
    mean_of_means_error = None
    if task.loss_sum is not None:
        mean_of_means_error = _worst(_relative_errors(comparison.mean_of_means(), full))[0]

    split = split or f"T={target_batch} as {len(micro)} micro-batches of {micro_batch}"
    how = "divided by the group's count (loss_sum)" if task.loss_sum else "sample-weighted mean loss"
    report = dict(
        max_relative_error=error,
        worst_parameter=worst,
        target_batch=target_batch,
        micro_batch=micro_batch,
        accumulation_steps=len(micro),
        tolerance=tolerance,
        normalization=normalization,
        dtype=str(dtype).removeprefix("torch."),
        mean_of_means_error=mean_of_means_error,
    )
    if error <= tolerance:
        saved = ""
        if mean_of_means_error is not None and mean_of_means_error > tolerance:
            saved = f"; a mean of micro-batch means would be off by {mean_of_means_error:.1e}"
        message = (
            f"accumulation reproduces the full-batch gradient: {split}, {how}, worst relative error "
            f"{error:.1e} ({worst}) <= {tolerance:g}{saved}"
        )
        return VerifyReport(ok=True, cause=None, message=message, **report)  # type: ignore[arg-type]

    cause, why = _diagnose(comparison, full, accumulated, tolerance)
    message = (
        f"accumulated gradient differs from the full batch: {split}, {how}, worst relative error "
        f"{error:.1e} ({worst}) > {tolerance:g}: {why}"
    )
    return VerifyReport(ok=False, cause=cause, message=message, **report)  # type: ignore[arg-type]


def verify_micro_batches(
    task: ProbeTask,
    sizes: Sequence[int],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> VerifyReport:
    """:func:`verify_gradients` over micro-batches of the given sizes, in order: uneven ones, as a
    length-aware sampler (:class:`autotune.loop.sampler.LengthBatchSampler`) yields them, each with
    its own number of samples and of supervised tokens, accumulated as one group.

    Args:
        task: as for :func:`verify_gradients`; one ``task.batch(sum(sizes))`` is cut into the sizes.
        sizes: two or more micro-batch sizes, e.g. ``[len(b) for b in update]`` of a sampler's update.

    Returns:
        A :class:`VerifyReport` whose ``micro_batch`` is the largest size and ``target_batch`` their sum.

    Raises:
        ValueError: fewer than two sizes, a size that is not a positive integer, or a non-positive tolerance.
        TaskError: the task's batch does not have sum(sizes) samples.

    >>> from examples.gpt import task
    >>> verify_micro_batches(task, [5, 1, 3, 2]).ok
    True
    """
    sizes = list(sizes)
    if len(sizes) < 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"sizes must be two or more positive integers, got {sizes!r}")
    if not tolerance > 0:
        raise ValueError(f"tolerance must be positive, got {tolerance!r}")
    target_batch = sum(sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, batch = _model_and_batch(task, target_batch, dtype)
        starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
        micro = [samples(batch, start, stop) for start, stop in zip(starts, starts[1:], strict=False)]
        split = f"T={target_batch} as {len(sizes)} uneven micro-batches of {'+'.join(map(str, sizes))}"
        return _verify(task, model, batch, micro, target_batch, max(sizes), tolerance, dtype, split=split)


def _dropout_layers(model: nn.Module) -> list[str]:
    dropout = nn.modules.dropout._DropoutNd
    return [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, dropout) and module.training and module.p > 0
    ]


def _names(layers: list[str]) -> str:
    return ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")


def _diagnose(
    comparison: _Comparison, full: Grads, accumulated: Grads, tolerance: float
) -> tuple[str | None, str]:
    model = comparison.model
    # Randomness first: while the full batch does not even agree with itself, nothing else can be judged.
    again_error, _ = _worst(_relative_errors(comparison.full(), full))
    if again_error > tolerance:
        dropout = _dropout_layers(model)
        what = (
            f"dropout with p > 0 in train mode ({_names(dropout)})"
            if dropout
            else "randomness in the model or loss"
        )
        return CAUSE_RANDOMNESS, (
            f"the same full batch gives different gradients twice (error {again_error:.1e}): {what}; "
            "compare with model.eval() or a fixed seed, or accept that dropout makes gradients random"
        )

    batchnorm = batchnorm_layers(model)
    if batchnorm:
        confirmed = ""
        bn_modules = [
            m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
        ]
        if bn_modules:
            for module in bn_modules:
                module.eval()
            try:
                eval_error, _ = _worst(_relative_errors(comparison.accumulated(), comparison.full()))
            finally:
                for module in bn_modules:
                    module.train()
            if eval_error <= tolerance:
                confirmed = f" (with those layers in eval mode the gradients agree to {eval_error:.1e})"
        return CAUSE_BATCHNORM, (
            f"BatchNorm in train mode ({_names(batchnorm)}) normalizes each micro-batch with its own "
            f"statistics, so accumulation cannot reproduce the large batch{confirmed}; use a larger "
            "micro-batch, GroupNorm/LayerNorm, or SyncBatchNorm across replicas"
        )

    ratio = _uniform_ratio(accumulated, full)
    if ratio is not None and abs(ratio - 1.0) > tolerance:
        return CAUSE_SCALE, (
            f"the accumulated gradient is {ratio:.3g}x the full-batch one on every parameter: the loss "
            "looks like a sum over the batch rather than a mean; give the task loss_sum(model, batch) "
            "-> (summed loss, count)"
        )

    if comparison.task.loss_sum is None:
        return CAUSE_MEAN_OF_MEANS, (
            "with equal sample weights the accumulated loss is a mean of micro-batch means; the loss "
            "is probably a mean over a count that varies between micro-batches (tokens, unmasked "
            "elements): give the task loss_sum(model, batch) -> (summed loss, count) so each group is "
            "divided by its total count"
        )
    return None, (
        "no known cause: check that loss_sum's count is exactly the number of elements summed into "
        "its loss, and that the loss has no term that depends on the batch as a whole"
    )


def _uniform_ratio(got: Grads, want: Grads) -> float | None:
    """c when got == c x want for every parameter (to 1e-6), else None."""
    names = [n for n in want if n in got]
    if not names:
        return None
    flat_got = torch.cat([got[n].double().flatten() for n in names])
    flat_want = torch.cat([want[n].double().flatten() for n in names])
    denominator = float(flat_want @ flat_want)
    if denominator == 0.0:
        return None
    ratio = float(flat_got @ flat_want) / denominator
    residual = float((flat_got - ratio * flat_want).norm()) / max(float(flat_got.norm()), 1e-300)
    return ratio if residual < 1e-6 else None


def verify_cli(
    task: ProbeTask,
    target_batch: int | None,
    micro_batch: int | None,
    tolerance: float | None,
) -> tuple[bool, str]:
    """What ``autotune verify TASK [--target-batch T --micro-batch m --tolerance x]`` runs.

    Defaults: T=8 and m=2; with only T, m = T // 4 (at least 1); with only m, T = 4m.

    Returns:
        (ok, one line for the terminal). Bad sizes give (False, the reason) rather than raising.

    Raises:
        TaskError: the task misbehaves (see :func:`verify_gradients`).
    """
    if target_batch is None and micro_batch is None:
        target_batch, micro_batch = DEFAULT_TARGET_BATCH, DEFAULT_MICRO_BATCH
    elif micro_batch is None:
        assert target_batch is not None
        micro_batch = max(1, target_batch // 4)
    elif target_batch is None:
        target_batch = 4 * micro_batch
    try:
        report = verify_gradients(
            task,
            target_batch=target_batch,
            micro_batch=micro_batch,
            tolerance=DEFAULT_TOLERANCE if tolerance is None else tolerance,
        )
    except ValueError as exc:
        return False, f"autotune verify: {exc}"
    verdict = "ok" if report.ok else f"FAILED ({report.cause or 'unknown cause'})"
    return report.ok, f"{task.name}: {verdict}: {report.message}{compiled_note(task)}"


def compiled_note(task: ProbeTask) -> str:
    """What verify says of a compiled task (``task.compile``): it compared the eager model's gradients. Not
    sensible to compile here: the question is the accumulation's arithmetic, which compiling does not change (the
    loss, the split and the division are the task's), and a compiled float64 model would be one more compilation
    for each of the comparison's passes, and reorders sums, blurring the 1e-12 agreement the verdict reads."""
    if task.compile is None:
        return ""
    return (
        f" (the task is compiled ({task.compile}): verify ran the model eager, in float64: compiling changes neither "
        "the loss nor how accumulation divides it)"
    )
