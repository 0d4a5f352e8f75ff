"""The fake meter: the trial under FakeTensorMode, counted the way the CPU meter counts.

Fake tensors have shapes, dtypes and (meta) storages of the right size, but no data and no compute,
so a trial costs the Python dispatch of its ops whatever m, and no memory. Live storage bytes are
counted exactly as on the CPU meter, and crossing the budget raises the same CpuOutOfMemoryError
at the op that crosses it. On the CPU a fake trial's peak equals a real one's byte for byte (a
test checks every example); on CUDA it leaves out what only the device adds (allocator rounding,
kernel workspaces, the CUDA context), which is why real trials confirm the boundary it finds.

Ops that need data:

- Routing (mixture of experts). ``topk``'s indices get values from a stated rule instead of
  data: every row (token) picks k distinct choices (experts) in turn, so each of n experts gets
  rows * k / n (balanced, ``moe_load_factor`` 1.0); with a load factor f > 1 the first expert,
  the busiest, gets round(f * rows * k / n) of them (at most every row) and the others share the
  rest in turn (``routed_indices``). From there, integer and boolean tensors computed from known
  values carry real values beside them (small: tokens x k x experts), so ops whose output size
  depends on data (``nonzero``, ``torch.where(cond)``, boolean indexing, ``masked_select``,
  ``bincount``, ``unique``, ``.item()``/``.tolist()`` of a routing count) get the size a real
  run would give under that routing, and loops over the experts hit run as a real run's would.
  The memory of HF's default ``grouped_mm`` experts does not depend on the spread at all (every
  token-expert pair is one row); where experts run one after another (``eager``), only the
  busiest expert's transient does.
- Scalar reads (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``: ``aten._local_scalar_dense`` and
  ``is_nonzero``) take the branch a healthy real run takes wherever one gates memory. Each gets, in order:

  1. The value, where the tensor carries one: the routing values above, a one-element tensor made from
     constants (``torch.full((), 0.0)``, ``torch.tensor(0.0)``: GradScaler's scale, growth tracker and
     ``found_inf``, an optimizer's step counters, Lightning's SIGTERM flag) and whatever is computed from
     values only (``_amp_update_scale_``, ``step += 1``). A real run reads the same numbers.
  2. What finite numbers answer to a check for inf or NaN: every floating value of a healthy run is
     finite. ``isnan``, ``isinf``, ``isposinf``, ``isneginf`` are False everywhere; a comparison with
     inf, -inf or nan answers what any finite number answers, and ``x == x`` is True (so ``isfinite``,
     which torch decomposes into ``abs(x) != inf`` and ``x == x``, is True everywhere);
     ``_amp_foreach_non_finite_check_and_unscale_`` finds nothing, so ``found_inf`` keeps the 0 it
     was made with. Hence GradScaler's ``found_inf.item()`` reads 0.0 and ``scaler.step`` calls
     ``optimizer.step()``, whose AdamW state is the memory that check gates; ``clip_grad_norm_(...,
     error_if_nonfinite=True)`` does not raise; Lightning's ``isfinite(loss).all()`` holds; the HF
     Trainer's ``isnan(loss) or isinf(loss)`` filter adds the loss; autotune.loop.accumulate counts no
     skipped update (``get_scale()`` reads the scale, unchanged). Safe because a trial's weights are
     finite (trial.py initialises them) and a step skipped for an overflow holds less than a healthy
     one (no optimizer state, nothing new): the healthy branch is the peak a budget must hold.
     The answers are booleans without storage (one value, expanded); an op that combines them
     computes its real output on the host, at most a byte per element of the tensor checked.
  3. Otherwise a placeholder: 1 for integers, 1.0 for floats, False for booleans. On the paths the
     project runs (the trial's loop, GradScaler, clipping, accumulate, the HF Trainer's and
     Lightning's steps) these are data values read for arithmetic or logging only: a loss or a
     gradient norm logged (``tr_loss.item()``, ``grad_norm.item()``), a count of supervised tokens
     divided by (accumulate's ``_as_int``). Memory does not depend on them. A model of one's own
     that branches on such a value (``if (x > t).any():``) to allocate differently can differ from
     a real trial, which is why real trials confirm the boundary.
- Positions. An integer ``arange`` made from constants carries its values (made when first read), and integer
  and boolean tensors computed from values carry theirs (small: a model's position ids are m x L). transformers'
  mask helpers (``transformers.masking_utils``) take the branch they take on real tensors, not the one they take
  for a FakeTensor, which they read as a trace (``is_tracing``): without a cache (``--ac``: a checkpointed step
  keeps none) the model looks for packed sequences in its position ids, and on a trace it cannot read them, so
  it keeps a causal mask of m x L x L booleans and gives up SDPA's ``is_causal``. On real tensors it reads that
  the positions it made itself (``arange``) pack nothing, and makes no mask; so does the fake trial now, from
  the positions' values. Where the values are unknown (position ids or a padding mask from the batch), the
  scalar read gets its placeholder, and the mask is kept, as before (issue 34: a tiny Llama at tp 2 under
  ``--ac full`` read 358,724 bytes against the real trial's 358,468 at m = 1, one 16 x 16 mask a micro-batch).
- Any other op whose output shape depends on data that no rule gives cannot run fake: the trial
  fails with FakeTrialError naming the op, and the probe falls back to real trials.

FakeTensorMode logs an op whose meta function fails before raising; those lines are torch's, not
ours, and are kept from the user's terminal while a fake trial runs (the error itself still says it).
"""

