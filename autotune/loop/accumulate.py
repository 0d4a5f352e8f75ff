"""The training-loop side of a plan: gradient accumulation done right.

A plan (micro_batch m, accumulation_steps A, world_size D) is only as good as the loop that uses it.
:class:`Accumulator` makes the right loop the easy one (docs/design.md, "Accumulation"):

- the loss of a group is divided by the supervised count of the *whole group* (all its micro-batches,
  and all replicas under DDP), known before the first backward, not a mean of micro-batch means;
- a partial last group uses its own denominator, or is dropped and reported;
- under DDP, ``no_sync()`` covers the forward and backward of every micro-batch but the last;
- ``GradScaler.unscale_``, then one clip on the accumulated gradient, then the step, then
  ``scaler.update()``; the scale is constant within a group;
- the LR scheduler advances per optimizer update; micro-batches, updates, samples and tokens are
  separate counters;
- optional OOM fallback: a group that runs out of memory is redone from its start with micro-batches
  of half the size, nothing double-counted;
- uneven micro-batches (a balanced plan's 6 x 26 + 4 x 25) are exact too, since the denominator is
  the group's; :class:`~autotune.loop.plan_sampler.PlanBatchSampler` cuts a map-style dataset into
  them, group after group (importable from here too).

    acc = Accumulator(model, optimizer, accumulation_steps=4, max_grad_norm=1.0)
    for group in acc.groups(loader, count=lambda b: (b["labels"] != -100).sum()):
        for batch in group:
            with acc.micro_step():
                loss_sum, n = summed_token_loss(model, batch)
                acc.backward(loss_sum, count=n)
        acc.step()
"""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from autotune.core.errors import AutotuneError
from autotune.core.plan import plan as make_plan
from autotune.core.schemas import Observation, Plan
from autotune.loop.plan_sampler import PlanBatchSampler
from autotune.measure.oom import is_oom
from autotune.tasks.batches import samples, tensors

__all__ = [
    "SMALL_BATCHNORM_MICRO_BATCH",
    "AccumulationError",
    "Accumulator",
    "Counters",
    "Group",
    "OomEvent",
    "PartialLastGroup",
    "PlanBatchSampler",
    "SmallBatchNormWarning",
    "batch_size",
    "batchnorm_layers",
    "split_batch",
]

log = logging.getLogger(__name__)

PartialLastGroup = Literal["own_denominator", "drop"]

# Below this many samples per micro-batch, BatchNorm's per-batch statistics are noisy enough to
# change training; the common advice (and Lightning's) is to warn rather than refuse.
SMALL_BATCHNORM_MICRO_BATCH = 16

CountFn = Callable[[Any], "int | torch.Tensor"]


class AccumulationError(AutotuneError):
    """The loop does not follow the accumulation protocol (a missing step, a backward outside
    ``micro_step``, a count that disagrees with the group's denominator, ...)."""


class SmallBatchNormWarning(UserWarning):
    """The model has BatchNorm and the micro-batch is small: BatchNorm normalizes each micro-batch
    with its own statistics, so accumulation does not reproduce the large batch."""


@dataclass
class Counters:
    """What the loop did, as separate counters (a scheduler or a log needs the right one).

    ``micro_batches``, ``samples`` and ``tokens`` count only groups that ended in an update; a
    group redone after an OOM counts once. ``tokens`` is the sum of the ``count=`` given to
    :meth:`Accumulator.groups` (supervised elements), or of samples when no count is given.
    All are per replica.
    """

    micro_batches: int = 0
    updates: int = 0
    samples: int = 0
    tokens: int = 0
    # Updates the GradScaler skipped because the gradient had inf/NaN (the scale went down).
    skipped_updates: int = 0


@dataclass
class OomEvent:
    """One out-of-memory the fallback recovered from."""

    group_index: int
    micro_batch: int
    new_micro_batch: int
    plan: Plan


