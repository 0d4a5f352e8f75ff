"""ProbeTask: how a user describes the job to probe, and loading one from "file.py:name".

A task is a recipe, not a model: the probe builds a fresh model and optimizer per trial so that
every measurement starts from the same state.

    task = ProbeTask(
        name="my-gpt",
        model=lambda: GPT(cfg),
        batch=lambda m: {"input_ids": torch.randint(0, 256, (m, 128))},
        precision="bf16",
        tags={"seq_len": 128},
    )
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autotune.core.compositions import Dimensions, refuse_composition
from autotune.core.errors import TaskError
from autotune.core.loss_names import LOSS_TAG, PLAIN_LOSS, canonical_loss
from autotune.core.mesh import Mesh
from autotune.core.policy_names import canonical_policy
from autotune.core.schemas import OFFLOADS, PRECISIONS, Precision, TagValue
from autotune.core.setup import JobSetup
from autotune.tasks.losses import WithLoss
from autotune.tasks.optimizers import SpecOptimizer, optimizer_factory
from autotune.tasks.tp_plan import TP_PLAN_NAMES

__all__ = [
    "DTYPES",
    "ZERO_GRAD_MODES",
    "LossFn",
    "LossSumFn",
    "ModelFactory",
    "OptimizerFactory",
    "SDPA_BACKENDS",
    "ProbeTask",
    "compile_modes",
    "default_loss",
    "takes_model",
    "weights_dtype_refusal",
]

ModelFactory = Callable[[], nn.Module]
# batch(m) or, for a sequence-aware task, batch(m, seq_len=L).
BatchFactory = Callable[..., Any]
LossFn = Callable[[nn.Module, Any], torch.Tensor]
# factory(model.parameters()), or factory(model) when its first parameter is named ``model`` (see
# :func:`takes_model`): configure_optimizers-style parameter groups.
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
# loss_sum(model, batch) -> (summed loss, count of supervised elements): what exact accumulation needs.
LossSumFn = Callable[[nn.Module, Any], tuple[torch.Tensor, "int | torch.Tensor"]]


# The weights' dtypes a task can hold its model in (``ProbeTask.weights_dtype``).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What ``optimizer.zero_grad`` does after each step: "none" (set_to_none=True, PyTorch's default: the gradients
# are freed until the next backward makes them) or "keep" (set_to_none=False: zeroed in place, held all the time).
ZERO_GRAD_MODES = ("none", "keep")
# The tags the task writes itself (a user's own tags of these names would be replaced).
_OWN_TAGS = ("weights_dtype", "optimizer_spec", "zero_grad", "compile", "offload", "tp_plan", "sdpa_backend", LOSS_TAG)
# The kernels --sdpa-backend makes scaled_dot_product_attention run (torch.nn.attention.SDPBackend by name).
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


@functools.cache
def compile_modes() -> tuple[str, ...]:
    """The ``torch.compile`` modes the installed torch has (``torch._inductor.list_mode_options``), for
    ``ProbeTask.compile`` and ``--compile MODE``. Imports inductor: call it only when compile is asked for."""
    from torch._inductor import list_mode_options

    return tuple(list_mode_options())


@dataclass(frozen=True)
class _BuiltIn:
    """A model factory run with torch's default dtype set to the weights' dtype (what transformers'
    ``from_config(dtype=)`` and ``from_pretrained(dtype=)`` do): every parameter and buffer the factory
    makes without naming a dtype is made in it, and what names one (rotary ``inv_freq`` in fp32, peft's
    fp32 adapters over a bf16 base) keeps its own. Every path that calls ``task.model()`` (meta
    builds, the fingerprint, trials, fleet workers) gets the same model."""

    factory: ModelFactory
    weights_dtype: str

    def __call__(self) -> nn.Module:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(DTYPES[self.weights_dtype])
        try:
            return self.factory()
        finally:
            torch.set_default_dtype(previous)


def weights_dtype_refusal(weights_dtype: str, device: torch.device) -> str | None:
    """Why ``device`` cannot hold weights of that dtype (a line naming the flag), or None when it can.
    CPUs hold all three (torch 2.x has bf16 and fp16 kernels for them); a CUDA card holds bf16 from
    compute capability 8.0 (Ampere) on."""
    if weights_dtype != "bf16" or device.type != "cuda" or not torch.cuda.is_available():
        return None
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return (
        f"--weights-dtype bf16: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) "
        "has no bf16 arithmetic; use --weights-dtype fp16 or fp32"
    )


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with PyTorch's defaults: what most recipes start from."""
    return torch.optim.AdamW(params, lr=1e-3)