from __future__ import annotations

import functools
import logging
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from autotune.core.errors import AutotuneError
from autotune.core.schemas import Device
from autotune.measure.meters.cpu import CpuMeter, _LiveStorageMode
from autotune.measure.meters.temporaries import KernelFacts, kernel_facts, op_temporaries, unmodelled

__all__ = [
    "computing_values",
    "FakeMeter",
    "FakeTrialError",
    "SCALAR_PLACEHOLDERS",
    "current_load_factor",
    "experts_of",
    "moe_routing",
    "routed_indices",
]

SCALAR_PLACEHOLDERS = {"bool": False, "int": 1, "float": 1.0}

_LOAD_FACTOR: ContextVar[float] = ContextVar("moe_load_factor", default=1.0)
_TOPK = (torch.ops.aten.topk.default,)
# Integer ranges made from constants: their values are known (a model's position ids; the module docstring).
_ARANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)
_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
_EXACT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"

_aten = torch.ops.aten
# A healthy run's answers (module docstring, "Scalar reads"): every floating value is finite.
_NEVER_NON_FINITE = (_aten.isnan.default, _aten.isinf.default, _aten.isposinf.default, _aten.isneginf.default)
# x compared with inf, -inf or nan: every finite x answers the same (isfinite decomposes into abs(x) != inf).
_SCALAR_COMPARISONS = tuple(getattr(_aten, name).Scalar for name in ("eq", "ne", "lt", "le", "gt", "ge"))
# x == x and x != x: the NaN idiom (isfinite's other half).
_SELF_COMPARISONS = (_aten.eq.Tensor, _aten.ne.Tensor)
_FINITENESS_CHECKS = frozenset((*_NEVER_NON_FINITE, *_SCALAR_COMPARISONS, *_SELF_COMPARISONS))
# GradScaler's unscale finds no inf or NaN in the gradients: found_inf keeps the value it was made with.
_FINDS_NONE = (_aten._amp_foreach_non_finite_check_and_unscale_.default,)


class FakeTrialError(AutotuneError):
    """An op of the task cannot run on fake tensors (its output shape depends on data)."""


@contextmanager
def moe_routing(load_factor: float) -> Iterator[None]:
    """Fake trials started inside route by ``routed_indices`` with this load factor (1.0 balanced).

    Raises:
        AutotuneError: load_factor below 1 (no expert is busier than a fair share on average).
    """
    if not load_factor >= 1.0:
        raise AutotuneError(f"moe load factor must be at least 1 (1.0 = balanced routing), got {load_factor}")
    token = _LOAD_FACTOR.set(float(load_factor))
    try:
        yield
    finally:
        _LOAD_FACTOR.reset(token)


def current_load_factor() -> float:
    """The load factor fake trials started here route by (``moe_routing``'s, 1.0 outside it): what a
    process that runs them elsewhere (a lane's worker, an emulated card's child) must route by too."""
    return _LOAD_FACTOR.get()


