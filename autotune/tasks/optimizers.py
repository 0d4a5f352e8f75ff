"""Optimizer specs: ``NAME[:key=value,...]``, what ``--optimizer`` and ``ProbeTask(optimizer="...")`` take.

    torch.optim.AdamW:fused=true     AdamW:foreach=false     SGD:momentum=0.9
    adafactor                        adamw8bit               adamw4bit:block_size=64

NAME is a ``torch.optim`` class (any case), ``package.module.Class``, or one of the recipes people name:

- ``adafactor``: transformers' ``Adafactor`` with the HF Trainer's settings for ``optim="adafactor"``
  (``scale_parameter=False, relative_step=False``, ``warmup_init=False``, lr 5e-5, TrainingArguments'
  default; transformers' ``trainer_optimizer._get_adafactor``). transformers' class, not
  ``torch.optim.Adafactor``: it is what a Trainer job runs, and the two differ in memory (transformers'
  steps a bf16 parameter through an fp32 copy, keeps no first moment without ``beta1``);
  ``torch.optim.Adafactor`` is still there by its class name;
- ``adamw8bit``: bitsandbytes' ``AdamW8bit`` (the Trainer's ``adamw_bnb_8bit``, the 8-bit Adam of the HF
  single-GPU guide): blockwise 8-bit moments, fp32 state for tensors under ``min_8bit_size`` (4096) elements;
- ``adamw4bit``: torchao's ``AdamW4bit`` (the Trainer's ``adamw_torch_4bit``; bitsandbytes has no 4-bit
  states). torchao steps each parameter through ``torch.compile(fullgraph=True)``, so a job with any
  ``torchao.optim`` class is measured as a compiled job is (:func:`compiled_step`): on the CPU by the allocator's
  own count (``CompiledCpuMeter``; exact against the ordinary loop), with no fake pre-search, one device. On fake
  tensors (``autotune estimate``, an emulated card) dynamo does not trace, so the fake trial runs torchao's own
  step eagerly (:func:`eager_step`): its states built by its own constructors (``OptimState4bit.zeros``: codes
  packed two a byte, an fp32 scale per block, the 16-entry code table), its ``single_param_adam`` op by op; what
  that leaves out is said on the datasheet (:func:`eager_step_note`). The rest is refused in one line
  (:func:`refuse_compiled_step`): under the CPU's dispatch meter dynamo compiles no frame ("found no compiled
  frames"); over ddp replicas it is measured as on one device (DDP's buckets beside it) and under fsdp over
  FSDP2's DTensor shards and under tp, each against real gloo ranks; over a pipeline's stages and under cp not
  yet (the composition table says so: autotune/core/compositions.py).

Under ``--strategy fsdp`` or ``--tp`` the parameters are DTensors; bitsandbytes' update ops
(``bitsandbytes.optimizer_update_32bit``, ``optimizer_update_8bit_blockwise``) have no DTensor sharding rule,
so ``adamw8bit`` cannot step them, in the job as in the probe: the composition table
(autotune/core/compositions.py, from :func:`optimizer_library`) says so before any work.

Values are typed: ``true``/``false``, ``none``, integers, numbers; nothing else (an optimizer's memory
options are flags and sizes). Keys are checked against the class's signature before any work.

:func:`parse_optimizer_spec` imports nothing (the CLI checks a spec before it imports torch);
:func:`optimizer_factory` imports the class.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.core.errors import TaskError

if TYPE_CHECKING:
    import torch

__all__ = [
    "OPTIMIZER_RECIPES",
    "OptimizerSpec",
    "SpecOptimizer",
    "optimizer_factory",
    "parse_optimizer_spec",
    "compiled_step",
    "eager_step",
    "eager_step_note",
    "optimizer_library",
    "optimizer_text",
    "refuse_compiled_step",
]

OptionValue = bool | int | float | None


@dataclass(frozen=True)
class _Recipe:
    """A named optimizer: the class (module, name), the settings it is built with, the library and
    how to get it."""

    module: str
    class_name: str
    settings: dict[str, OptionValue] = field(default_factory=dict)
    install: str = "pip install 'autotune[hf]'"

    @property
    def library(self) -> str:
        return self.module.partition(".")[0]


OPTIMIZER_RECIPES = {
    "adafactor": _Recipe(
        "transformers.optimization",
        "Adafactor",
        {"scale_parameter": False, "relative_step": False, "warmup_init": False, "lr": 5e-5},
    ),
    "adamw8bit": _Recipe("bitsandbytes.optim", "AdamW8bit"),
    "adamw4bit": _Recipe("torchao.optim", "AdamW4bit"),
}


def _value_text(value: OptionValue) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


@dataclass(frozen=True)
class OptimizerSpec:
    """A parsed spec: the name as written and its options in the order given."""

    name: str
    options: tuple[tuple[str, OptionValue], ...] = ()

    @property
    def text(self) -> str:
        """The canonical spelling (``AdamW:fused=true``), what an hf: spec and the task's tag carry."""
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{key}={_value_text(value)}" for key, value in self.options)

    @property
    def recipe(self) -> _Recipe | None:
        return OPTIMIZER_RECIPES.get(self.name.lower())

    @property
    def bare_class(self) -> bool:
        """A class name and nothing else: what ``--optimizer`` took before specs (its fingerprint is the
        class's, with no tag, so that profiles stored then still match)."""
        return not self.options and self.recipe is None


