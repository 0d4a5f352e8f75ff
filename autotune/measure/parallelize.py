"""A job's parallel dimensions applied to one rank's model: one applier per dimension, called by one :func:`compose`
in torchtitan's fixed order (its ``parallelize_llama``: tp, then cp, then fsdp or ddp):

1. **tp** (:func:`apply_tp`): the model's tensor-parallel plan over the tp sub-mesh
   (autotune/measure/tensor_parallel.py), a pipeline stage's modules only where a stage is cut;
2. **cp**: the context-parallel strategy's own hooks (each forward entered under torch's ``context_parallel``,
   autotune/measure/context_parallel.py), over the tp-parallelized modules;
3. **fsdp** (:func:`apply_fsdp`): FSDP2's ``fully_shard`` of each block then the root over the shard mesh (dp, or dp
   and cp flattened), with the precision's ``MixedPrecisionPolicy`` and ``--offload params``' ``CPUOffloadPolicy``;
   or **ddp** (:func:`apply_ddp`): DDP itself where a real group is given, else the gradient buckets its reducer
   would allocate (:func:`hold_ddp_buckets`).

The memory policy and activation offload are the model's own transforms, applied where it is built
(autotune/measure/trial.py's ``build_model``) before ``compose``, so FSDP2 wraps checkpointed blocks as torchtitan's
``apply_ac`` before ``apply_fsdp`` leaves them; a pipeline stage is cut before (autotune/measure/pipeline/). Each
strategy (autotune/measure/strategies.py, context_parallel.py, pipeline/stages.py) builds its meshes once in its process
group (autotune/measure/layout.py) and says which dimensions it has in a :class:`Parallelism`; a new dimension is an
applier here, a field there, and a rule in the composition table (autotune/core/compositions.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autotune.core.errors import AutotuneError, TaskError
from autotune.tasks.task import ProbeTask

__all__ = [
    "FSDP_MIN_TORCH",
    "LOW_PRECISION",
    "Composed",
    "Parallelism",
    "apply_ddp",
    "apply_fsdp",
    "apply_tp",
    "compose",
    "fsdp_api",
    "grads_as_local_shards",
    "hold_ddp_buckets",
    "is_fake",
    "shard_units",
]

FSDP_MIN_TORCH = "2.6"
LOW_PRECISION = {"bf16": torch.bfloat16, "bf16-autocast": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Parallelism:
    """The dimensions one rank's model is composed of, with the meshes its strategy's process group built.

    ``data`` is how the data-parallel dimension holds the model: "fsdp" shards it over ``shard_mesh``; "ddp"
    replicates it over ``replicas`` ranks (1: no DDP at all), with DDP itself over ``group`` when the model is real
    and a group is given (``comm_hook`` registered on it), else DDP's buckets alone. ``tp_mesh``: the tp sub-mesh
    (None: no tp). ``context``: the cp strategy's hooks, installed after tp. ``not_held``: the ids of the
    parameters a pipeline stage does not hold (left on ``meta``: not parallelized, ignored by FSDP2)."""

    data: str = "ddp"
    replicas: int = 1
    tp_mesh: Any = None
    shard_mesh: Any = None
    group: Any = None
    comm_hook: Callable[..., Any] | None = None
    context: Callable[[nn.Module], None] | None = None
    not_held: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Composed:
    """The composed model (DDP's wrapper where DDP itself wraps it) and the tp styles applied (empty without tp)."""

    model: nn.Module
    styles: dict[str, Any]


def compose(model: nn.Module, task: ProbeTask, device: torch.device, parallelism: Parallelism) -> Composed:
    """model with each of parallelism's dimensions applied in the fixed order: tp, cp, then fsdp or ddp."""
    styles: dict[str, Any] = {}
    if parallelism.tp_mesh is not None:
        styles = apply_tp(model, task, parallelism.tp_mesh, parallelism.not_held)
    if parallelism.context is not None:
        parallelism.context(model)
    if parallelism.data == "fsdp":
        # A shard mesh cut from a larger mesh (tp's or cp's) finds this rank's coordinates on its rank map, which
        # the fake trials' modes would make fake (_mesh_coordinates_outside_fake_modes says why).
        cut = parallelism.tp_mesh is not None or parallelism.context is not None
        with _mesh_coordinates_outside_fake_modes() if cut and is_fake(model) else nullcontext():
            apply_fsdp(model, task, device, parallelism.shard_mesh, parallelism.not_held)
        return Composed(model, styles)
    if parallelism.tp_mesh is not None and parallelism.replicas > 1:
        grads_as_local_shards(model)
    wrapped = apply_ddp(
        model, device, replicas=parallelism.replicas, group=parallelism.group, comm_hook=parallelism.comm_hook
    )
    return Composed(wrapped, styles)


def grads_as_local_shards(model: nn.Module) -> None:
    """Each DTensor parameter's gradient kept as the parameter's own shard, as torch's TP + DDP keeps it
    (``DistributedDataParallel(device_mesh=dp)``: ``_pre_dp_module_transform`` makes each parameter its local tensor
    and rebuilds the DTensor with ``from_local`` in every forward, whose backward hands the gradient back in the
    parameter's placements, its local shard). Without DDP a gradient keeps the placement its op's backward gives:
    a row-wise embedding's weight gradient comes back Replicate, the whole table on every tp rank (a tiny hf Llama's
    under --cp 2 --tp 2 over ddp: 32,768 B where the job holds its 16,384 B shard). Fed to the gradient before it
    is accumulated: the redistributed shard is copied out, so the gradient holds no more than its shard."""
    from torch.distributed.tensor import DTensor

    def as_shard(param: Any) -> Callable[[Any], Any]:
        def hook(grad: Any) -> Any:
            if not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(param.placements):
                return grad
            local = grad.redistribute(param.device_mesh, param.placements).to_local().clone()
            return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)

        return hook

    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_hook(as_shard(param))


