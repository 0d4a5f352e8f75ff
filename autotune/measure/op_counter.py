"""The operators and collectives of a fake trial, counted for its predicted step time (autotune/core/step_time.py).

:class:`OpCounter` listens to a fake meter's ops (``FakeMeter.op_observer``: every op the trial dispatches, with its
fake inputs and outputs) and writes what each costs: FLOPs by torch's flop counter (``torch.utils.flop_counter``,
which reads shapes, so fake tensors serve), bytes read and written, the dtype, and the phase: forward, backward,
recompute (a checkpointed forward run again inside backward: an op of autograd's graph task with grad enabled),
step (between the trial's two checkpoints around the optimizer step). A collective (c10d's ops, which FSDP2 calls,
and the functional ones of DTensor, tensor and context parallel) is written with its bytes and its group's size
and ranks. A DTensor op is costed on its local shards. The batch's copy from the host is left out: a DataLoader has
it on the device before the step needs it.

The trial (autotune/measure/trial.py) runs two updates of two micro-batches; the record keeps the second update's
(its optimizer state exists): a micro-batch that does not end the update, the one that does, and the step. Ops are
kept as a table of kinds and segments of counts between collectives (autotune/core/step_records.py), identical
consecutive segments folded into one with a repeat (a model's identical blocks).

DDP's all-reduce does not run in a fake trial (its buckets are held, not reduced: FakeReplicas): its buckets, by the
trainable parameters' gradients in the order backward fills them, are added to the record as DDP would launch them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from autotune.core.mesh import Mesh
from autotune.core.step_records import (
    NO_KERNEL_OPS,
    REDUCTION_OPS,
    CollectiveKind,
    CollectiveRecord,
    OpKind,
    OpRecord,
    Phase,
    Segment,
    StepRecord,
    mesh_dim,
)
from autotune.measure.meters import FORWARD_BACKWARD, STEP
from autotune.measure.meters.fake import FakeMeter

__all__ = [
    "DDP_BUCKET_BYTES",
    "OpCounter",
    "attention_forward_flops",
    "configured_attention_flops",
    "ddp_buckets",
    "flops_per_token",
    "model_flops_per_token",
    "non_embedding_parameters",
]

# DDP's bucket_cap_mb (25 MiB) and its first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES, 1 MiB).
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20

# c10d's and the functional collectives: (kind, the argument whose bytes are the buffer, times the group's size).
_COLLECTIVES: dict[str, tuple[CollectiveKind, str, bool]] = {
    "c10d._allgather_base_.default": ("all_gather", "output_tensor", False),
    "c10d.allgather_into_tensor_coalesced_.default": ("all_gather", "outputs", False),
    "c10d.allgather_.default": ("all_gather", "input_tensors", True),
    "c10d._reduce_scatter_base_.default": ("reduce_scatter", "input_tensor", False),
    "c10d.reduce_scatter_tensor_coalesced_.default": ("reduce_scatter", "inputs", False),
    "c10d.reduce_scatter_.default": ("reduce_scatter", "output_tensors", True),
    "c10d.allreduce_.default": ("all_reduce", "tensors", False),
    "c10d.allreduce_coalesced_.default": ("all_reduce", "tensors", False),
    "c10d.broadcast_.default": ("broadcast", "tensors", False),
    "c10d.alltoall_base_.default": ("all_to_all", "input", False),
    "c10d.send.default": ("send_recv", "tensors", False),
    "c10d.recv_.default": ("send_recv", "tensors", False),
    "_c10d_functional.all_gather_into_tensor.default": ("all_gather", "input", True),
    "_c10d_functional.all_gather_into_tensor_coalesced.default": ("all_gather", "inputs", True),
    "_c10d_functional.reduce_scatter_tensor.default": ("reduce_scatter", "input", False),
    "_c10d_functional.reduce_scatter_tensor_coalesced.default": ("reduce_scatter", "inputs", False),
    "_c10d_functional.all_reduce.default": ("all_reduce", "input", False),
    "_c10d_functional.all_reduce_coalesced.default": ("all_reduce", "inputs", False),
    "_c10d_functional.all_to_all_single.default": ("all_to_all", "input", False),
    "_c10d_functional.broadcast.default": ("broadcast", "input", False),
    "_c10d_functional_autograd.all_gather_into_tensor.default": ("all_gather", "input", True),
    "_c10d_functional_autograd.reduce_scatter_tensor.default": ("reduce_scatter", "input", False),
    "_c10d_functional_autograd.all_to_all_single.default": ("all_to_all", "input", False),
}
_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


def _local(value: Any) -> Any:
    """A DTensor's local shard (what the rank's kernel runs on); anything else as it is."""
    inner = getattr(value, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else value


def _locals(tree: Any) -> Any:
    flat, spec = tree_flatten(tree)
    from torch.utils._pytree import tree_unflatten

    return tree_unflatten([_local(leaf) for leaf in flat], spec)


def _counted(counter: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """The FLOPs torch's flop counter gives an op. Its formulas take the default overload's arguments: an overload
    with a trailing argument more (``addmm.dtype``'s ``out_dtype``, Liger's fp32 weight gradient under --loss
    fused-linear) is counted as the default one, its trailing non-tensor positionals left out."""
    try:
        return int(counter(*_locals(args), **_locals(kwargs), out_val=_locals(out)))
    except TypeError:
        positional = list(args)
        while positional and not isinstance(positional[-1], torch.Tensor):
            positional.pop()
        return int(counter(*_locals(tuple(positional)), **_locals(kwargs), out_val=_locals(out)))


def _footprint(tensor: torch.Tensor) -> int:
    """The bytes a kernel touches of tensor: its elements, or less where strides repeat them (a broadcast input)."""
    if tensor.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return min(tensor.numel(), span) * tensor.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [_local(leaf) for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _argument(func: Any, args: Any, kwargs: Any, name: str) -> Any:
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if not argument.kwarg_only and index < len(args):
                return args[index]
            return kwargs.get(name, argument.default_value if argument.has_default_value() else None)
    return None


def _group(func: Any, args: Any, kwargs: Any) -> tuple[int, int]:
    """(size, stride) of a collective's group: a c10d op's process group or a functional op's group name."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _argument(func, args, kwargs, "process_group")
    if group is not None:
        group = dist.ProcessGroup.unbox(group) if not isinstance(group, dist.ProcessGroup) else group
    else:
        group = _resolve_process_group(_argument(func, args, kwargs, "group_name"))
    ranks = sorted(dist.get_process_group_ranks(group))
    stride = min((b - a for a, b in zip(ranks, ranks[1:], strict=False)), default=1)
    return len(ranks), max(1, stride)