def _typed(flag: str, key: str, text: str) -> OptionValue:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return int(lowered)
    except ValueError:
        pass
    try:
        number = float(lowered)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise TaskError(f"{flag}: {key}={text!r}: a value is true, false, none, an integer or a finite number")
    return number


def parse_optimizer_spec(text: str, *, flag: str = "--optimizer") -> OptimizerSpec:
    """``NAME[:key=value,...]`` parsed, values typed; no import.

    >>> parse_optimizer_spec("torch.optim.AdamW:fused=true,eps=1e-6").options
    (('fused', True), ('eps', 1e-06))

    Raises:
        TaskError: one line naming the flag, the key and the rule (no name, a key without ``=``, a key
            given twice, a value that is not true/false/none/an integer/a number).
    """
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise TaskError(f"{flag} {text!r}: NAME[:key=value,...] with NAME a class (AdamW, module.Class) or a recipe")
    options: list[tuple[str, OptionValue]] = []
    for item in rest.split(",") if rest.strip() else ():
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals or not key.isidentifier() or not value.strip():
            raise TaskError(f"{flag} {text!r}: option {item.strip()!r} is not key=value")
        if key in dict(options):
            raise TaskError(f"{flag} {text!r}: option {key} is given twice")
        options.append((key, _typed(flag, key, value)))
    return OptimizerSpec(name, tuple(options))


