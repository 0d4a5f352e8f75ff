"""A stable digest of what decides training memory, and nothing else.

In: the module tree (qualified names and class names), parameter and buffer shapes, dtypes and
requires_grad, the input signature of one sample (shapes without the batch dimension, dtypes),
the optimizer class and its memory-relevant options, precision, tags, torch major.minor.
Out: ids, addresses, timestamps, device placement, weight values, learning rates.

The same model built in two processes gives the same digest; a changed shape, dtype, optimizer
or tag gives another.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autotune.core.mesh import Mesh
from autotune.core.setup import JobSetup
from autotune.tasks.optimizers import optimizer_factory
from autotune.tasks.task import OptimizerFactory, ProbeTask, default_optimizer, takes_model
from autotune.tasks.tp_plan import tp_plan_label, tp_plan_of

__all__ = [
    "LIBRARY_MEMORY_OPTIONS",
    "MEMORY_RELEVANT_OPTIONS",
    "SEQ_DIM",
    "describe_setup",
    "fingerprint_model",
    "job_setup_of",
    "sequence_signature",
    "task_fingerprint",
]

# Optimizer options that change how much state it keeps or how it steps (foreach/fused change the
# step's temporaries). Learning rates, betas and the like do not change memory.
MEMORY_RELEVANT_OPTIONS = ("amsgrad", "foreach", "fused", "capturable", "centered", "nesterov")
# The low-bit and factored optimizers' own options that change their state's bytes, read from the
# optimizer's defaults, its attributes (torchao keeps block_size on the optimizer) or bitsandbytes' ``args``.
# None is in torch.optim's defaults, so torch's optimizers digest as they did.
LIBRARY_MEMORY_OPTIONS = (
    "optim_bits",
    "min_8bit_size",
    "block_wise",
    "is_paged",
    "block_size",
    "bf16_stochastic_round",
    "beta1",
    "scale_parameter",
    "relative_step",
)
# Libraries whose optimizer classes share a name with another's (bitsandbytes' and torchao's AdamW8bit,
# transformers' and torch's Adafactor) and differ in memory: the digest names the library for these.
_OPTIMIZER_LIBRARIES = ("bitsandbytes", "torchao", "transformers")


def _class_name(obj: Any) -> str:
    # The qualified name without the module: the same class loaded as examples.gpt or from
    # examples/gpt.py (a module name the loader makes up) must give the same digest.
    cls = obj if isinstance(obj, type) else type(obj)
    return cls.__qualname__


def _modules(model: nn.Module) -> list[list[str]]:
    return [[name, _class_name(module)] for name, module in model.named_modules()]


def _tensors(model: nn.Module) -> dict[str, list[list[Any]]]:
    params = [[name, list(p.shape), str(p.dtype), bool(p.requires_grad)] for name, p in model.named_parameters()]
    buffers = [[name, list(b.shape), str(b.dtype)] for name, b in model.named_buffers()]
    return {"parameters": params, "buffers": buffers}


# What a dimension that follows the sequence length reads in a sequence-aware signature.
SEQ_DIM = "L"
# The two lengths a sequence-aware task's batch is made at to tell which dimensions follow L: small
# (cheap to make), and of no meaning beyond that.
_PROBE_LENGTHS = (16, 24)


def _signature(batch: Any, seq_len: int | None = None) -> Any:
    """Shapes without the batch dimension, and dtypes, keeping the nesting; with seq_len, each
    dimension equal to it reads ``"L"`` (a sequence-aware job's signature leaves its length out)."""
    if isinstance(batch, torch.Tensor):
        dims = [SEQ_DIM if seq_len is not None and d == seq_len else int(d) for d in batch.shape[1:]]
        return {"shape": dims, "dtype": str(batch.dtype)}
    if isinstance(batch, Mapping):
        return {str(key): _signature(batch[key], seq_len) for key in sorted(batch, key=str)}
    if isinstance(batch, (tuple, list)):
        return [_signature(value, seq_len) for value in batch]
    return type(batch).__name__


def _masked(at_one: Any, at_other: Any) -> Any:
    """The signature at one length with every dimension that differs at the other read as "L"."""
    if isinstance(at_one, dict) and isinstance(at_other, dict) and "shape" in at_one and "shape" in at_other:
        shape = [
            SEQ_DIM if d != e else d for d, e in zip(at_one["shape"], at_other["shape"], strict=False)
        ]
        return {**at_one, "shape": shape}
    if isinstance(at_one, dict) and isinstance(at_other, dict):
        return {key: _masked(value, at_other.get(key)) for key, value in at_one.items()}
    if isinstance(at_one, list) and isinstance(at_other, list):
        return [_masked(a, b) for a, b in zip(at_one, at_other, strict=False)]
    return at_one


def sequence_signature(task: ProbeTask) -> Any:
    """A sequence-aware task's input signature with L left out: batch(1) made at two lengths, and
    the dimensions that differ between them read "L" (the client reads every dimension equal to the
    job's seq_len as "L": the two agree unless a fixed dimension equals the job's length)."""
    short, long = (_signature(task.batch(1, seq_len=length)) for length in _PROBE_LENGTHS)
    return _masked(short, long)


def _library_option(optimizer: torch.optim.Optimizer, key: str) -> Any:
    if key in optimizer.defaults:
        return optimizer.defaults[key]
    args = getattr(optimizer, "args", None)  # bitsandbytes keeps optim_bits, min_8bit_size, ... there
    if args is not None and hasattr(args, key):
        return getattr(args, key)
    return getattr(optimizer, key, None)


def _optimizer(asked: OptimizerFactory | str | None, model: nn.Module) -> dict[str, Any]:
    # A throwaway parameter: building the optimizer on the real model would be harmless, but the
    # class and its defaults are all the digest needs. A factory that takes the model (its parameter
    # groups by name) gets the model the digest was built from (meta: no state is made before a step).
    given: OptimizerFactory | str = asked or default_optimizer
    factory: OptimizerFactory = optimizer_factory(given) if isinstance(given, str) else given
    if takes_model(factory):
        optimizer = factory(model)
    else:
        optimizer = factory([nn.Parameter(torch.zeros(1))])
    options: dict[str, Any] = {}
    for key in MEMORY_RELEVANT_OPTIONS:
        if key in optimizer.defaults:
            options[key] = optimizer.defaults[key]
    momentum = optimizer.defaults.get("momentum")
    if momentum is not None:  # SGD/RMSprop keep a momentum buffer only when momentum != 0
        options["momentum_buffer"] = bool(momentum)
    library = type(optimizer).__module__.partition(".")[0]
    if library not in _OPTIMIZER_LIBRARIES:
        return {"class": _class_name(optimizer), "options": options}
    for key in LIBRARY_MEMORY_OPTIONS:
        value = _library_option(optimizer, key)
        if value is not None:
            options[key] = _plain(value)
    return {"class": _class_name(optimizer), "library": library, "options": options}


def _plain(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


def describe_setup(
    model: nn.Module,
    example_batch: Any,
    *,
    optimizer: OptimizerFactory | str | None = None,
    precision: str = "fp32",
    tags: Mapping[str, Any] | None = None,
    seq_len: int | None = None,
    signature: Any = None,
) -> dict[str, Any]:
    """The canonical description that the fingerprint hashes (useful to see why two differ).

    With seq_len (a sequence-aware job), the example batch's dimensions equal to seq_len read "L"
    and the description says the job is sequence-aware; ``signature`` gives the input signature
    ready-made instead (the probe's, see :func:`sequence_signature`).
    """
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    sequence_aware = seq_len is not None or signature is not None
    if signature is None:
        signature = _signature(example_batch, seq_len)
    described = {
        "modules": _modules(model),
        "tensors": _tensors(model),
        "input": signature,
        "optimizer": _optimizer(optimizer, model),
        "precision": precision,
        "tags": {str(k): _plain(v) for k, v in sorted((tags or {}).items())},
        "torch": f"{major}.{minor}",
    }
    # Only sequence-aware setups carry the key: every other fingerprint stays what it was.
    if sequence_aware:
        described["sequence_aware"] = True
    return described


def fingerprint_model(
    model: nn.Module,
    example_batch: Any,
    *,
    optimizer: OptimizerFactory | str | None = None,
    precision: str = "fp32",
    tags: Mapping[str, Any] | None = None,
    seq_len: int | None = None,
    signature: Any = None,
) -> str:
    """Hex sha256 of the job setup.

    Args:
        model: the model instance (its device does not matter; its dtypes do).
        example_batch: a batch of one sample (the leading batch dimension is dropped).
        optimizer: the optimizer factory, or a spec ``NAME[:key=value,...]`` (autotune/tasks/optimizers.py);
            None: AdamW, the probe's default.
        precision: "fp32", "bf16" or "fp16".
        tags: the task's free-form tags.
        seq_len: for a sequence-aware job, its sequence length: the fingerprint leaves it out
            (dimensions of the example equal to it read "L"), so one fingerprint serves every length.
        signature: the input signature ready-made (the probe's for a sequence-aware task).

    Example:
        >>> fingerprint_model(nn.Linear(4, 2), torch.zeros(1, 4))[:8]  # doctest: +SKIP
        '3f1c...'
    """
    setup = describe_setup(
        model,
        example_batch,
        optimizer=optimizer,
        precision=precision,
        tags=tags,
        seq_len=seq_len,
        signature=signature,
    )
    canonical = json.dumps(setup, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _build_for_fingerprint(task: ProbeTask) -> nn.Module:
    # The meta device gives shapes and dtypes without allocating; some factories need real memory.
    try:
        with torch.device("meta"):
            return task.model()
    except Exception:
        return task.model()


def job_setup_of(
    task: ProbeTask,
    *,
    strategy: str = "ddp",
    world_size: int = 1,
    mesh: Mesh | None = None,
    model: nn.Module | None = None,
) -> JobSetup:
    """The setup's part a fingerprint reads (autotune/core/setup.py): the strategy, world size and mesh, and under
    tp the plan the job applies: the task's own, else an hf: model's (transformers' ``_tp_plan``)."""
    mesh = mesh or Mesh()
    plan = None
    if mesh.tp > 1:
        plan = tp_plan_label(tp_plan_of(model if model is not None else _build_for_fingerprint(task), task))
    # Not validated here: the config that runs the job refuses a mesh the world does not divide, in its own words.
    return JobSetup.model_construct(strategy=strategy, world_size=world_size, mesh=mesh, tp_plan=plan)


def task_fingerprint(task: ProbeTask, *, strategy: str = "ddp", world_size: int = 1, mesh: Mesh | None = None) -> str:
    """The fingerprint of a ProbeTask: its model, batch(1), optimizer, precision and tags, and the setup's part
    (``JobSetup.fingerprint_tags``): under ``fsdp`` the strategy and the world size, since each rank's memory
    depends on them (a ddp fingerprint stays what it was, so that profiles stored before strategies still
    match), a mesh with its resolved tp plan. A
    sequence-aware task's leaves the length out (:func:`sequence_signature`), bound to one or not.
    The memory policy (``activation_checkpointing``) is left out too: a setup's policies share one
    fingerprint, each profile says its policy, and ``/suggest`` finds them side by side."""
    model = _build_for_fingerprint(task)
    setup = job_setup_of(task, strategy=strategy, world_size=world_size, mesh=mesh, model=model)
    tags: dict[str, Any] = {**task.tags, **setup.fingerprint_tags()}
    if task.sequence_aware:
        signature = sequence_signature(task)
        return fingerprint_model(
            model, None, optimizer=task.optimizer, precision=task.precision, tags=tags, signature=signature
        )
    return fingerprint_model(model, task.batch(1), optimizer=task.optimizer, precision=task.precision, tags=tags)