def _flops_beyond_the_counter(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int | None:
    """FLOPs of the ops torch's flop counter has no formula for: a grouped matmul (a mixture of experts' experts: 2
    x its output's elements x K) and the CPU's flash attention (as the counter counts the CUDA one: 4 b h Lq Lk d
    forward, 2.5 times that backward)."""
    if name == "aten._grouped_mm.default" and inputs and outputs:
        return 2 * outputs[0].numel() * int(inputs[0].shape[-1])
    if name.startswith("aten._scaled_dot_product_flash_attention_for_cpu"):
        backward = "backward" in name
        query, key = (inputs[1], inputs[2]) if backward else (inputs[0], inputs[1])
        b, h, lq, d = (int(n) for n in query.shape)
        forward = 4 * b * h * lq * int(key.shape[-2]) * d
        return forward * 5 // 2 if backward else forward
    return None


def _written(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """The arguments an op writes in place (its schema's ``Tensor(a!)`` ones)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            if not argument.kwarg_only and index < len(args):
                written.append(args[index])
            elif argument.name in kwargs:
                written.append(kwargs[argument.name])
    return written


def _attention(name: str) -> str | None:
    if "attention" not in name:
        return None
    return "flash" if "flash" in name else "cudnn" if "cudnn" in name else "efficient"


class OpCounter:
    """What a fake trial's ops and collectives cost (the module docstring). ``mesh`` and ``world_size`` name each
    collective's mesh dimension."""

    def __init__(self, meter: FakeMeter, *, world_size: int = 1, mesh: Mesh | None = None) -> None:
        from torch.utils.flop_counter import flop_registry

        self.meter = meter
        self.world_size = world_size
        self.mesh = mesh or Mesh()
        self._flops = flop_registry
        self._tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        self._table: dict[OpRecord, int] = {}
        # The trial's events in order: ("op", table index) or ("collective", record), and ("mark", checkpoint).
        self._events: list[tuple[str, Any]] = []
        self._in_step = False

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count every op the meter's trials dispatch inside the block (one trial: the record is of its events)."""
        meter = self.meter
        checkpoint = meter.checkpoint

        def marked(name: str) -> None:
            checkpoint(name)
            self._in_step = name == FORWARD_BACKWARD
            self._events.append(("mark", name))

        meter.op_observer = self._observe
        meter.checkpoint = marked  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            meter.op_observer = None
            del meter.checkpoint  # the class's own again

    def _phase(self) -> Phase:
        if self._in_step:
            return "step"
        if torch._C._current_graph_task_id() != -1:
            return "recompute" if torch.is_grad_enabled() else "backward"
        return "forward"

    def _observe(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        name = str(func)
        if name in _COLLECTIVES:
            self._events.append(("collective", self._collective(name, func, args, kwargs)))
            return
        if name in NO_KERNEL_OPS or name.startswith(("prim.", "profiler.", "c10d.", "_c10d")) or func.is_view:
            return
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        if not outputs and not inputs:
            return
        device = self.meter.device.type
        if all(t.device.type != device for t in (*inputs, *outputs)) or (
            name == "aten._to_copy.default" and inputs and inputs[0].device.type != device
        ):
            return  # the host's work, and the batch's copy to the device (a DataLoader's, ahead of the step)
        self._events.append(("op", self._index(self._op(name, func, args, kwargs, out, inputs, outputs))))

    def _index(self, record: OpRecord) -> int:
        if record not in self._table:
            self._table[record] = len(self._table)
        return self._table[record]

    def _dtype(self, tensors: list[torch.Tensor], matmul: bool) -> str:
        floating = next((t.dtype for t in tensors if t.is_floating_point()), None)
        if floating is None:
            return str(tensors[0].dtype).removeprefix("torch.") if tensors else "none"
        if matmul and floating == torch.float32 and self._tf32:
            return "tf32"
        return _DTYPES.get(floating, str(floating).removeprefix("torch."))

    def _op(
        self, name: str, func: Any, args: Any, kwargs: Any, out: Any, inputs: list[torch.Tensor], outputs: list[Any]
    ) -> OpRecord:
        seen: dict[int, torch.Tensor] = {}
        for tensor in (*inputs, *outputs):
            seen.setdefault(id(tensor), tensor)
        moved = sum(_footprint(t) for t in seen.values())
        # What an in-place op (add_, a foreach step) writes it read first: read and written.
        moved += sum(_footprint(t) for t in _tensors(_written(func, args, kwargs)))
        counter = self._flops.get(func._overloadpacket)
        kernel = _attention(name)
        beyond = None if counter is not None else _flops_beyond_the_counter(name, inputs, outputs)
        if counter is None and beyond is None:
            kind: OpKind = "reduction" if name.split(".")[1] in REDUCTION_OPS else "elementwise"
            return OpRecord(op=name, kind=kind, dtype=self._dtype(inputs, False), phase=self._phase(), flops=0,
                            bytes=moved)  # fmt: skip
        flops = beyond if counter is None else _counted(counter, args, kwargs, out)
        assert flops is not None
        if kernel is not None:
            causal = _argument(func, args, kwargs, "is_causal")
            mask_type = _argument(func, args, kwargs, "custom_mask_type")
            return OpRecord(
                op=name, kind="attention", dtype=self._dtype(inputs, False), phase=self._phase(), flops=flops,
                bytes=moved, kernel=kernel, causal=bool(causal) or bool(mask_type),
            )  # fmt: skip
        first = outputs[0] if outputs else None
        shape = None
        if first is not None and first.dim() >= 2 and flops:
            batch = math.prod(first.shape[:-2])
            m, n = int(first.shape[-2]), int(first.shape[-1])
            shape = (batch, m, n, max(1, flops // max(1, 2 * batch * m * n)))
        return OpRecord(op=name, kind="gemm", dtype=self._dtype(inputs, True), phase=self._phase(), flops=flops,
                        bytes=moved, shape=shape)  # fmt: skip

    def _collective(self, name: str, func: Any, args: Any, kwargs: Any) -> CollectiveRecord:
        kind, argument, times_group = _COLLECTIVES[name]
        size, stride = _group(func, args, kwargs)
        moved = sum(t.numel() * t.element_size() for t in _tensors(_argument(func, args, kwargs, argument)))
        if times_group:
            moved *= size
        phase = self._phase()
        # FSDP2 calls c10d's ops: its all-gathers are prefetched, its reductions deferred to the step; the
        # functional ones (DTensor's tensor parallel, context parallel) are waited for by the next op.
        if name.startswith("c10d.") and phase != "step" and kind in ("all_gather", "reduce_scatter", "all_reduce"):
            overlap = "prefetched" if kind == "all_gather" else "deferred"
        else:
            overlap = "exposed"
        dim = mesh_dim(size, stride, world_size=self.world_size, tp=self.mesh.tp, cp=self.mesh.cp, pp=self.mesh.pp)
        return CollectiveRecord(kind=kind, bytes=moved, group_size=size, stride=stride, dim=dim, phase=phase,
                                overlap=overlap)  # type: ignore[arg-type]  # fmt: skip

    def record(self, micro_batch: int, *, seq_len: int | None = None) -> StepRecord:
        """The step of the counted trial: its last update's micro-batches and optimizer step (the module docstring).

        Raises:
            ValueError: the counted trial did not run two updates of at least one micro-batch each.
        """
        updates = self._updates()
        if len(updates) < 2 or not updates[-1][0]:
            raise ValueError(f"the counted trial at micro-batch {micro_batch} ran {len(updates)} update(s), not 2")
        micro_batches, step = updates[-1]
        last = micro_batches[-1]
        other = micro_batches[-2] if len(micro_batches) > 1 else last
        table = sorted(self._table, key=self._table.__getitem__)
        return StepRecord(
            micro_batch=micro_batch,
            seq_len=seq_len,
            ops=table,
            last=self._segments(last, table),
            other=self._segments(other, table),
            step=self._segments(step, table),
        )

    def stage_record(
        self, micro_batch: int, *, stage: int, microbatches: int, seq_len: int | None = None
    ) -> StepRecord:
        """The step of a counted pipeline stage's replay (autotune/measure/pipeline.py): its last update's forwards
        and backwards, in the schedule's order, as one rank's update of ``microbatches``, and its optimizer step.

        Raises:
            ValueError: the replay did not run two updates.
        """
        updates = self._updates()
        if len(updates) < 2:
            raise ValueError(f"the counted stage at micro-batch {micro_batch} ran {len(updates)} update(s), not 2")
        micro_batches, step = updates[-1]
        table = sorted(self._table, key=self._table.__getitem__)
        events = [event for one in micro_batches for event in one]
        return StepRecord(
            micro_batch=micro_batch,
            seq_len=seq_len,
            ops=table,
            last=self._segments(events, table),
            other=[],
            step=self._segments(step, table),
            stage=stage,
            microbatches=microbatches,
        )

    def _updates(self) -> list[tuple[list[list[tuple[str, Any]]], list[tuple[str, Any]]]]:
        """The events cut into updates: each its micro-batches (a forward starts one) and its step."""
        updates: list[tuple[list[list[tuple[str, Any]]], list[tuple[str, Any]]]] = []
        micro_batches: list[list[tuple[str, Any]]] = []
        step: list[tuple[str, Any]] = []
        in_step, last_phase = False, None
        table = sorted(self._table, key=self._table.__getitem__)
        for kind, value in self._events:
            if kind == "mark":
                if value == FORWARD_BACKWARD:
                    in_step = True
                elif value == STEP:
                    updates.append((micro_batches, step))
                    micro_batches, step, in_step, last_phase = [], [], False, None
                continue
            if in_step:
                step.append((kind, value))
                continue
            phase = table[value].phase if kind == "op" else value.phase
            if phase == "forward" and (last_phase != "forward" or not micro_batches):
                micro_batches.append([])
            micro_batches[-1].append((kind, value))
            last_phase = phase
        return updates

    @staticmethod
    def _segments(events: list[tuple[str, Any]], table: list[OpRecord]) -> list[Segment]:
        segments: list[Segment] = []
        bag: Counter[int] = Counter()
        phase: str | None = None

        def close(collective: CollectiveRecord | None) -> None:
            nonlocal bag
            made = Segment(ops=sorted(bag.items()), collective=collective)
            previous = segments[-1] if segments else None
            if previous is not None and previous.model_copy(update={"repeat": 1}) == made:
                segments[-1] = previous.model_copy(update={"repeat": previous.repeat + 1})
            elif made.ops or collective is not None:
                segments.append(made)
            bag = Counter()

        for kind, value in events:
            if kind == "collective":
                close(value)
                continue
            if phase is not None and table[value].phase != phase and bag:
                close(None)
            phase = table[value].phase
            bag[value] += 1
        if bag:
            close(None)
        return segments


def ddp_buckets(model: torch.nn.Module, *, replicas: int, stride: int, dim: str) -> list[CollectiveRecord]:
    """DDP's gradient all-reduces over ``replicas`` ranks ``stride`` apart, one per bucket: the trainable parameters
    in reverse order (backward fills the last layers' gradients first), by dtype, 1 MiB for the first bucket and
    25 MiB after (DDP's defaults), each a DTensor's local shard where the model is tensor parallel."""
    buckets: list[CollectiveRecord] = []
    open_bytes: dict[torch.dtype, int] = {}
    for param in reversed([p for p in model.parameters() if p.requires_grad]):
        local = _local(param)
        nbytes = local.numel() * local.element_size()
        filled = open_bytes.get(param.dtype, 0) + nbytes
        cap = DDP_FIRST_BUCKET_BYTES if not buckets else DDP_BUCKET_BYTES
        if filled >= cap:
            buckets.append(_bucket(filled, replicas, stride, dim))
            filled = 0
        open_bytes[param.dtype] = filled
    buckets.extend(_bucket(n, replicas, stride, dim) for n in open_bytes.values() if n)
    return buckets


def _bucket(nbytes: int, replicas: int, stride: int, dim: str) -> CollectiveRecord:
    return CollectiveRecord(kind="all_reduce", bytes=nbytes, group_size=replicas, stride=stride, dim=dim,
                            phase="backward", overlap="deferred")  # fmt: skip


def flops_per_token(record: StepRecord, model: torch.nn.Module, *, tokens: int, tp: int = 1) -> float:
    """torchtitan's model FLOPs of one token (torchtitan/models/utils.py, get_dense_model_nparams_and_flops): 6 x the
    non-embedding parameters + 12 x layers x heads x head dim x L. The second term is the model config's where it
    has one (a transformers model), else 3 x the forward attention's FLOPs of a token as torch's flop counter counts
    them (4 x heads x head dim x L a layer: the full L x L scores), read off the record (``tokens``: the rank's tokens
    of the micro-batch; under tp its heads are 1/tp of them)."""
    configured = configured_attention_flops(model, record.seq_len)
    attention = attention_forward_flops(record)
    return flops_per_token_of(non_embedding_parameters(model), configured, attention, tokens=tokens, tp=tp)


def flops_per_token_of(
    parameters: int, configured: float | None, attention_flops: int, *, tokens: int, tp: int = 1
) -> float:
    """:func:`flops_per_token` from its parts: the non-embedding parameters, the config's attention term (None where
    the model has no config that says it) and the recorded forward attention's FLOPs of ``tokens`` tokens."""
    if configured is not None:  # a transformers model says its layers, heads and head dim: torchtitan's term itself
        return 6.0 * parameters + configured
    return model_flops_per_token(parameters, attention_flops, tokens=tokens, tp=tp)


def configured_attention_flops(model: torch.nn.Module, seq_len: int | None) -> float | None:
    """12 x layers x heads x head dim x L from a transformers config (where the recorded kernels would not say it
    plainly: context parallel's ring runs each layer's attention as several calls over blocks of the sequence)."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if not (seq_len and isinstance(layers, int) and isinstance(heads, int) and isinstance(head_dim, int)):
        return None
    return 12.0 * layers * heads * head_dim * seq_len


def model_flops_per_token(parameters: int, attention_flops: int, *, tokens: int, tp: int = 1) -> float:
    """6 x parameters + 3 x the attention's forward FLOPs per token (:func:`flops_per_token`)."""
    return 6.0 * parameters + 3.0 * attention_flops * tp / max(1, tokens)


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """The model's parameters but its embeddings' (a DTensor's numel is the whole parameter's)."""
    embedding = sum(int(module.weight.numel()) for module in model.modules() if isinstance(module, torch.nn.Embedding))
    return sum(int(p.numel()) for p in model.parameters()) - embedding


def attention_forward_flops(record: StepRecord) -> int:
    """The forward attention kernels' FLOPs of the record's last micro-batch (a pipeline stage's: its K)."""
    return sum(
        record.ops[index].flops * count * segment.repeat
        for segment in record.last
        for index, count in segment.ops
        if record.ops[index].kind == "attention"
        and record.ops[index].phase == "forward"
        and "backward" not in record.ops[index].op
    )