def apply_tp(model: nn.Module, task: ProbeTask, tp_mesh: Any, not_held: frozenset[int] = frozenset()) -> dict[str, Any]:
    """model parallelized in place over the tp ranks of ``tp_mesh`` with its plan (transformers' plan, torchtitan's
    by name, or the task's own), checked against the whole model first; the styles of the modules the rank holds
    applied (a stage's: those with a parameter it holds, or none at all). Returns the whole checked plan, by module
    name (whether it shards the sequence or the loss is the plan's, not the stage's)."""
    from autotune.measure.tensor_parallel import apply_tp_plan, check_tp_plan

    styles = check_tp_plan(model, task, tp_mesh.size())
    held = styles
    if not_held:
        held = {}
        for name, style in styles.items():
            params = list(model.get_submodule(name).parameters())
            if not params or any(id(p) not in not_held for p in params):
                held[name] = style
    apply_tp_plan(model, tp_mesh, held)
    return styles


def apply_fsdp(
    model: nn.Module, task: ProbeTask, device: torch.device, mesh: Any, not_held: frozenset[int] = frozenset()
) -> None:
    """FSDP2 over ``mesh`` as torchtitan's ``apply_fsdp`` wraps a model: each block a unit (the last one not resharded
    after forward: backward gathers it first, so freeing it would only gather it again at once), then the root; the
    precision's MixedPrecisionPolicy (parameters cast when gathered, gradients reduced in fp32); under
    ``--offload params`` FSDP2's CPUOffloadPolicy (pinned on a card). A stage's parameters it does not hold are
    ignored, and a unit with none of its own is left out."""
    fully_shard, mixed_precision_policy = fsdp_api()
    ignored = {p for p in model.parameters() if id(p) in not_held}
    units = shard_units(model, task.shard_classes)
    if ignored:
        units = [unit for unit in units if any(p not in ignored for p in unit.parameters())]
    elif not units:
        raise TaskError(
            f"--strategy fsdp found no block to shard in {type(model).__name__} of task {task.name!r}: "
            "it has no nn.ModuleList; name the block classes in the task (ProbeTask(shard_classes=(Block,)))"
        )
    kwargs: dict[str, Any] = {"mesh": mesh}
    low = LOW_PRECISION.get(task.precision)
    if low is not None:
        kwargs["mp_policy"] = mixed_precision_policy(param_dtype=low, reduce_dtype=torch.float32)
    if task.offload == "params":  # FSDP2's CPUOffloadPolicy (autotune/measure/offload.py), pinned on a card
        from torch.distributed.fsdp import CPUOffloadPolicy

        pin = device.type == "cuda" and not is_fake(model) and torch.cuda.is_available()
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
    for index, unit in enumerate(units):
        fully_shard(unit, reshard_after_forward=index < len(units) - 1, **kwargs)
    fully_shard(model, ignored_params=ignored or None, **kwargs)


