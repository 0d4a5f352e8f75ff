"""Tensor parallelism (``--tp N``): one rank of a tensor-parallel group, measured in one process. The plan is
here; the strategy that applies it is ``TensorParallel`` in autotune/measure/strategies.py (which imports this
module, not the other way round).

As ``--strategy fsdp`` does, one process answers for rank 0 of the job's W ranks through a fake process
group of size W: the device mesh is ``(dp, tp)`` with ``dp = D = W / tp`` (autotune/core/mesh.py), the model
is parallelized over the ``tp`` dimension with DTensor's ``parallelize_module`` (each rank really holds its
shard of every planned weight, its gradient and its optimizer state, and the activations between a
column-wise and a row-wise layer are the rank's share of the heads or of the MLP's width), the collectives do
nothing and the buffers they return are real. Under ``--strategy fsdp`` each block, then the root, is then
sharded over the ``dp`` dimension (FSDP2 on a 2-D mesh, torchtitan's ``apply_fsdp`` after ``apply_tp``).

The plan. For a task that gives ``tp_plan`` (module name patterns, ``*`` for a block's index, to a style),
that one; for an ``hf:`` task, the plan transformers applies with ``from_pretrained(tp_plan="auto")``: the
model's own ``_tp_plan`` (the config's ``base_model_tp_plan`` under the base model's prefix, and the
class's, e.g. ``lm_head: colwise_gather_output``). The styles are transformers' names, translated to
PyTorch's ParallelStyles:

    colwise                 ColwiseParallel()                              (output sharded on the last dim)
    rowwise                 RowwiseParallel()                              (output all-reduced)
    colwise_gather_output   ColwiseParallel(output_layouts=Replicate())    (the LM head's logits gathered)
    rowwise_split_input     RowwiseParallel(input_layouts=Replicate())
    embedding_rowwise       RowwiseParallel(input_layouts=Replicate())     (vocabulary-parallel embedding)
    sequence_parallel       SequenceParallel()
    replicate               nothing: every rank holds the whole module
    moe_tp_experts          MoeTensorParallelExperts (below): the experts module of a mixture of experts
                            (Mixtral's ``mlp.experts``), its 3-D weights named by the plan's entries under it:
      packed_colwise          the fused ``gate_up_proj`` (E, 2I, H) on dim 1: (E, 2I/tp, H) per rank
      rowwise                 ``down_proj`` (E, H, I) on its last dim: (E, H, I/tp) per rank

torchtitan's plan (``--tp-plan torchtitan``: autotune/tasks/tp_plan.py writes it for a family's names) adds:

    embedding_rowwise_sequence  RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
                                (vocabulary-parallel, its output reduce-scattered onto the sequence)
    sequence_parallel           SequenceParallel() on the norms (their input and output sharded on the sequence)
    gather_sequence             GatherSequence (below): a block's input all-gathered along the sequence
    gather_scatter_sequence     the same, the block's whole output scattered back (a mixture of experts)
    rowwise_sequence            RowwiseParallel(output_layouts=Shard(1)) (o_proj, down_proj: reduce-scattered)
    colwise_loss_parallel       LossParallelHead (below): the logits sharded by vocabulary through the loss

and, for GPT-2's transformers ``Conv1D`` layers (the weight stored (in, out), which torch's styles do not take):

    conv1d_colwise, conv1d_packed_colwise   Conv1DColwise: weight on dim 1, bias on dim 0 (c_fc; c_attn's packed
                                            q/k/v, each rank's columns of each)
    conv1d_rowwise_sequence     Conv1DRowwise: weight on dim 0, bias replicated, output reduce-scattered onto
                                the sequence (c_proj)
    gather_sequence_split_heads GatherSequence with the attention's split and heads taken per rank (attn)

transformers' ``moe_tp_experts`` (``MoeExpertsParallel``, transformers/distributed/tensor_parallel.py) runs
the experts' own forward on the rank's local shards (every rank routes every token to every chosen expert and
computes its share of each expert's width), its input replicated with an all-reduce of its gradient in the
backward, and all-reduces the output in place (each rank's partial sums). The translation holds the same
shards (as DTensors, Shard(1) where transformers writes _StridedShard(1, split_factor=2): the same local shape,
half of the gate's and half of the up projection's rows) and runs the same local forward with the same in-place
collectives (nothing under the fake process group, no buffer of their own). The router (``mlp.gate``) is not in
the plan: every rank holds it whole, as in the job.

A style this does not translate (expert-parallel ones: ``ep_plan`` is not measured, packed styles outside an
experts module) is refused in one line, as is a model with no plan, and a model whose heads or key-value heads
tp does not divide.

What is assumed: every rank of the tp group holds the same shapes (the divisibility checks make it so), so
rank 0 is the most loaded. Under ``--strategy ddp`` with D > 1 the trials hold DDP's gradient buckets over the
``dp`` dimension, one flat tensor per dtype of the rank's local shards, as DDP over the dp sub-mesh allocates them
(``strategies.hold_ddp_buckets``; truth: tests/autotune/test_ddp_buckets_meshes.py).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from autotune.core.errors import TaskError
from autotune.tasks.task import ProbeTask
from autotune.tasks.tp_plan import tp_plan_of

__all__ = [
    "TP_STYLES",
    "GatherSequence",
    "LossParallelHead",
    "MoeTensorParallelExperts",
    "apply_tp_plan",
    "check_tp_plan",
    "measured_loss_parallel",
    "shards_sequence",
    "tp_plan_of",
    "uses_loss_parallel",
]

TP_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise_split_input",
    "rowwise_rep",
    "embedding_rowwise",
    "sequence_parallel",
    "replicate",
    "moe_tp_experts",
    # torchtitan's (sequence parallel and loss parallel: autotune/tasks/tp_plan.py, torchtitan_plan)
    "embedding_rowwise_sequence",
    "gather_sequence",
    "gather_scatter_sequence",
    "rowwise_sequence",
    "colwise_loss_parallel",
    "conv1d_colwise",
    "conv1d_packed_colwise",
    "conv1d_rowwise_sequence",
    "gather_sequence_split_heads",
)
# The styles of a 3-D expert weight under a moe_tp_experts module: the dim each shards (transformers'
# PackedColwiseParallel.shard_param: ndim - 2; RowwiseParallel.shard_param: -1).
_EXPERT_WEIGHT_DIMS = {"packed_colwise": 1, "colwise": 1, "rowwise": 2}
# The config attributes that count heads, as the families spell them.
_HEAD_KEYS = (("num_attention_heads", "heads"), ("num_key_value_heads", "key-value heads"), ("n_head", "heads"))


def _style(name: str, where: str) -> Any:
    """PyTorch's ParallelStyle for a style of transformers' vocabulary or torchtitan's plan (None for
    replicate)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Replicate())
    if name in ("rowwise_split_input", "rowwise_rep", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    if name == "sequence_parallel":
        return SequenceParallel()
    if name == "replicate":
        return None
    # torchtitan's: the residual stream sharded along the sequence between the blocks, kept as DTensors (hf:
    # models add the residual to the block's output, and a DTensor meets a DTensor there).
    if name == "embedding_rowwise_sequence":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    if name == "rowwise_sequence":
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    if name in ("gather_sequence", "gather_scatter_sequence"):
        return GatherSequence(scatter_output=name == "gather_scatter_sequence")
    if name == "colwise_loss_parallel":
        return LossParallelHead()
    # GPT-2's (transformers' Conv1D: the weight stored (in, out)).
    if name in ("conv1d_colwise", "conv1d_packed_colwise"):
        return Conv1DColwise()
    if name == "conv1d_rowwise_sequence":
        return Conv1DRowwise(output_layouts=Shard(1), use_local_output=False)
    if name == "gather_sequence_split_heads":
        return GatherSequence(split_heads=True)
    raise TaskError(
        f"--tp: the tensor-parallel style {name!r} of {where} is not one this measures "
        f"({', '.join(TP_STYLES)}, or a torch ParallelStyle in the task's tp_plan)"
    )


class _AllReduceInBackward(torch.autograd.Function):
    """Identity forward, the gradient all-reduced in place in the backward (the experts' replicated input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllReduceInForward(torch.autograd.Function):
    """The output all-reduced in place (each rank's partial sums over its share of the experts' width)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class MoeTensorParallelExperts(ParallelStyle):
    """transformers' ``moe_tp_experts`` as a torch ParallelStyle: each named 3-D weight of the experts module
    sharded on its dim over the tp mesh (``dims``: parameter name to dim; ``packed``: the fused ones, whose two
    halves tp must each divide), the module's forward run on the rank's local shards, the input's gradient and
    the output all-reduced in place."""

    def __init__(self, dims: Mapping[str, int], packed: frozenset[str] = frozenset()) -> None:
        self.dims = dict(dims)
        self.packed = packed

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        for name, dim in self.dims.items():
            param = module._parameters[name]
            assert param is not None
            shard = distribute_tensor(param.data, device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank)
            module._parameters[name] = nn.Parameter(shard, requires_grad=param.requires_grad)
        group = device_mesh.get_group()
        forward = module.forward

        def tp_forward(hidden: Any, *routing: Any, **kwargs: Any) -> Any:
            if isinstance(hidden, DTensor):
                hidden = hidden.to_local()
            hidden = _AllReduceInBackward.apply(hidden, group)
            if len(routing) >= 2:  # (top_k_index, top_k_weights, ...): the weights' gradient is partial too
                weights = routing[1].to_local() if isinstance(routing[1], DTensor) else routing[1]
                routing = (routing[0], _AllReduceInBackward.apply(weights, group), *routing[2:])
            originals: dict[str, Any] = {
                name: param for name in self.dims if isinstance(param := module._parameters[name], DTensor)
            }
            # The local shards for the forward, the DTensors back after it whatever happens (a checkpoint's
            # recomputation stops by raising once it has what it needs): a finally, as transformers does.
            module._parameters.update({name: param.to_local() for name, param in originals.items()})
            try:
                output = forward(hidden, *routing, **kwargs)
            finally:
                module._parameters.update(originals)
            return None if output is None else _AllReduceInForward.apply(output, group)

        module.forward = tp_forward  # type: ignore[method-assign]
        return module


class GatherSequence(ParallelStyle):
    """Sequence parallel's entry into a block (torchtitan's ``PrepareModuleInput`` on ``attention`` and
    ``feed_forward``): the hidden states arrive sharded along the sequence (dim 1; a DTensor, or the rank's local
    shard) and are all-gathered, the block running on them whole as a local tensor, as
    ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True)``
    does. The hidden states are the first positional argument or the ``hidden_states`` keyword (hf: families
    pass it either way), so one style serves every family's attention and MLP.

    With ``scatter_output`` the block's output (whole on every rank: a mixture of experts' all-reduced sum) is
    scattered back onto the sequence as a DTensor (``PrepareModuleOutput``), for the residual stream."""

    def __init__(self, *, scatter_output: bool = False, split_heads: bool = False) -> None:
        super().__init__()
        self.scatter_output = scatter_output
        self.split_heads = split_heads

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        def gathered(hidden: Any) -> Any:
            if not isinstance(hidden, torch.Tensor):
                return hidden
            if not isinstance(hidden, DTensor):
                hidden = DTensor.from_local(hidden, device_mesh, [Shard(1)], run_check=False)
            return hidden.redistribute(device_mesh, [Replicate()]).to_local()

        def gather_input(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if args:
                return (gathered(args[0]), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": gathered(kwargs["hidden_states"])}
            return None

        def scatter_output(_: nn.Module, __: Any, output: Any) -> Any:
            first = output[0] if isinstance(output, tuple) else output
            if isinstance(first, DTensor):
                first = first.to_local()
            scattered = DTensor.from_local(first, device_mesh, [Replicate()], run_check=False).redistribute(
                device_mesh, [Shard(1)]
            )
            return (scattered, *output[1:]) if isinstance(output, tuple) else scattered

        if self.split_heads:
            # GPT-2's attention splits its packed q/k/v output at ``split_size`` (the model's width) and reads the
            # heads off the last dim (-1, head_dim): on a rank that holds 1/tp of the heads, the split is 1/tp.
            tp = device_mesh.size()
            for attribute in ("split_size", "embed_dim", "num_heads"):
                if isinstance(getattr(module, attribute, None), int):
                    setattr(module, attribute, getattr(module, attribute) // tp)
        module.register_forward_pre_hook(gather_input, with_kwargs=True)
        if self.scatter_output:
            module.register_forward_hook(scatter_output)
        return module


class LossParallelHead(ColwiseParallel):
    """The LM head of torchtitan's plan: column-wise over its input sharded along the sequence (all-gathered),
    its logits kept sharded by vocabulary (``Shard(-1)``) for a cross entropy computed on the shards under
    ``torch.distributed.tensor.parallel.loss_parallel()`` (the trial's forward and backward run in it:
    ``TensorParallel.loss_context``)."""

    def __init__(self) -> None:
        from torch.distributed.tensor import Shard

        super().__init__(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)


def _distribute_conv1d(style: Any, module: nn.Module, device_mesh: Any, weight: Any, bias: Any) -> nn.Module:
    """``style`` (a column- or row-wise style) over a Conv1D: its weight and bias distributed to the placements
    given, its input and output prepared as the style prepares an nn.Linear's."""
    from torch.distributed.tensor import distribute_module, distribute_tensor

    def partition(_: str, layer: nn.Module, mesh: Any) -> None:
        for name, placement in (("weight", weight), ("bias", bias)):
            param = getattr(layer, name, None)
            if param is None:
                continue
            shard = distribute_tensor(param, mesh, [placement], src_data_rank=style.src_data_rank)
            layer.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))

    return distribute_module(
        module,
        device_mesh,
        partition,
        functools.partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        functools.partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class Conv1DColwise(ColwiseParallel):
    """Column-wise over transformers' ``Conv1D`` (GPT-2's layers, ``x @ weight + bias`` with the weight stored
    (in, out)): the weight sharded on its dim 1, the bias on its dim 0, the output each rank's columns (a local
    tensor), as ColwiseParallel does for an nn.Linear (which it alone takes). ``weight_dim``: the dim sharded."""

    weight_dim = 1

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Shard

        return _distribute_conv1d(self, module, device_mesh, weight=Shard(1), bias=Shard(0))


class Conv1DRowwise(RowwiseParallel):
    """Row-wise over transformers' ``Conv1D``: the weight sharded on its dim 0 (its input features), the bias
    replicated, the input each rank's columns; the output's partial sums reduced as ``output_layouts`` says."""

    weight_dim = 0

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Replicate, Shard

        self.desired_input_layouts = (Shard(-1),)
        return _distribute_conv1d(self, module, device_mesh, weight=Shard(0), bias=Replicate())


def _pattern(key: str) -> re.Pattern[str]:
    # "model.layers.*.mlp.up_proj": a star stands for one name (a block's index), as in transformers' plans.
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


def _experts_style(
    module: nn.Module, name: str, patterns: list[tuple[str, re.Pattern[str], Any]], where: str
) -> MoeTensorParallelExperts:
    """moe_tp_experts on ``name``: its 3-D weights' dims from the plan's entries that name them."""
    dims: dict[str, int] = {}
    packed: set[str] = set()
    for param_name, param in module.named_parameters(recurse=False):
        for key, pattern, value in patterns:
            if pattern.match(f"{name}.{param_name}"):
                if value not in _EXPERT_WEIGHT_DIMS or param.dim() != 3:
                    raise TaskError(
                        f"--tp: the style {value!r} of {key} ({param.dim()}-D) under moe_tp_experts in {where} "
                        f"is not one this measures (packed_colwise, colwise or rowwise on a 3-D expert weight)"
                    )
                dims[param_name] = _EXPERT_WEIGHT_DIMS[value]
                if value == "packed_colwise":
                    packed.add(param_name)
                break
    if not dims:
        raise TaskError(f"--tp: moe_tp_experts in {where}: the plan shards none of the module's weights")
    return MoeTensorParallelExperts(dims, frozenset(packed))


def _base_prefix(model: nn.Module) -> str:
    """Where the plan's names start inside model: "" for the model itself; for a peft model, the qualified name of
    the transformers model it wraps (``base_model.model``), whose own names the plan gives."""
    get_base_model = getattr(model, "get_base_model", None)
    if not callable(get_base_model):
        return ""
    base = get_base_model()
    for name, module in model.named_modules():
        if module is base:
            return f"{name}." if name else ""
    return ""


def _lora_styles(module: nn.Module, name: str, value: Any, style: Any, where: str) -> dict[str, Any]:
    """A style over a LoRA layer (peft's ``lora.Linear``: the frozen ``base_layer`` and the adapters
    ``lora_A.<adapter>``, ``lora_B.<adapter>``) laid out as peft does it over a model transformers parallelized
    (``from_pretrained(tp_plan="auto")`` then ``get_peft_model``; peft/tuners/lora/model.py): the base layer takes
    the plan's style; under ``colwise``, lora_B takes it too (its output sharded as the base's) and lora_A stays
    whole on every rank; under any other style the adapters stay whole (peft warns and adds no hooks).

    Raises:
        TaskError: LoRA over a row-wise layer (peft shards lora_A there, and its forward fails on the sharded
            input: a library's limit, seen with peft 0.21 and transformers 5.24), or over anything but a linear
            layer (an embedding's adapters under tp are not measured).
    """
    from torch.distributed.tensor.parallel import RowwiseParallel

    base = module.get_submodule("base_layer")
    if not isinstance(base, nn.Linear):
        raise TaskError(
            f"--tp: {name} in {where} is a LoRA layer over {type(base).__name__}: LoRA under tensor parallelism "
            "is measured on linear layers only; leave it out of --lora-targets"
        )
    column = value == "colwise" or (not isinstance(value, str) and type(style) is ColwiseParallel)
    row = value == "rowwise" or (not isinstance(value, str) and type(style) is RowwiseParallel)
    if row:
        raise TaskError(
            f"--tp with LoRA on {name.rsplit('.', 1)[-1]} (row-wise in the tensor-parallel plan of {where}): peft's "
            "tensor-parallel LoRA shards lora_A there and its forward fails on the layer's sharded input (a "
            "library's limit); adapt the column-wise layers only (e.g. --lora-targets q_proj,v_proj)"
        )
    styles = {f"{name}.base_layer": style}
    if column:
        for adapter, _ in module.get_submodule("lora_B").named_children():
            styles[f"{name}.lora_B.{adapter}"] = style
    return styles


def _resolved(model: nn.Module, plan: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Each module the plan names, with its ParallelStyle (replicated ones left out). Under peft's LoRA the
    names are the wrapped model's, and a LoRA layer's style is spread over its base layer and adapters."""
    prefix = _base_prefix(model)
    patterns = [(key, _pattern(prefix + key), value) for key, value in plan.items()]
    styles: dict[str, Any] = {}
    matched: set[str] = set()
    for name, module in model.named_modules():
        if ".lora_" in name or name.endswith(".base_layer"):
            continue  # a LoRA layer's insides: placed with the layer (below)
        for key, pattern, value in patterns:
            if name and pattern.match(name):
                matched.add(key)
                if value == "moe_tp_experts":
                    style: Any = _experts_style(module, name, patterns, f"{key} in {where}")
                else:
                    style = _style(value, f"{key} in {where}") if isinstance(value, str) else value
                if style is not None and hasattr(module, "base_layer") and hasattr(module, "lora_A"):
                    styles.update(_lora_styles(module, name, value, style, where))
                elif style is not None:
                    styles[name] = style
                break
    if not styles:
        raise TaskError(f"--tp: the tensor-parallel plan of {where} names no module of the model ({', '.join(plan)})")
    return styles


def _check_divisible(model: nn.Module, styles: Mapping[str, Any], tp: int, where: str) -> None:
    """Refuse a tp that does not divide the heads, the key-value heads or a planned layer's sharded width."""
    config: Any = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key, what in _HEAD_KEYS:
        value = getattr(text_config, key, None)
        if isinstance(value, int) and value % tp:
            raise TaskError(f"--tp {tp} does not divide the {value} {what} of {where} ({key})")
    modules = dict(model.named_modules())
    for name, style in styles.items():
        module = modules[name]
        if isinstance(style, MoeTensorParallelExperts):
            for param_name, dim in style.dims.items():
                width = getattr(module, param_name).shape[dim]
                if width % (2 * tp if param_name in style.packed else tp):  # packed: gate and up each
                    raise TaskError(f"--tp {tp} does not divide {name}.{param_name}'s sharded width {width} in {where}")
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if isinstance(style, (Conv1DColwise, Conv1DRowwise)):
            dim = style.weight_dim
        elif isinstance(style, ColwiseParallel):
            dim = 0
        elif isinstance(style, RowwiseParallel):
            dim = 1 if isinstance(module, nn.Linear) else 0
        else:
            continue
        if weight.shape[dim] % tp:
            raise TaskError(f"--tp {tp} does not divide {name}'s sharded width {weight.shape[dim]} in {where}")


def check_tp_plan(model: nn.Module, task: ProbeTask, tp: int) -> dict[str, Any]:
    """The model's tensor-parallel plan as PyTorch's ParallelStyles by module name, checked for tp.

    Raises:
        TaskError: no plan (neither the task's ``tp_plan`` nor the model's own), a style this does not
            measure, a plan that names no module, or heads, key-value heads or a sharded width tp does not
            divide (one line each).
    """
    where = f"{type(model).__name__} of task {task.name!r}"
    plan = tp_plan_of(model, task)  # TaskError for a plan's name it cannot resolve for the model
    if not plan:
        raise TaskError(
            f"--tp {tp}: {where} has no tensor-parallel plan: give the task one (ProbeTask(tp_plan={{...}})) "
            "or use an hf: config whose model ships one (base_model_tp_plan)"
        )
    styles = _resolved(model, plan, where)
    _check_divisible(model, styles, tp, where)
    if task.seq_len is not None and task.seq_len % tp and shards_sequence(styles):
        raise TaskError(
            f"--tp {tp}: the plan of {where} shards the sequence over the tp ranks (sequence parallel), and its "
            f"seq_len {task.seq_len} is not a multiple of {tp}"
        )
    return styles


def apply_tp_plan(model: nn.Module, tp_mesh: Any, styles: Mapping[str, Any]) -> None:
    """``parallelize_module`` of the styles over ``tp_mesh``, in place, with tied parameters kept tied.

    parallelize_module distributes each module's parameters on its own, so a weight two modules share (GPT-2's LM
    head and token embedding) came out as two DTensors, each rank holding (and training) both. Where the shares'
    DTensors agree (the same placements and local shape: both shard the vocabulary), the modules are given one of
    them again, as the job's ``tie_weights()`` after sharding does; where they do not, they stay apart (two sharded
    copies: what the job would hold)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    shared: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            shared.setdefault(id(param), []).append((module_name, name))
    # src_data_rank=None: each rank keeps its own initial shard (no scatter from rank 0), as a job that loads its
    # weights afterwards does; the shapes, and so the memory, are the same.
    parallelize_module(model, tp_mesh, dict(styles), src_data_rank=None)
    for holders in (holders for holders in shared.values() if len(holders) > 1):
        first_module, first_name = holders[0]
        kept = getattr(model.get_submodule(first_module), first_name)
        for module_name, name in holders[1:]:
            module = model.get_submodule(module_name)
            other = getattr(module, name)
            if other is kept:
                continue
            if (
                isinstance(kept, DTensor)
                and isinstance(other, DTensor)
                and kept.placements == other.placements
                and kept.to_local().shape == other.to_local().shape
            ):
                setattr(module, name, kept)


def shards_sequence(styles: Mapping[str, Any]) -> bool:
    """Whether the plan shards the activations between the blocks along the sequence (sequence parallel)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return any(isinstance(style, SequenceParallel | GatherSequence) for style in styles.values())


def uses_loss_parallel(styles: Mapping[str, Any]) -> bool:
    """Whether the plan keeps a column-wise layer's output sharded as a DTensor (torchtitan's LM head, or a task's
    own ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``): the logits sharded by vocabulary,
    the loss computed on them, and its backward run, under ``loss_parallel()``, as torchtitan's train step does."""
    from torch.distributed.tensor import Shard

    return any(
        isinstance(style, ColwiseParallel) and not style.use_local_output and isinstance(style.output_layouts[0], Shard)
        for style in styles.values()
    )


@contextmanager
def measured_loss_parallel() -> Iterator[None]:
    """torch's ``loss_parallel()``, with its cross entropy's insides seen by the meter.

    loss_parallel installs handlers for the cross entropy's ops in DTensor's dispatcher (log-softmax, NLL and
    their backwards, on the vocabulary shards). DTensor calls them from inside the op's dispatch, where the
    meter's dispatch mode (and a fake trial's) has stepped aside, so the shards they allocate and free there
    (the shifted logits, their exponentials, the gradient's buffers: about two logit-sized tensors at once) went
    uncounted: the tiny Llama's step read 78,760 bytes under the allocator's count at m = 5. Each handler runs
    here with the modes that were current on entry put back for its span.

    Inside a handler DTensor also derives the op's global output shape by running it on global-shaped fake
    tensors (``ShardingPropagator._propagate_tensor_meta_non_cached``, in the fake mode it finds on the stack):
    with the meter's mode put back those counted too, in a fake trial (a whole, unsharded logits tensor twice a
    step). That derivation holds no memory in the job, and runs here with every mode set aside. Nor is a handler
    counted when the fake meter runs the loss again on the values its inputs carry (a mixture of experts' routing
    values reach the labels): that counted the loss's shards twice on the tiny Mixtral (25,000-33,000 bytes)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.distributed.tensor.parallel.loss import customized_loss_ops
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

    from autotune.measure.meters.fake import computing_values

    modes = list(_get_current_dispatch_mode_stack())
    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers
    propagator = dispatcher.sharding_propagator
    derive_shapes = propagator._propagate_tensor_meta_non_cached

    def unseen_shapes(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return derive_shapes(*args, **kwargs)

    def seen(handler: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if computing_values():  # the fake meter running the op on its inputs' values: not the trial's
                return handler(*args, **kwargs)
            active = _get_current_dispatch_mode_stack()
            with ExitStack() as stack:
                for mode in modes:
                    if not any(mode is other for other in active):
                        stack.enter_context(mode)
                propagator._propagate_tensor_meta_non_cached = unseen_shapes  # type: ignore[method-assign]
                try:
                    return handler(*args, **kwargs)
                finally:
                    del propagator._propagate_tensor_meta_non_cached  # the class's own again

        return run

    with loss_parallel():
        originals = {op: handlers[op] for op in customized_loss_ops if op in handlers}
        handlers.update({op: seen(handler) for op, handler in originals.items()})
        try:
            yield
        finally:
            handlers.update(originals)