@dataclass
class Group:
    """The micro-batches of one optimizer update, pre-fetched so their count is known up front.

    Iterate it to get the micro-batches. After an OOM (with the fallback on) the iteration
    restarts from the group's first sample with smaller micro-batches.

    Attributes:
        index: 0-based index of the group in this accumulator's life.
        micro_batches: what iterating yields (may be re-split after an OOM).
        samples: samples in the group on this replica.
        count: supervised elements of the group on this replica (samples when no count is given).
        denominator: what the group's summed loss is divided by: the count over all replicas.
        global_samples: samples in the group over all replicas.
        partial: True for a last group with fewer micro-batches than accumulation_steps.
    """

    index: int
    micro_batches: list[Any]
    samples: int
    count: int
    denominator: int
    global_samples: int
    partial: bool
    _acc: Accumulator = field(repr=False)
    _sizes: list[int] = field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __iter__(self) -> Iterator[Any]:
        acc = self._acc
        position = 0
        while position < len(self.micro_batches):
            acc._begin_position(self, position)
            yield self.micro_batches[position]
            if acc._oom_pending is not None:
                # Resumed by the user's loop after micro_step swallowed an OOM: we are outside
                # any except block now, so the failed attempt's frames are gone and can be freed.
                acc._recover(self)
                position = 0
                continue
            position += 1


def batch_size(batch: Any) -> int:
    """The number of samples in a batch: dim 0 of its tensors (nested dict/tuple/list allowed).

    Raises:
        AccumulationError: no tensor with a batch dimension, or tensors that disagree on dim 0.

    >>> batch_size({"x": torch.zeros(3, 5), "y": (torch.zeros(3),)})
    3
    """
    sizes = {tensor.shape[0] for tensor in tensors(batch) if tensor.dim() > 0}
    if len(sizes) != 1:
        what = "no tensor with a batch dimension" if not sizes else f"tensors with dim 0 of {sorted(sizes)}"
        raise AccumulationError(f"cannot tell the batch size of a micro-batch with {what}")
    return sizes.pop()


def split_batch(batch: Any, micro_batch: int) -> list[Any]:
    """Split a batch along dim 0 into chunks of micro_batch samples (the last may be smaller).

    Tensors with a batch dimension are split; dicts, tuples, lists and namedtuples are rebuilt
    around the pieces; anything else (0-dim tensors, strings, numbers) is copied into every chunk.

    Raises:
        ValueError: micro_batch < 1.
        AccumulationError: see :func:`batch_size`.

    >>> [c.shape[0] for c in split_batch(torch.zeros(5, 2), 2)]
    [2, 2, 1]
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    total = batch_size(batch)
    starts = range(0, total, micro_batch)
    return [samples(batch, start, min(start + micro_batch, total)) for start in starts]


def _as_int(value: int | torch.Tensor, what: str) -> int:
    number: object = value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            shape = tuple(value.shape)
            raise AccumulationError(f"{what} must be a single number, got a tensor of shape {shape}")
        number = value.item()
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise AccumulationError(f"{what} must be a non-negative integer, got {number!r}")
    return number


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of the BatchNorm layers that normalize with the current batch's statistics.

    That is layers in train mode, or without running statistics; in eval mode a BatchNorm
    layer is a per-sample affine map and does not couple the samples of a micro-batch.
    """
    batchnorm = nn.modules.batchnorm._BatchNorm
    return [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, batchnorm) and (module.training or module.running_mean is None)
    ]


def _distributed_world_size(model: nn.Module) -> int:
    """Replicas that average this model's gradients: >1 only for a DDP/FSDP-wrapped model."""
    if not hasattr(model, "no_sync"):
        return 1
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    process_group = getattr(model, "process_group", None)
    return int(torch.distributed.get_world_size(process_group))