def apply_ddp(
    model: nn.Module,
    device: torch.device,
    *,
    replicas: int,
    group: Any = None,
    comm_hook: Callable[..., Any] | None = None,
) -> nn.Module:
    """ddp over ``replicas`` ranks: nothing for one; DDP itself over ``group`` where the model is real and a group is
    given (over gloo, with an all-reduce that returns once gloo has let go of the bucket: autotune/measure/
    gloo_released.py); otherwise the gradient buckets DDP's reducer would allocate (a fake model cannot go through DDP's
    constructor, which broadcasts the weights; tp's trials hold them for the reason strategies.TensorParallel
    gives)."""
    if replicas <= 1:
        return model
    if group is None or is_fake(model):
        hold_ddp_buckets(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    options: dict[str, Any] = {}
    if group.size() == 1 and "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters:
        # The probe's group of one process has no rank to agree with: no broadcast of the weights at construction.
        # Over gloo that broadcast's flat buffer (every parameter's bytes) was freed by gloo's worker thread, out of
        # the meter's sight, 4 compiled probes in 30 under load: every trial read it (122,368 bytes) high.
        options["init_sync"] = False
    replicated = DistributedDataParallel(model, device_ids=device_ids, process_group=group, **options)
    if comm_hook is not None:
        replicated.register_comm_hook(None, comm_hook)
    elif group.name() == "gloo":
        # Its buckets freed where DDP drops them, not when gloo's worker thread gets round to it (gloo_released.py).
        from autotune.measure.gloo_released import released_allreduce

        replicated.register_comm_hook(group, released_allreduce)
    return replicated


def hold_ddp_buckets(model: nn.Module) -> None:
    """Hold on ``model`` the gradient buckets DDP's reducer would allocate for it (strategies.FakeReplicas says why
    and how they are cut): one flat tensor per dtype and device of its trainable parameters, made from a
    parameter, so that under the fake mode they are fake tensors on its device, counted as DDP's are.

    A DTensor parameter (``--tp``) counts its local shard: DDP over a tensor-parallel model
    (``DistributedDataParallel(device_mesh=dp)``, torch's ``_pre_dp_module_transform``) swaps each DTensor for
    its local tensor before it builds the reducer. A parameter left on ``meta`` (one a pipeline stage does not
    hold) is not the stage's: DDP over the stage never sees it."""
    numel: dict[tuple[torch.dtype, torch.device], int] = {}
    first: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.requires_grad or parameter.is_meta:
                continue
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter  # a DTensor's shard
            key = (local.dtype, local.device)
            numel[key] = numel.get(key, 0) + local.numel()
            first.setdefault(key, local)
        buckets = [first[key].new_empty((count,)) for key, count in numel.items()]
    model._autotune_ddp_buckets = buckets  # type: ignore[assignment]


def fsdp_api() -> tuple[Any, Any]:
    """fully_shard and MixedPrecisionPolicy, or a one-line error where this torch lacks them or the fake process
    group (fake_group.fake_process_group's store)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 - checked here, used there
    except ImportError as exc:
        raise AutotuneError(
            f"--strategy fsdp needs torch >= {FSDP_MIN_TORCH} with torch.distributed "
            f"(fully_shard and the fake process group); this torch is {torch.__version__}: {exc}"
        ) from None
    return fully_shard, MixedPrecisionPolicy


def is_fake(model: nn.Module) -> bool:
    """Whether the model's parameters are fake, a DTensor's by its local shard (under torchtitan's tp plan every
    parameter is a DTensor, the norms' too)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(getattr(p, "_local_tensor", p), FakeTensor) for p in model.parameters())


def shard_units(model: nn.Module, shard_classes: tuple[type[nn.Module], ...] | None) -> list[nn.Module]:
    """The modules FSDP2 wraps one by one: instances of shard_classes when given, else every child of
    every nn.ModuleList (the repeated blocks of most models)."""
    if shard_classes:
        units = [m for m in model.modules() if isinstance(m, shard_classes) and m is not model]
    else:
        units = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m.children()]
    return units


@contextmanager
def _mesh_coordinates_outside_fake_modes() -> Iterator[None]:
    """FSDP2 over a tp mesh concatenates the dp and tp meshes (``DeviceMesh._concatenate``, once per
    parameter), and the new mesh finds this rank's coordinates with ``(mesh == rank).nonzero()``. Under
    the fake trials' FakeTensorMode that mesh tensor (made from the real rank map) is fake and nonzero's
    size depends on its values, so the fake trial stopped there. The coordinates are bookkeeping on the
    host (a few integers, gone before the first micro-batch): computed outside the modes, on the real
    rank map, they are the real job's."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import _disable_current_modes

    original = DeviceMesh._compute_coordinate_on_dim

    def outside(self: Any) -> Any:
        with _disable_current_modes():
            return original(self)

    DeviceMesh._compute_coordinate_on_dim = outside  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._compute_coordinate_on_dim = original  # type: ignore[method-assign]