def takes_model(factory: Callable[..., Any]) -> bool:
    """Whether an optimizer factory takes the model rather than its parameters: its first parameter is
    named ``model`` (``def configure_optimizers(model): ...``). A name, not a trial call: an optimizer
    class called with a module fails only when it iterates it, and a factory given parameters where it
    wanted the model fails deep inside the user's code; any other name (``params``, ``ps``) gets
    ``model.parameters()``, as every factory did before."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a C callable without a signature: a class of parameters
        return False
    return bool(parameters) and parameters[0].name == "model"


@dataclass
class ProbeTask:
    """One job setup to probe.

    Args:
        name: shown in datasheets and the dashboard.
        model: zero-argument factory returning a fresh nn.Module.
        batch: batch(m) returns one micro-batch of m samples: a tensor or a nested
            dict/tuple/list of tensors, made on the CPU; the probe moves it to the device.
        loss: loss(model, batch) -> scalar tensor; None uses :func:`default_loss`.
        optimizer: a factory taking the parameters, or the model when its first parameter is named
            ``model`` (:func:`takes_model`: parameter groups by name, as nanoGPT's configure_optimizers);
            or a spec ``NAME[:key=value,...]`` (autotune/tasks/optimizers.py: ``"AdamW:fused=true"``,
            ``"adafactor"``, ``"adamw8bit"``); None is AdamW. A spec that says more than a class name is
            the tag ``optimizer_spec`` (the profile carries it).
        precision: "fp32", "bf16" (autocast) or "fp16" (autocast with GradScaler).
        tags: free-form facts that change memory (seq_len, checkpointing, ...); they enter the fingerprint.
        loss_sum: optional loss_sum(model, batch) -> (summed loss, supervised count), used by
            ``autotune verify`` and the accumulator for exact group normalization (token losses).
        shard_classes: the block classes ``--strategy fsdp`` shards one by one; None shards every
            child of every nn.ModuleList in the model.
        activation_checkpointing: the memory policy of the trials (autotune/measure/policies.py):
            "none", "every-K" (every K-th block recomputes its forward, K >= 2), "full" (every block),
            "op" (op-level, torchtitan's rule) or "op:OP/OP/..." (op-level, saving the named ops'
            outputs); the blocks are the ones ``--strategy fsdp`` shards.
        seq_len: the sequence length this task's batches are made at, for a sequence-aware task
            (one whose ``batch`` takes a ``seq_len`` keyword: ``batch(m, seq_len=L)``) bound to one
            length by :meth:`at_length`; None otherwise.
        source: the spec :func:`load_task` loaded it from (another process can load it again:
            autotune/search/lanes.py); None for a task built in Python.
        weights_dtype: "fp32", "bf16" or "fp16": the dtype the model is held in, its gradients and
            optimizer state following (a bf16 fine-tune); ``model()`` runs with torch's default dtype
            set to it. Distinct from ``precision`` (autocast over the weights). Not fp32: the tag
            ``weights_dtype`` says it (the fingerprint and the profile carry it).
        zero_grad: "none" (``zero_grad(set_to_none=True)``, PyTorch's default) or "keep"
            (``set_to_none=False``: the gradients stay allocated between steps); "keep" is the tag ``zero_grad``.
        offload: "none", "activations" (the blocks' saved activations in host memory, through
            ``torch.autograd.graph.save_on_cpu``) or "params" (FSDP2's CPUOffloadPolicy, ``--strategy fsdp``
            only): autotune/measure/offload.py. Not "none": the tag ``offload`` (the fingerprint carries it, so
            an offloaded profile never answers a plain job).
        compile: None (eager), or a ``torch.compile`` mode ("default", "reduce-overhead", "max-autotune", ...:
            :func:`compile_modes`): the trials run the model compiled in that mode (docs/compile.md); a mode is
            the tag ``compile`` (the fingerprint and the profile carry it, an eager task's stay what they were).
        tp_plan: the tensor-parallel plan of ``--tp`` (autotune/measure/tensor_parallel.py): module name
            patterns (``*`` for a block's index) to a style of transformers' names ("colwise", "rowwise",
            "colwise_gather_output", ...) or a torch ParallelStyle; or a plan's name (``--tp-plan``: "hf",
            transformers' own; "torchtitan", sequence and loss parallel for the model's family:
            autotune/tasks/tp_plan.py); None takes the model's own (an ``hf:`` model's ``_tp_plan``). Not read
            without ``--tp``.
        lm_loss: how a causal LM's forward computes its loss (``--loss``; autotune/core/loss_names.py):
            "plain" (the model's own: the logits whole), "chunked:N" (TRL's chunked NLL, N tokens per chunk) or
            "fused-linear" (Liger's fused linear cross entropy): autotune/tasks/losses.py replaces the model's
            forward. Not plain: the tag ``lm_loss`` (the fingerprint and the profile carry it).

    A sequence-aware task is probed at the lengths asked for (``--seq-len``): its fingerprint leaves
    the length out, and each profile records it.
    """

    name: str
    model: ModelFactory
    batch: BatchFactory
    loss: LossFn | None = None
    optimizer: OptimizerFactory | str | None = None
    precision: Precision = "fp32"
    tags: dict[str, TagValue] = field(default_factory=dict)
    loss_sum: LossSumFn | None = None
    shard_classes: tuple[type[nn.Module], ...] | None = None
    activation_checkpointing: str = "none"
    seq_len: int | None = None
    source: str | None = None
    weights_dtype: str = "fp32"
    zero_grad: str = "none"
    offload: str = "none"
    compile: str | None = None
    tp_plan: Mapping[str, Any] | str | None = None
    # The kernel scaled_dot_product_attention runs (SDPA_BACKENDS: flash, efficient, cudnn, math), forced with
    # torch.nn.attention.sdpa_kernel around each forward; None: the one torch picks for the inputs and device.
    sdpa_backend: str | None = None
    # The longest sequence the model takes (an hf: config's max_position_embeddings); None: no limit known. A
    # length past it is refused before any trial, and the longest-length search stops there and says so.
    max_seq_len: int | None = None
    lm_loss: str = PLAIN_LOSS

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise TaskError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        try:  # the canonical spelling, as profiles record it (the ops of op:... are checked when applied)
            self.activation_checkpointing = canonical_policy(self.activation_checkpointing)
        except ValueError as exc:
            raise TaskError(f"activation checkpointing: {exc}") from None
        if not callable(self.model) or not callable(self.batch):
            raise TaskError("ProbeTask needs callables for model and batch")
        if self.weights_dtype not in DTYPES:
            raise TaskError(f"weights dtype must be one of {', '.join(DTYPES)}, got {self.weights_dtype!r}")
        refuse_composition(Dimensions(weights_dtype=self.weights_dtype, precision=self.precision), TaskError)
        try:
            self.lm_loss = canonical_loss(self.lm_loss)
        except ValueError as exc:
            raise TaskError(f"--loss {exc}") from None
        # dataclasses.replace hands the wrapped factory back: unwrap it, then wrap for this dtype and loss.
        factory = self.model
        while isinstance(factory, (_BuiltIn, WithLoss)):
            factory = factory.factory
        self.model = factory if self.weights_dtype == "fp32" else _BuiltIn(factory, self.weights_dtype)
        if self.lm_loss != PLAIN_LOSS:
            self.model = WithLoss(self.model, self.lm_loss)
        if self.zero_grad not in ZERO_GRAD_MODES:
            raise TaskError(f"zero_grad must be one of {', '.join(ZERO_GRAD_MODES)}, got {self.zero_grad!r}")
        if isinstance(self.optimizer, str):
            self.optimizer = optimizer_factory(self.optimizer, flag="optimizer")
        tags = {key: value for key, value in self.tags.items() if key not in _OWN_TAGS}
        if self.weights_dtype != "fp32":
            tags["weights_dtype"] = self.weights_dtype
        if isinstance(self.optimizer, SpecOptimizer) and not self.optimizer.spec.bare_class:
            tags["optimizer_spec"] = self.optimizer.spec.text
        if self.zero_grad != "none":
            tags["zero_grad"] = self.zero_grad
        if self.offload not in OFFLOADS:
            raise TaskError(f"--offload {self.offload!r}: not an offload; use one of {', '.join(OFFLOADS)}")
        if self.offload != "none":
            tags["offload"] = self.offload
        self._check_compile()
        if self.compile is not None:
            tags["compile"] = self.compile
        if isinstance(self.tp_plan, str) and self.tp_plan not in TP_PLAN_NAMES:
            raise TaskError(f"--tp-plan {self.tp_plan!r}: not a plan's name; use one of {', '.join(TP_PLAN_NAMES)}")
        if self.tp_plan == "torchtitan":  # the datasheet names the plan (hf's is the default, untagged)
            tags["tp_plan"] = self.tp_plan
        if self.sdpa_backend is not None:
            if self.sdpa_backend not in SDPA_BACKENDS:
                kernels = ", ".join(SDPA_BACKENDS)
                raise TaskError(f"--sdpa-backend {self.sdpa_backend!r}: not an attention kernel; use one of {kernels}")
            tags["sdpa_backend"] = self.sdpa_backend  # another kernel holds other memory: another fingerprint
        if self.lm_loss != PLAIN_LOSS:
            tags[LOSS_TAG] = self.lm_loss  # the plain loss adds no tag: its fingerprints stay
        if tags != self.tags:
            self.tags = tags

    def _check_compile(self) -> None:
        if self.compile is not None and (not isinstance(self.compile, str) or self.compile not in compile_modes()):
            raise TaskError(
                f"--compile {self.compile!r}: not a torch.compile mode of torch {torch.__version__} "
                f"(modes: {', '.join(compile_modes())})"
            )
        dims = Dimensions(activation_checkpointing=self.activation_checkpointing, compile=self.compile)
        refuse_composition(dims, TaskError)

    @property
    def sequence_aware(self) -> bool:
        """Whether ``batch`` takes a ``seq_len`` keyword (``batch(m, seq_len=L)``)."""
        return _takes_seq_len(self.batch)

    def at_length(self, seq_len: int) -> ProbeTask:
        """This sequence-aware task with its batches made at seq_len (``batch(m)`` then means
        ``batch(m, seq_len=seq_len)``), for every part of the probe that knows only m.

        Raises:
            TaskError: the task is not sequence-aware, or seq_len is not a positive integer.
        """
        if not self.sequence_aware:
            raise TaskError(
                f"task {self.name!r} is not sequence-aware: its batch has no seq_len keyword "
                f"(write batch(m, seq_len=L) to probe it at --seq-len {seq_len})"
            )
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise TaskError(f"sequence length must be a positive integer, got {seq_len!r}")
        return dataclasses.replace(self, batch=functools.partial(self.batch, seq_len=seq_len), seq_len=seq_len)

    def with_setup(self, setup: JobSetup) -> ProbeTask:
        """This task under the setup's precision, memory policy and offload where the setup gives them (None: the
        task's own): how a worker or the emulated child applies the setup it received whole
        (autotune/core/setup.py) to the task it loaded from its spec."""
        changes = {
            name: getattr(setup, name)
            for name in ("precision", "activation_checkpointing", "offload", "sdpa_backend", "lm_loss")
            if getattr(setup, name) is not None and getattr(setup, name) != getattr(self, name)
        }
        if setup.tp_plan_name is not None and setup.tp_plan_name != self.tp_plan:
            changes["tp_plan"] = setup.tp_plan_name
        return dataclasses.replace(self, **changes) if changes else self

    def job_setup(self, *, strategy: str = "ddp", world_size: int = 1, mesh: Mesh | None = None) -> JobSetup:
        """The setup a worker or the emulated child receives for this task (its precision, policy and offload, as
        :meth:`with_setup` applies them there) under the strategy, world size and mesh. Not validated: the config
        that runs the job refuses a setup no job runs, in its own words."""
        return JobSetup.model_construct(
            strategy=strategy,
            world_size=world_size,
            mesh=mesh or Mesh(),
            precision=self.precision,
            activation_checkpointing=self.activation_checkpointing,
            offload=self.offload,
            tp_plan_name=self.tp_plan if isinstance(self.tp_plan, str) else None,
            sdpa_backend=self.sdpa_backend,
            lm_loss=self.lm_loss,
        )

    def make_optimizer(self, model: nn.Module | Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The task's optimizer over ``model`` (its parameters, or the model itself for a factory that
        takes it: :func:`takes_model`). Given parameters only, a factory that takes the model is refused.

        Raises:
            TaskError: a factory that takes the model was given parameters.
        """
        factory: OptimizerFactory | str = self.optimizer or default_optimizer
        assert not isinstance(factory, str)  # __post_init__ made a spec a factory
        if takes_model(factory):
            if not isinstance(model, nn.Module):
                raise TaskError(f"the optimizer of task {self.name!r} takes the model; it was given parameters")
            return factory(model)
        return factory(model.parameters() if isinstance(model, nn.Module) else model)

    @property
    def zero_grad_to_none(self) -> bool:
        """What ``optimizer.zero_grad(set_to_none=...)`` gets after each step."""
        return self.zero_grad == "none"

    def _attention_kernel(self) -> AbstractContextManager[Any]:
        """The forward's context: scaled_dot_product_attention made to run ``sdpa_backend``'s kernel (its backward
        is the same kernel's, chosen by the forward), or nothing."""
        if self.sdpa_backend is None:
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[self.sdpa_backend]))

    def compute_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        try:
            with self._attention_kernel():
                loss = (self.loss or default_loss)(model, batch)
        except _ForwardNeedsMore as exc:  # the default loss could not call the model: say which task
            raise TaskError(f"task {self.name!r}: {exc}") from None
        except RuntimeError as exc:
            if self.sdpa_backend is None or not any(
                refused in str(exc) for refused in ("No available kernel", "No viable backend")
            ):
                raise
            # The kernel asked for cannot take this attention (head size, dtype, grouped heads, a mask, the device).
            raise TaskError(
                f"--sdpa-backend {self.sdpa_backend}: scaled_dot_product_attention has no {self.sdpa_backend} kernel "
                f"for the attention of task {self.name!r} on this device (torch found none): choose another backend"
            ) from None
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TaskError(f"loss(model, batch) of task {self.name!r} must return a scalar tensor, got {shape}")
        return loss


def _takes_seq_len(batch: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(batch).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    param = parameters.get("seq_len")
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


class _ForwardNeedsMore(TaskError):
    """The model's forward has required arguments the default loss does not pass (targets, say)."""


def _call_model(model: nn.Module, inputs: Any) -> Any:
    args, kwargs = ((), dict(inputs)) if isinstance(inputs, Mapping) else ((inputs,), {})
    missing = _missing_arguments(model, args, kwargs)
    if missing:
        # Called anyway it fails with a TypeError at every micro-batch, which reads like a model that
        # cannot train on one sample; what is missing is a loss that passes the targets.
        raise _ForwardNeedsMore(
            f"{type(model).__name__}.forward needs {', '.join(missing)}, which the default loss does not pass "
            "(it calls model(inputs) on an (inputs, targets) pair, model(**batch) on a dict): give the task a "
            "loss that passes them (loss=lambda model, batch: model(*batch) where forward returns the loss)"
        )
    return model(*args, **kwargs)


def _missing_arguments(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The required parameters of the model's forward that (args, kwargs) leaves unbound."""
    inner: Any = model
    while True:  # through DDP's and torch.compile's wrappers to the user's forward
        if isinstance(inner, nn.parallel.DistributedDataParallel):
            inner = inner.module
        elif type(inner).__name__ == "OptimizedModule" and isinstance(getattr(inner, "_orig_mod", None), nn.Module):
            inner = inner._orig_mod
        else:
            break
    try:
        signature = inspect.signature(inner.forward)
        bound = signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):  # no signature, or too many arguments: the call itself will say
        return []
    required = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    return [
        name
        for name, param in signature.parameters.items()
        if param.kind in required and param.default is param.empty and name not in bound.arguments
    ]


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A loss from the model's own output, for tasks that give none.

    - a dict batch is passed as keyword arguments; an output with a ``loss`` (attribute or key) uses it;
    - an (inputs, targets) pair: cross-entropy for integer targets, mean squared error otherwise;
    - anything else: the mean of the output, which still back-propagates through every activation.
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
        inputs, targets = batch
        out = _call_model(model, inputs)
        logits = _output_tensor(out)
        if not targets.is_floating_point():
            return nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
        return nn.functional.mse_loss(logits.float(), targets.float())
    out = _call_model(model, batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    return _output_tensor(out).float().mean()


def _output_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = out.get(key) if isinstance(out, Mapping) else getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TaskError(f"cannot derive a loss from a model output of type {type(out).__name__}: give the task a loss")