class SpecOptimizer:
    """The optimizer factory of a spec: ``factory(params)`` builds ``cls(params, **kwargs)``.

    ``spec`` says what was asked (the task's tag and the hf: spec carry ``spec.text``)."""

    def __init__(self, spec: OptimizerSpec, cls: type[torch.optim.Optimizer], kwargs: dict[str, OptionValue]):
        self.spec, self.cls, self.kwargs = spec, cls, kwargs

    def __call__(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"SpecOptimizer({self.spec.text!r})"


def _import_class(spec: OptimizerSpec, flag: str) -> type[Any]:
    import torch

    recipe = spec.recipe
    if recipe is not None:
        module_name, class_name = recipe.module, recipe.class_name
    elif "." in spec.name:
        module_name, _, class_name = spec.name.rpartition(".")
    else:
        known = {key.lower(): value for key, value in vars(torch.optim).items() if isinstance(value, type)}
        cls = known.get(spec.name.lower())
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TaskError(
                f"{flag} {spec.name!r} is not a torch.optim.Optimizer class (e.g. AdamW, SGD, or module.Class) "
                f"nor a recipe ({', '.join(OPTIMIZER_RECIPES)})"
            )
        return cls
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or a library that fails while loading (a missing native part)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        hint = f" ({recipe.install})" if recipe is not None else ""
        raise TaskError(f"{flag} {spec.name}: cannot import {module_name}: {first}{hint}") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TaskError(f"{flag} {spec.name!r}: {module_name}.{class_name} is not a torch.optim.Optimizer class")
    return cls


# Libraries whose optimizers cannot step under the probe's meters, and why (one line each).
_UNMEASURABLE: dict[str, str] = {}


def _check_keys(spec: OptimizerSpec, cls: type[Any], kwargs: dict[str, OptionValue], flag: str) -> None:
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a class without a readable signature: its own error will say
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return
    known = [name for name, p in parameters.items() if name != "params" and p.kind is not p.VAR_POSITIONAL]
    for key in kwargs:
        if key not in known:
            raise TaskError(f"{flag} {spec.text}: {cls.__name__} takes no option {key!r} (it takes {', '.join(known)})")


def optimizer_factory(
    spec: str | OptimizerSpec, *, lr: float | None = None, flag: str = "--optimizer"
) -> SpecOptimizer:
    """The factory a spec names, built once on a throwaway parameter so that a refusal comes now.

    Args:
        spec: ``NAME[:key=value,...]`` or a parsed one.
        lr: the learning rate (``--lr``); the spec's own ``lr=`` wins over it.
        flag: the flag the messages name.

    Raises:
        TaskError: one line: the spec's grammar, an unknown class or recipe, a library that does not
            import here (with the cause and how to install it), an option the class does not take, or
            the class refusing the options.
    """
    import torch

    parsed = parse_optimizer_spec(spec, flag=flag) if isinstance(spec, str) else spec
    cls = _import_class(parsed, flag)
    why = _UNMEASURABLE.get(cls.__module__.partition(".")[0])
    if why is not None:
        raise TaskError(f"{flag} {parsed.text}: {why}")
    kwargs: dict[str, OptionValue] = dict(parsed.recipe.settings) if parsed.recipe is not None else {}
    if lr is not None:
        kwargs["lr"] = lr
    kwargs.update(parsed.options)
    _check_keys(parsed, cls, dict(parsed.options), flag)
    factory = SpecOptimizer(parsed, cls, kwargs)
    try:
        factory([torch.nn.Parameter(torch.zeros(1))])
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        given = ", ".join(f"{key}={_value_text(value)}" for key, value in kwargs.items()) or "its defaults"
        raise TaskError(f"{flag} {parsed.text}: {cls.__name__} cannot be built with {given}: {first}") from None
    return factory


# Libraries whose optimizers cannot step DTensor parameters (FSDP2's shards, tensor parallelism), and why.
def optimizer_library(optimizer: object) -> str | None:
    """The library a spec's optimizer class comes from ("torch", "bitsandbytes", "torchao", ...); None for a
    factory of the user's (not known before its first step). The composition table reads it
    (autotune/core/compositions.py: bitsandbytes under DTensor)."""
    if not isinstance(optimizer, SpecOptimizer):
        return None
    return optimizer.cls.__module__.partition(".")[0]


def optimizer_text(optimizer: object) -> str | None:
    """The spec as asked (``adamw8bit``, ``AdamW:fused=true``); None for a factory of the user's."""
    return optimizer.spec.text if isinstance(optimizer, SpecOptimizer) else None


# Libraries whose optimizers step through torch.compile (what the probe must measure as a compiled job).
_COMPILED_STEP = {
    "torchao": "torchao's low-bit optimizers step through torch.compile(fullgraph=True), one parameter a call"
}


def compiled_step(optimizer: object) -> str | None:
    """What compiles the optimizer's step (torchao's), None for an eager one or a factory of the user's."""
    if not isinstance(optimizer, SpecOptimizer):
        return None
    return _COMPILED_STEP.get(optimizer.cls.__module__.partition(".")[0])


def refuse_compiled_step(optimizer: object, *, allocator_count: bool, fake: bool = False) -> None:
    """Refuse, in one line, a compiled step (:func:`compiled_step`) where it is not measured: anywhere but a meter
    that counts what the allocator hands out (``allocator_count``: the CPU's ``CompiledCpuMeter``, a card's caching
    allocator) or fake trials (``fake``: the step run eagerly, :func:`eager_step`). Under more than one rank the
    composition table refuses it (autotune/core/compositions.py).

    Raises:
        TaskError: naming the spec and the cause.
    """
    why = compiled_step(optimizer)
    if why is None:
        return
    assert isinstance(optimizer, SpecOptimizer)
    if not (allocator_count or fake):
        raise TaskError(
            f"--optimizer {optimizer.spec.text}: {why}, which runs on the CPU (--device cpu, measured by the "
            "allocator's own count), on a card, or eagerly on fake tensors (autotune estimate, an emulated card), "
            "not under the CPU's dispatch meter (dynamo compiles no frame there)"
        )


# torchao's code tables (lru_cached Python lists, built with .tolist(): a data-dependent read fake tensors cannot
# answer): built here, on real tensors, before a fake step first asks for them.
_TORCHAO_TABLES = ("torchao.optim.subclass_4bit", "torchao.optim.subclass_8bit")


def _warm_code_tables() -> None:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # real tensors: outside FakeTensorMode and every counting mode
        for name in _TORCHAO_TABLES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for attribute, value in vars(module).items():
                if attribute.startswith("get_qmap") and hasattr(value, "cache_info"):
                    value()


def _uncompiled(model: Any = None, **_options: Any) -> Any:
    """``torch.compile`` as the identity: the function itself, run op by op (also as a decorator factory)."""
    return model if model is not None else (lambda fn: fn)


@contextlib.contextmanager
def eager_step(optimizer: object) -> Iterator[None]:
    """Around a fake trial's optimizer step: a compiled step (:func:`compiled_step`, torchao's) runs eagerly, op by
    op, on the fake tensors, where dynamo does not trace (``fullgraph=True`` then fails: "found no compiled
    frames"). torchao's step calls ``torch.compile(single_param_adam, ...)(...)`` per parameter: for the span,
    ``torch.compile`` hands back the function itself, so the states are built by torchao's own constructors and
    updated by its own ops; its code tables are built first, on real tensors. Nothing for any other optimizer."""
    if compiled_step(optimizer) is None:
        yield
        return
    import torch

    _warm_code_tables()
    compile_ = torch.compile
    torch.compile = _uncompiled  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = compile_


def eager_step_note(optimizer: object) -> str | None:
    """What a fake trial of a compiled step measured and what it assumed (the datasheet's warning), None for
    another optimizer."""
    why = compiled_step(optimizer)
    if why is None:
        return None
    assert isinstance(optimizer, SpecOptimizer)
    return (
        f"--optimizer {optimizer.spec.text}: {why}; the fake trials ran it eagerly, op by op: its states are "
        "torchao's own (built by its constructors); the step's temporaries are its eager ops', assumed to stand for "
        "the buffers of the kernels torch.compile makes of them (on the CPU the eager ops hold 24 bytes per element "
        "of the parameter stepped for fp32, 28 for bf16, inductor's kernels 26; a card's Triton kernels are not "
        "measured)"
    )