class Accumulator:
    """Applies a plan (m, A, D) in a training loop: exact group normalization, DDP no_sync,
    scaler/clip/step order, per-update scheduler, counters, and an opt-in OOM fallback.

    Args:
        model: the module being trained; if it is wrapped in DistributedDataParallel (anything
            with ``no_sync``), gradient synchronization is skipped on all but the last micro-batch.
        optimizer: the optimizer stepped once per group.
        accumulation_steps: A, micro-batches per optimizer update (per replica).
        scaler: a ``torch.amp.GradScaler`` for fp16, or None.
        scheduler: an LR scheduler stepped once per update, or None.
        max_grad_norm: clip the accumulated gradient to this total norm (after unscale_), or None.
        partial_last_group: ``"own_denominator"`` runs a short last group divided by its own
            count; ``"drop"`` skips it and records what was skipped in :attr:`dropped`.
        oom_fallback: on an out-of-memory inside :meth:`micro_step`, halve the micro-batch,
            redo the group from its start, and carry on with the smaller micro-batch.
            Single-process only (replicas cannot agree on a retry without a collective).
        target_batch: T the fallback must keep; default the samples of the first group (m x A x D
            for equal micro-batches, their sum x D for a balanced plan's).
        observe: called with an :class:`~autotune.core.schemas.Observation` (oom=True) after each
            recovered OOM, e.g. to post it to the autotune server. Its errors are logged, not raised.
            One with an ``after_update(updates, micro_batch)`` method is also told of every update
            (``autotune_client.observer(suggestion)`` reports the job's peak that way).
        on_plan_change: called with the new :class:`~autotune.core.schemas.Plan` after each recovered OOM.

    Raises:
        ValueError: accumulation_steps < 1, an unknown partial_last_group, a non-positive
            max_grad_norm, or oom_fallback on a distributed model.

    Example (token losses with padding; ``loss_sum`` returns the summed loss and its count)::

        acc = Accumulator(model, opt, accumulation_steps=4, scheduler=sched, max_grad_norm=1.0)
        for group in acc.groups(loader, count=lambda b: (b["labels"] != -100).sum()):
            for batch in group:
                with acc.micro_step():
                    total, n = loss_sum(model, batch)
                    acc.backward(total, count=n)
            acc.step()
        print(acc.counters)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        accumulation_steps: int,
        scaler: torch.amp.GradScaler | None = None,
        scheduler: Any | None = None,
        max_grad_norm: float | None = None,
        partial_last_group: PartialLastGroup = "own_denominator",
        oom_fallback: bool = False,
        target_batch: int | None = None,
        observe: Callable[[Observation], None] | None = None,
        on_plan_change: Callable[[Plan], None] | None = None,
    ) -> None:
        steps = accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"accumulation_steps must be a positive integer, got {accumulation_steps!r}")
        if partial_last_group not in ("own_denominator", "drop"):
            raise ValueError(
                f"partial_last_group must be 'own_denominator' or 'drop', got {partial_last_group!r}"
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        self.model = model
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.scaler = scaler
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.partial_last_group: PartialLastGroup = partial_last_group
        self.world_size = _distributed_world_size(model)
        if oom_fallback and self.world_size > 1:
            raise ValueError(
                "oom_fallback is single-process only: under DDP one replica's retry would leave the "
                "others waiting in the gradient all-reduce"
            )
        self.oom_fallback = oom_fallback
        self.target_batch = target_batch
        self.observe = observe
        self.on_plan_change = on_plan_change
        # The largest micro-batch a finished group ran: the size whose peak an observer reports.
        self._largest_micro_batch = 0

        self.counters = Counters()
        #: What ``partial_last_group="drop"`` skipped: micro_batches, samples and tokens (updates stays 0).
        self.dropped = Counters()
        #: The plan in force after an OOM fallback (None until one happens).
        self.plan: Plan | None = None
        #: The largest micro-batch used after an OOM fallback (None: the loader's own size).
        self.micro_batch_limit: int | None = None
        self.oom_events: list[OomEvent] = []
        #: Total gradient norm (before clipping) of the last update, when max_grad_norm is set.
        self.last_grad_norm: torch.Tensor | None = None

        self._group: Group | None = None
        self._position = 0
        self._in_micro_step = False
        self._backward_done: set[int] = set()
        self._count_seen = 0
        self._count_given = False
        self._oom_pending: int | None = None
        self._group_scale: float | None = None
        self._warned_batchnorm = False
        # Samples of the first group over all replicas: the T a plan's micro-batches add up to (equal
        # or balanced), kept by the OOM fallback when no target_batch is given.
        self._first_group_samples: int | None = None

    # -- groups ---------------------------------------------------------------------------

    def groups(self, loader: Iterable[Any], count: CountFn | None = None) -> Iterator[Group]:
        """Group the loader's micro-batches A at a time, pre-fetching each group.

        Args:
            loader: yields micro-batches (tensors or nested dict/tuple/list of tensors, dim 0 = samples).
            count: count(micro_batch) -> supervised elements (e.g. ``(labels != -100).sum()``);
                the group's summed loss is divided by the sum over the group (and over replicas).
                None counts samples, which is exact for per-sample losses.

        Yields:
            :class:`Group` objects; call :meth:`step` after iterating each one.

        Raises:
            AccumulationError: the previous group was not stepped, or a count is not a non-negative integer.
        """
        # A stale gradient from before the loop would silently join the first update.
        self.optimizer.zero_grad(set_to_none=True)
        iterator = iter(loader)
        index = 0
        while True:
            fetched: list[Any] = []
            for batch in iterator:
                fetched.append(batch)
                if len(fetched) == self.accumulation_steps:
                    break
            if not fetched:
                return
            partial = len(fetched) < self.accumulation_steps
            if partial and self.partial_last_group == "drop":
                self._record_dropped(fetched, count)
                return
            group = self._make_group(index, fetched, count, partial)
            self._group = group
            yield group
            if self._group is group and self._backward_done:
                raise AccumulationError(
                    f"group {index} ran backward but was not stepped: call acc.step() after each group"
                )
            index += 1

    def _record_dropped(self, fetched: list[Any], count: CountFn | None) -> None:
        samples = sum(batch_size(b) for b in fetched)
        tokens = sum(self._count_of(b, count) for b in fetched)
        self.dropped.micro_batches += len(fetched)
        self.dropped.samples += samples
        self.dropped.tokens += tokens
        log.info(
            "dropped the partial last group: %d micro-batches, %d samples, %d counted elements",
            len(fetched),
            samples,
            tokens,
        )

    def _count_of(self, batch: Any, count: CountFn | None) -> int:
        if count is None:
            return batch_size(batch)
        return _as_int(count(batch), "count(micro_batch)")

    def _make_group(self, index: int, fetched: list[Any], count: CountFn | None, partial: bool) -> Group:
        if self.micro_batch_limit is not None:
            # After an OOM fallback every loader micro-batch is cut to the smaller size; the group
            # keeps the same samples, so T and the denominator do not change.
            fetched = [piece for batch in fetched for piece in split_batch(batch, self.micro_batch_limit)]
        sizes = [batch_size(b) for b in fetched]
        counts = [self._count_of(b, count) for b in fetched]
        local = sum(counts)
        denominator, global_samples = self._global_sums(local, sum(sizes))
        group = Group(
            index=index,
            micro_batches=fetched,
            samples=sum(sizes),
            count=local,
            denominator=denominator,
            global_samples=global_samples,
            partial=partial,
            _acc=self,
            _sizes=sizes,
        )
        if self._first_group_samples is None:
            self._first_group_samples = global_samples
        self._warn_small_batchnorm(max(sizes))
        return group

    def _global_sums(self, count: int, samples: int) -> tuple[int, int]:
        if self.world_size == 1:
            return count, samples
        # The exact mean over all replicas needs the global count; one small all-reduce per group,
        # issued before the first backward so it never interleaves with DDP's gradient buckets.
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        if torch.distributed.get_backend() == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        totals = torch.tensor([count, samples], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(totals, group=getattr(self.model, "process_group", None))
        return int(totals[0].item()), int(totals[1].item())

    def _warn_small_batchnorm(self, micro_batch: int) -> None:
        if micro_batch >= SMALL_BATCHNORM_MICRO_BATCH or self._warned_batchnorm:
            return
        layers = batchnorm_layers(self.model)
        if layers:
            self._warned_batchnorm = True
            warnings.warn(
                f"the model has BatchNorm in train mode ({', '.join(layers[:3])}"
                f"{', ...' if len(layers) > 3 else ''}) and micro-batches of {micro_batch} samples: "
                "BatchNorm normalizes each micro-batch with its own statistics, so accumulation does "
                "not reproduce the large batch (consider GroupNorm/LayerNorm or SyncBatchNorm)",
                SmallBatchNormWarning,
                stacklevel=4,  # the user's loop, through groups() or the group's iteration
            )

    def _begin_position(self, group: Group, position: int) -> None:
        if position == 0:
            self._backward_done = set()
            self._count_seen = 0
            self._count_given = False
            scaler = self.scaler if self._scaler_on() else None
            self._group_scale = scaler.get_scale() if scaler is not None else None
        self._position = position

    # -- one micro-batch ------------------------------------------------------------------

    @contextlib.contextmanager
    def micro_step(self) -> Iterator[None]:
        """Context for the forward and backward of one micro-batch of the current group.

        Under DDP, every micro-batch but the group's last runs inside ``model.no_sync()`` so that
        the gradient is all-reduced once per group; the forward must be inside because DDP
        decides at forward time whether the backward will synchronize.

        With ``oom_fallback``, an out-of-memory raised inside is swallowed and the group's
        iteration restarts from its first sample with micro-batches of half the size.

        Raises:
            AccumulationError: used outside a group's iteration, or nested.
        """
        group = self._group
        if group is None:
            raise AccumulationError("micro_step() must be used while iterating a group from acc.groups()")
        if self._in_micro_step:
            raise AccumulationError("micro_step() cannot be nested")
        last = self._position == len(group.micro_batches) - 1
        no_sync = getattr(self.model, "no_sync", None)
        sync_context: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if no_sync is not None and not last and self.world_size > 1:
            sync_context = no_sync()
        self._in_micro_step = True
        try:
            with sync_context:
                yield
        except BaseException as exc:
            if not (self.oom_fallback and is_oom(exc)):
                raise
            size = group._sizes[self._position]
            if size <= 1:
                raise  # nothing smaller to fall back to: the model does not fit at all
            # Only remember the size here: freeing memory waits until the traceback (which pins
            # the failed forward's activations) is gone, i.e. until the group iterator resumes.
            self._oom_pending = size
        finally:
            self._in_micro_step = False

    def backward(self, loss_sum: torch.Tensor, count: int | torch.Tensor | None = None) -> None:
        """Backward of one micro-batch's *summed* loss, divided by the group's denominator.

        Args:
            loss_sum: the loss summed over this micro-batch's supervised elements (e.g.
                ``cross_entropy(..., reduction="sum")``), or over samples when ``groups()`` got no count.
            count: optional, this micro-batch's supervised elements as computed with the loss; the
                group's total is checked against the denominator at :meth:`step`.

        Raises:
            AccumulationError: outside ``micro_step()``, twice for one micro-batch, or a non-scalar loss.
        """
        group = self._check_backward(loss_sum)
        if count is not None:
            self._count_given = True
            self._count_seen += _as_int(count, "count")
        # DDP averages gradients over replicas, so each replica scales by D / global count.
        self._backward_scaled(loss_sum * (self.world_size / max(group.denominator, 1)))

    def backward_mean(self, loss_mean: torch.Tensor) -> None:
        """Backward of one micro-batch's *mean-over-samples* loss (the simple path).

        Weighted by this micro-batch's share of the group's samples, which is ``loss / A`` for
        equal micro-batches and stays exact for a shorter last one. Only exact when the loss is a
        mean over samples; a per-token mean with varying token counts needs :meth:`backward`.

        Raises:
            AccumulationError: as :meth:`backward`.
        """
        group = self._check_backward(loss_mean)
        share = group._sizes[self._position] * self.world_size / max(group.global_samples, 1)
        self._backward_scaled(loss_mean * share)

    def _check_backward(self, loss: torch.Tensor) -> Group:
        group = self._group
        if group is None or not self._in_micro_step:
            raise AccumulationError("backward() must be called inside `with acc.micro_step():`")
        if self._position in self._backward_done:
            raise AccumulationError(
                f"backward() called twice for micro-batch {self._position} of group {group.index}"
            )
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise AccumulationError("backward() needs a scalar loss tensor")
        self._backward_done.add(self._position)
        return group

    def _scaler_on(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def _backward_scaled(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    # -- the update -----------------------------------------------------------------------

    def step(self) -> torch.Tensor | None:
        """End the group: unscale_, clip once, optimizer step, scaler.update, scheduler, zero_grad.

        Returns:
            The total gradient norm before clipping when ``max_grad_norm`` is set, else None.

        Raises:
            AccumulationError: not every micro-batch of the group ran backward, the scale changed
                within the group, or the counts given to backward() disagree with the denominator.
        """
        group = self._group
        if group is None:
            raise AccumulationError("step() must follow a group from acc.groups()")
        missing = len(group.micro_batches) - len(self._backward_done)
        if missing:
            raise AccumulationError(
                f"step() after {len(self._backward_done)} of {len(group.micro_batches)} micro-batches of "
                f"group {group.index}: every micro-batch needs its backward before the update"
            )
        if self._count_given and self._count_seen != group.count:
            raise AccumulationError(
                f"the counts given to backward() sum to {self._count_seen} but the group's count() gave "
                f"{group.count}: the loss is divided by the wrong denominator"
            )
        scaler = self.scaler if self._scaler_on() else None
        if scaler is not None and scaler.get_scale() != self._group_scale:
            raise AccumulationError(
                "the GradScaler's scale changed within a group: let acc.step() call scaler.update()"
            )

        grad_norm: torch.Tensor | None = None
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # clip the true gradient, not the scaled one
        if self.max_grad_norm is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            # Looked up at call time so that tests (and users) can wrap it.
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if scaler is not None:
            scale_before = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            if scaler.get_scale() < scale_before:
                self.counters.skipped_updates += 1
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        self.counters.updates += 1
        self.counters.micro_batches += len(group.micro_batches)
        self.counters.samples += group.samples
        self.counters.tokens += group.count
        self.last_grad_norm = grad_norm
        self._backward_done = set()
        self._group = None
        self._largest_micro_batch = max(self._largest_micro_batch, *group._sizes, 1)
        self._after_update()
        return grad_norm

    def _after_update(self) -> None:
        """Tell an observer with an ``after_update(updates, micro_batch)`` (autotune_client.observer)
        that an update is done: it may report the peak. Its errors are logged, never raised."""
        hook = getattr(self.observe, "after_update", None)
        if hook is None:
            return
        try:
            hook(self.counters.updates, self._largest_micro_batch)
        except Exception:  # telemetry must not stop training
            log.warning("the observer's after_update() failed", exc_info=True)

    # -- OOM fallback ---------------------------------------------------------------------

    def _recover(self, group: Group) -> None:
        old = self._oom_pending
        assert old is not None
        self._oom_pending = None
        # Drop the partial gradients of the failed attempt and whatever the allocator caches.
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

        target = self.target_batch
        if target is None:
            target = self._first_group_samples or old * self.accumulation_steps * self.world_size
        new_plan = make_plan(max_micro_batch=max(1, old // 2), target_batch=target, world_size=1)
        new_micro = new_plan.micro_batch
        # Re-split the group's own samples: the same samples, the same denominator, nothing counted twice.
        pieces = [piece for batch in group.micro_batches for piece in split_batch(batch, new_micro)]
        group.micro_batches = pieces
        group._sizes = [batch_size(p) for p in pieces]
        self._backward_done = set()
        self._count_seen = 0
        self._count_given = False
        self.micro_batch_limit = new_micro
        self.plan = new_plan
        self._largest_micro_batch = 0  # peaks from here on are the smaller micro-batch's
        self.oom_events.append(OomEvent(group.index, old, new_micro, new_plan))
        self._warn_small_batchnorm(new_micro)
        log.warning(
            "out of memory at micro-batch %d in group %d: redoing the group with micro-batch %d "
            "(plan %d x %d x %d = %d for target %d)",
            old,
            group.index,
            new_micro,
            new_plan.micro_batch,
            new_plan.accumulation_steps,
            new_plan.world_size,
            new_plan.effective_batch,
            target,
        )
        if self.on_plan_change is not None:
            self.on_plan_change(new_plan)
        if self.observe is not None:
            observation = Observation(
                micro_batch=old,
                oom=True,
                world_size=self.world_size,
                note=f"out of memory during training; fell back to micro-batch {new_micro}",
            )
            try:
                self.observe(observation)
            except Exception:  # telemetry must not stop a training run that just recovered
                log.warning("observe() failed for an OOM observation", exc_info=True)