_EXPERT_COUNT_NAMES = ("num_local_experts", "num_experts", "n_routed_experts")


def experts_of(model: torch.nn.Module) -> tuple[int, int] | None:
    """(experts, top_k) of a mixture-of-experts model, None for a dense one.

    Read from a Hugging Face config (``num_experts_per_tok`` with ``num_local_experts``,
    ``num_experts`` or ``n_routed_experts``: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek, GPT-OSS), else
    from the first module with integer ``num_experts`` and ``top_k`` (a router of one's own).
    """
    config = getattr(model, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    for name in _EXPERT_COUNT_NAMES:
        experts = getattr(config, name, None)
        if isinstance(experts, int) and isinstance(top_k, int) and experts > 1:
            return experts, top_k
    for module in model.modules():
        experts, top_k = getattr(module, "num_experts", None), getattr(module, "top_k", None)
        if isinstance(experts, int) and isinstance(top_k, int) and experts > 1:
            return experts, top_k
    return None


def routed_indices(rows: int, choices: int, k: int, load_factor: float = 1.0) -> torch.Tensor:
    """The routing rule: (rows, k) distinct choices per row, int64.

    Balanced, every choice gets rows * k / choices rows (within one); with load_factor f > 1,
    choice 0 gets round(f * rows * k / choices) (at most rows) and the others share the rest in turn.

    >>> routed_indices(4, 4, 2).tolist()
    [[0, 1], [2, 3], [0, 1], [2, 3]]
    >>> routed_indices(4, 4, 2, 2.0).flatten().bincount().tolist()
    [4, 2, 1, 1]
    """
    flat = torch.arange(rows * k, dtype=torch.int64)
    if load_factor <= 1.0 or k >= choices:
        return (flat % choices).view(rows, k)
    fair = rows * k / choices
    busiest = min(rows, max(int(round(load_factor * fair)), -(-rows * k // choices)))
    others = 1 + flat[: busiest * (k - 1) + (rows - busiest) * k] % (choices - 1)
    loaded = torch.cat(
        [torch.zeros(busiest, 1, dtype=torch.int64), others[: busiest * (k - 1)].view(busiest, k - 1)], 1
    )
    rest = others[busiest * (k - 1) :].view(rows - busiest, k)
    return torch.cat([loaded, rest], 0)


def _routed_like(indices: torch.Tensor, source: torch.Tensor, k: int, dim: int, load_factor: float) -> torch.Tensor:
    dim = dim % max(source.dim(), 1)
    choices = source.shape[dim] if source.dim() else 1
    moved = list(indices.shape)
    moved.append(moved.pop(dim))
    rows = indices.numel() // max(k, 1)
    routed = routed_indices(rows, choices, k, load_factor).view(moved)
    return routed.movedim(-1, dim).contiguous()


def _placeholder(tensor: torch.Tensor) -> bool | int | float:
    if tensor.dtype == torch.bool:
        return SCALAR_PLACEHOLDERS["bool"]
    if tensor.is_floating_point() or tensor.is_complex():
        return SCALAR_PLACEHOLDERS["float"]
    return SCALAR_PLACEHOLDERS["int"]


def _finite_answer(func: Any, args: Any, out: Any) -> torch.Tensor | None:
    """What finite values answer to func, a check of args[0] for inf or NaN: a boolean of out's shape
    without storage (one value, expanded), or None where func is no such check."""
    other = args[1] if len(args) > 1 else None
    if func in _NEVER_NON_FINITE:
        answer = False
    elif func in _SCALAR_COMPARISONS and isinstance(other, float) and not math.isfinite(other):
        with _disable_current_modes():  # 0.0 stands for every finite value
            answer = bool(func(torch.zeros((), dtype=torch.float64), other))
    elif func in _SELF_COMPARISONS and args[0] is other:
        answer = func is _aten.eq.Tensor
    else:
        return None
    with _disable_current_modes():
        return torch.tensor(answer).expand(out.shape)


def _written(func: Any, args: Any, kwargs: Any) -> list[FakeTensor]:
    """The fake tensors func writes to (its schema's ``Tensor(a!)`` arguments)."""
    written: list[FakeTensor] = []
    for index, arg in enumerate(func._schema.arguments):  # positional ones first, as args holds them
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[index] if not arg.kwarg_only and index < len(args) else kwargs.get(arg.name)
        written.extend(item for item in tree_flatten(value)[0] if isinstance(item, FakeTensor))
    return written


@dataclass
class _Recipe:
    """A factory op with no tensor inputs (arange, zeros, full) whose values are made only when a
    routing value needs them (one_hot compares indices with an arange)."""

    func: Any
    args: Any
    kwargs: Any

    def make(self) -> torch.Tensor:
        kwargs = dict(self.kwargs)
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        with _disable_current_modes():
            return self.func(*self.args, **kwargs)  # type: ignore[no-any-return]


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    # torch/_meta_registrations.py: _create_grouped_mm_output_tensor, without CUDA's padding.
    if a.dim() == 2 and b.dim() == 2:
        assert offs is not None
        return [offs.shape[0], a.shape[0], b.shape[1]]
    if a.dim() == 2:
        return [a.shape[0], b.shape[-1]]
    if b.dim() == 2:
        return [a.shape[1], b.shape[1]]
    return [a.shape[0], a.shape[1], b.shape[-1]]


_NUMBER_TYPES = frozenset({"bool", "int", "float", "Scalar", "SymInt", "SymFloat", "SymBool"})


@functools.cache
def _answers_numbers(func: Any) -> bool:
    """Whether func returns Python numbers only (no tensors, and no device or layout: those the values,
    which ride on the CPU, would answer wrongly for a fake tensor on a card)."""
    returns = func._schema.returns
    return bool(returns) and all(str(ret.type).removesuffix("[]") in _NUMBER_TYPES for ret in returns)


def _fallback_grouped_mm(func: Any, args: Any, exc: RuntimeError) -> bool:
    """Whether exc is the meta's bf16-only check refusing a grouped matmul that the device runs: the
    meta follows the fast path's rule (CUDA sm_90, bf16), while ``_grouped_mm``'s fallback (a loop of
    matmuls; pytorch/pytorch#161407 and #162059, in GroupedMMUtils.h) takes fp32 and fp16 on the CPU
    and on CUDA. HF's default experts under bf16 autocast send the weights' fp32 there."""
    return (
        func is torch.ops.aten._grouped_mm.default
        and "Expected inputs of BF16" in str(exc)
        and args[0].device.type in ("cpu", "cuda")
        and args[0].dtype == args[1].dtype
    )


# Set while an op runs again on the values its fake inputs carry, outside every mode (the routing values below):
# what it makes is not the trial's memory, and what steps back into a mode for a span (loss parallel's handlers,
# autotune/measure/tensor_parallel.py) must not count it.
_ON_VALUES: ContextVar[bool] = ContextVar("autotune_fake_on_values", default=False)


@contextmanager
def _on_values() -> Iterator[None]:
    token = _ON_VALUES.set(True)
    try:
        with _disable_current_modes():
            yield
    finally:
        _ON_VALUES.reset(token)


def computing_values() -> bool:
    """Whether ops now run on the values fake tensors carry (the fake meter's value following), not as a trial's
    own ops."""
    return _ON_VALUES.get()


def _on_cpu_values(func: Any, args: Any, kwargs: Any, fake_out: Any) -> Any:
    """func on the CPU values of its inputs; None where the CPU has no kernel for them.

    The values ride on the CPU whatever device the fake tensors claim, and some kernels exist on CUDA
    only for integers (``histc`` of int32 counts: Mixtral's expert counts on a card): those run on the
    values as float64 (counts and indices are exact there) and come back in the fake output's dtype.
    """
    try:
        return func(*args, **kwargs)
    except (RuntimeError, NotImplementedError):
        pass
    flat, spec = tree_flatten((args, kwargs))
    widened = [t.double() if isinstance(t, torch.Tensor) and t.dtype in _EXACT_DTYPES[1:] else t for t in flat]
    try:
        real_args, real_kwargs = tree_unflatten(widened, spec)
        real_out = func(*real_args, **real_kwargs)
    except (RuntimeError, NotImplementedError):
        return None
    fakes = tree_flatten(fake_out)[0]
    reals, out_spec = tree_flatten(real_out)
    cast = [
        real.to(fake.dtype) if isinstance(real, torch.Tensor) and isinstance(fake, torch.Tensor) else real
        for real, fake in zip(reals, fakes, strict=False)
    ]
    return tree_unflatten(cast, out_spec)


def _fake_inputs(args: Any, kwargs: Any) -> list[FakeTensor]:
    """The fake tensors among an op's arguments. An aten op's arguments nest one level at most (a list of tensors:
    cat's, a foreach op's, index's optional indices), so they are read directly; pytree's flatten, which this stands
    for, cost 30 us an op, a tenth of a fake trial, where every op is followed once a value exists. Anything deeper
    goes to it still."""
    found: list[FakeTensor] = []
    for item in (*args, *kwargs.values()):
        for leaf in item if isinstance(item, list | tuple) else (item,):
            if isinstance(leaf, FakeTensor):
                found.append(leaf)
            elif isinstance(leaf, list | tuple | dict):  # deeper than one level
                return [deep for deep in tree_flatten((args, kwargs))[0] if isinstance(deep, FakeTensor)]
    return found


class _FakeCountingMode(_LiveStorageMode):
    """The CPU meter's counting mode over FakeTensorMode: answers scalar reads of fake tensors and
    carries routing values (the module docstring) beside the fake tensors computed from them."""

    def __init__(self, meter: FakeMeter, load_factor: float) -> None:
        super().__init__(meter)
        self.meter: FakeMeter = meter
        self.load_factor = load_factor
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Whether a routing value was made: from then on integer tensors made from constants (an
        # arange to compare indices with) carry values too; before, only scalars do.
        self.routing = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            known = self._value(args[0])
            if known is None:
                return _placeholder(args[0])
            with _disable_current_modes():
                return known.item()
        if func is torch.ops._c10d_functional.wait_tensor.default and isinstance(args[0], FakeTensor):
            # c10d's wait_tensor hands back the tensor it waited on (no new storage); its fake kernel
            # makes a new one, which counted each DTensor collective's output twice (issue 34).
            return args[0]
        if len(self.values) and _answers_numbers(func):
            # A Python answer (bool(t): is_nonzero, equal) is decomposed inside FakeTensorMode into
            # a scalar read that this mode never sees: answer it from the values where there are some.
            inputs = self._real_inputs(args, kwargs, stand_ins=False)
            if inputs is not None:
                with _on_values():
                    return func(*inputs[0], **inputs[1])
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except _DATA_DEPENDENT as exc:
            out = self._sized_by_values(func, types, args, kwargs, exc)
        except RuntimeError as exc:
            if not _fallback_grouped_mm(func, args, exc):
                raise
            out = self._grouped_mm(types, args, kwargs)
        facts = self.meter.kernel_facts
        if facts is not None:
            steps = op_temporaries(func, args, facts)
            if steps:
                self.meter._ledger.scratch(steps)
                if self.meter.recorder is not None:
                    self.meter.recorder.note_peak(self.meter._ledger.peak_bytes, f"{func} (the kernel's workspace)")
            left_out = unmodelled(func)
            if left_out is not None:
                self.meter.unmodelled.add(left_out)
        observer = getattr(self.meter, "op_observer", None)
        if observer is not None:  # the step's predicted time counts the op (autotune/measure/op_counter.py)
            observer(func, args, kwargs, out)
        if func in _TOPK:
            source, k = args[0], args[1]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            with _disable_current_modes():  # real values, outside FakeTensorMode
                self.values[out[1]] = _routed_like(out[1], source, k, dim, self.load_factor)
            self.routing = True
        elif func in _FINDS_NONE:
            pass  # found_inf keeps its value; the gradients it scaled carry none
        elif (
            func in _FINITENESS_CHECKS
            and isinstance(args[0], FakeTensor)
            and args[0] not in self.values
            and ((healthy := _finite_answer(func, args, out)) is not None)
        ):
            self.values[out] = healthy
        elif len(self.values) or func in _ARANGES or (isinstance(out, FakeTensor) and out.numel() <= 1):
            self._follow(func, args, kwargs, out)
        return out

    def _value(self, tensor: torch.Tensor) -> torch.Tensor | None:
        known = self.values.get(tensor)
        if isinstance(known, _Recipe):
            known = self.values[tensor] = known.make()
        return known

    def _real_inputs(self, args: Any, kwargs: Any, *, stand_ins: bool) -> tuple[Any, Any, bool] | None:
        """args and kwargs with every fake tensor replaced by its values; where one has none, by a
        storage-free stand-in of its shape (stand_ins) or None. Also whether all had values."""
        flat, spec = tree_flatten((args, kwargs))
        real: list[Any] = []
        complete = True
        for item in flat:
            if isinstance(item, FakeTensor):
                known = self._value(item)
                if known is None:
                    if not stand_ins:
                        return None
                    complete = False
                    with _disable_current_modes():  # a real tensor, outside FakeTensorMode
                        known = torch.empty((), dtype=item.dtype).expand(item.shape)
                real.append(known)
            elif isinstance(item, torch.device):
                real.append(torch.device("cpu"))
            else:
                real.append(item)
        real_args, real_kwargs = tree_unflatten(real, spec)
        return real_args, real_kwargs, complete

    def _follow(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Give out the values func gives on the values of its inputs, where all have them."""
        fakes = _fake_inputs(args, kwargs)
        if not fakes:
            if isinstance(out, FakeTensor) and (
                out.numel() <= 1 or (out.dtype in _EXACT_DTYPES and (self.routing or func in _ARANGES))
            ):
                self.values[out] = _Recipe(func, args, kwargs)
            return
        if not any(fake in self.values for fake in fakes):
            return
        inputs = self._real_inputs(args, kwargs, stand_ins=False)
        real_out = None
        if inputs is not None:
            with _on_values():
                real_out = _on_cpu_values(func, inputs[0], inputs[1], out)
        if real_out is None:
            # Written to by what has no values (or by what no CPU kernel computes): forget theirs.
            if func._schema.is_mutable:
                for fake in _written(func, args, kwargs):
                    self.values.pop(fake, None)
            return
        for fake, real in zip(tree_flatten(out)[0], tree_flatten(real_out)[0], strict=False):
            if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor) and self._keeps(real):
                self.values[fake] = real

    def _keeps(self, real: torch.Tensor) -> bool:
        """Whether a value computed from values is kept: every one once routing began; before, integers, booleans
        and scalars (a model's rotary tables computed from its positions would be m x L x head_dim floats on the
        host, read by no scalar read)."""
        return self.routing or real.dtype in _EXACT_DTYPES or real.numel() <= 1

    def _empty_like(self, types: Any, real: torch.Tensor, device: torch.device) -> torch.Tensor:
        return super().__torch_dispatch__(  # type: ignore[no-any-return]
            torch.ops.aten.empty_strided.default,
            types,
            (list(real.shape), list(real.stride())),
            {"dtype": real.dtype, "device": device},
        )

    def _sized_by_values(self, func: Any, types: Any, args: Any, kwargs: Any, exc: Exception) -> Any:
        """An op whose output size depends on data: run it on the values its inputs carry (stand-ins
        without storage for those that carry none, whose values cannot change a size), and make fake
        outputs of the sizes it gives."""
        inputs = self._real_inputs(args, kwargs, stand_ins=True)
        fakes = _fake_inputs(args, kwargs)
        if inputs is None or not any(fake in self.values for fake in fakes):
            raise FakeTrialError(
                f"{func} cannot run on fake tensors ({type(exc).__name__}: its output depends on data)"
            ) from None
        real_args, real_kwargs, complete = inputs
        with _on_values():
            real_out = func(*real_args, **real_kwargs)
        device = fakes[0].device
        flat, spec = tree_flatten(real_out)
        made: list[Any] = []
        for real in flat:
            if isinstance(real, torch.Tensor):
                fake = self._empty_like(types, real, device)
                if complete:
                    self.values[fake] = real
                made.append(fake)
            else:
                made.append(real)
        return tree_unflatten(made, spec)

    def _grouped_mm(self, types: Any, args: Any, kwargs: Any) -> torch.Tensor:
        """torch's meta for _grouped_mm checks the fast path's bf16-only rule; the fallback multiplies fp32
        (an fp32 model under bf16 autocast: transformers casts the input to the weights' dtype)."""
        a, b = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        dtype = kwargs.get("out_dtype") or a.dtype
        return super().__torch_dispatch__(  # type: ignore[no-any-return]
            torch.ops.aten.empty.memory_format,
            types,
            (_grouped_mm_shape(a, b, offs),),
            {"dtype": dtype, "device": a.device},
        )


@contextmanager
def _eager_mask_helpers() -> Iterator[None]:
    """transformers' mask helpers read a FakeTensor as a trace (``is_tracing``) and skip the scalar reads an eager
    run makes (the module docstring, "Positions"): while a fake trial runs, a FakeTensor is not a trace to them;
    dynamo, jit and stream capture still are. Only where transformers is imported already (an hf: task loads it
    before its trials)."""
    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "is_tracing", None)
    if module is None or original is None:
        yield
        return

    def is_tracing(tensor: Any = None) -> bool:
        return bool(original(None if isinstance(tensor, FakeTensor) else tensor))

    module.is_tracing = is_tracing  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.is_tracing = original  # type: ignore[attr-defined]


@contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    logger = logging.getLogger(_FAKE_TENSOR_LOG)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class FakeMeter(CpuMeter):
    """Fake-tensor trials on device_type ("cpu", or "cuda" where this torch has CUDA) under a budget.

    Args:
        budget_bytes: required; crossing it raises CpuOutOfMemoryError at the op that crosses it.
        device_type: the device the fake tensors claim to be on ("cpu", "cuda", "cuda:N"); it
            decides which kernels and autocast lists the ops take.
        device_name: what describe() reports (an estimate is labelled with the card it is for).
    """

    def __init__(self, budget_bytes: int | None, device_type: str = "cpu", device_name: str | None = None) -> None:
        super().__init__(budget_bytes)
        device = torch.device(device_type)
        if device.type not in ("cpu", "cuda"):
            raise AutotuneError(f"device kind must be cpu or cuda, got {device_type!r}")
        self.device = device if device.type == "cpu" or device.index is not None else torch.device("cuda", 0)
        self.device_name = device_name or device.type
        # Tensors made outside the mode (a batch built by the task, a loss's constant) are allowed
        # and turned fake on use.
        self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        # On CUDA: what the kernels' temporaries depend on (autotune/measure/meters/temporaries.py), read
        # when the first trial starts (the device is not touched before).
        self.kernel_facts: KernelFacts | None = None
        # What the CUDA kernels of the ops run so far take that no rule gives (UNMODELLED), for a warning.
        self.unmodelled: set[str] = set()
        # Told of every op the trial dispatches, with its inputs and outputs, where a step's time is counted
        # (autotune/measure/op_counter.py); None the rest of the time.
        self.op_observer: Callable[[Any, Any, Any, Any], None] | None = None

    def _account(self, tensors: Any, what: Any) -> None:
        """On CUDA only the device's storages count: a batch built on the host (the task's ``batch``
        before it is moved) or an optimizer's step counter is host memory on a card."""
        if self.device.type == "cuda":
            if type(tensors) is FakeTensor or type(tensors) is torch.Tensor:
                if tensors.device.type == "cpu":
                    return
            else:
                leaves = tree_flatten(tensors)[0]
                tensors = [t for t in leaves if not isinstance(t, torch.Tensor) or t.device.type != "cpu"]
        super()._account(tensors, what)

    def describe(self) -> Device:
        return Device(
            kind=self.device.type,  # type: ignore[arg-type]
            name=self.device_name,
            index=None,
            total_bytes=self.budget_bytes,
            torch_version=torch.__version__,
        )

    @contextmanager
    def _counting(self) -> Iterator[None]:
        if self.device.type == "cuda" and self.kernel_facts is None:
            self.kernel_facts = kernel_facts(self.device)
        with _quiet_fake_tensor_log(), self._fake_mode, self._storage_resizes(), _eager_mask_helpers():
            with _FakeCountingMode(self, _LOAD_FACTOR.get()):
                yield
