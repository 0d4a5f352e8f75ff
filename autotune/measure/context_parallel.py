"""Context parallelism (``--cp N``): one rank of a context-parallel group, measured in one process, with the
attention as PyTorch's own ``context_parallel`` runs it.

The job this measures is the ordinary one transformers' Trainer (``_prepare_context_parallel_inputs``) and
accelerate (``maybe_context_parallel``) run over torch's
``torch.distributed.tensor.experimental.context_parallel``: a causal LM with ``attn_implementation="sdpa"``;
each micro-batch's ``input_ids``, ``labels``, ``shift_labels`` (the labels padded with -100 and shifted by one,
the way the Trainer makes them) and ``position_ids`` (``arange(L)`` expanded over the batch) are the buffers
``context_parallel`` shards in place along the sequence (dimension 1), none restored; forward and backward run
inside it; each attention module's mask is dropped for ``is_causal=True`` (accelerate's
``_attach_context_parallel_hooks``); the gradients are all-reduced by DDP over every rank (the cp ranks hold
the same parameters). torch's defaults are kept: the head-tail load balancer (on when L is a multiple of
2 x cp: rank r holds the r-th and the (2 cp - 1 - r)-th of 2 cp chunks) and the ``allgather`` rotation
(``set_rotate_method``: the key/value shards are all-gathered once per attention call, forward and backward;
the gradients of key and value still travel the ring by all-to-all in backward, as torch does for either
rotation).

The CPU kernel. torch's ring attention (``_templated_ring_attention`` and its backward) calls
``aten._scaled_dot_product_flash_attention`` (or the efficient or cuDNN kernels) on each rank's shards, which
have CUDA kernels only, and the DTensor dispatcher it hooks into knows no CPU attention: on the CPU, SDPA
decomposes to ``aten._scaled_dot_product_flash_attention_for_cpu``, for which torch registers no
context-parallel rule. :func:`install_cpu_flash_attention` adds the two missing pieces, and nothing else:

- a CPU kernel for ``aten._scaled_dot_product_flash_attention`` and its backward (``torch.library``): an
  adapter that calls the CPU flash kernels (``_scaled_dot_product_flash_attention_for_cpu`` and
  ``..._backward``) and fills the CUDA signature's extra outputs (sequence offsets, RNG state, debug mask)
  with empty tensors, which hold no memory;
- a context-parallel rule for the CPU flash op and its backward: each routes its DTensor shards to torch's
  own ``_scaled_dot_product_ring_flash_attention`` (and ``..._backward``), unchanged, and wraps the local
  results back as DTensors sharded like the query.

So the ring, its rotation, its load balancing, its merging of partial outputs and its buffers are torch's, and
the memory each rank holds is the ring's; only the per-block attention kernel is the CPU flash kernel. Its own
scratch (the backward's about 1.1 MB for a (4, 8, 128, 64) block, allocated and freed inside the kernel) is the
CPU's, and the CPU meter does not see it, as for any CPU SDPA backward: where a rank's peak falls inside that
kernel the probe reads low by it (docs/meshes.md gives the figures). The ring itself runs inside a DTensor
handler, where the probe's dispatch modes are off; the rules re-enter them (``_outer_modes``) so that the
ring's allocations are counted. The truth in tests/autotune/_cp_worker.py installs the
same kernel in each of its real processes: without it the job cannot run on the CPU at all.

On an emulated card (``autotune estimate --gpu``; fake CUDA tensors in the emulated child) none of that is
installed: SDPA reaches ``aten._scaled_dot_product_flash_attention`` on CUDA (flash for bf16 on an sm80+ card;
fp32 takes the math path, whose causal mask DTensor refuses, as a real job's would be) and torch's own
context-parallel rule runs the ring, with the op's fake kernel per block. That rule too calls the ring with the
dispatch modes off: for as long as the process group lives the ring's two functions re-enter them
(``_ring_under_outer_modes``), so the ring's buffers are counted there as on the CPU.

As ``--strategy fsdp`` and ``--tp`` do, one process answers for one rank of the job's W ranks through a fake
process group of size W over a ``(dp, cp)`` mesh, ``dp = D = W / cp``: ``context_parallel`` really shards the
buffers, the collectives do nothing and the buffers they return (the all-gathered key/value, the rotated key
and value gradients) are real allocations in this process. The ranks of a cp group do not hold the same work:
with the load balancer on, at ring step i a rank r >= i attends its whole query to the first half of the
arriving key/value, and a rank r < i attends the second half of its query to all of it (partial outputs, then
merged in place); the probe measures the rank named by ``rank`` (:data:`MEASURED_RANK` by default, the most
loaded in the comparison with real processes; docs/meshes.md gives the figures).

Under ``--strategy fsdp`` the gradients are not all-reduced by DDP: FSDP2 shards the model over every rank of the
(dp, cp) mesh flattened (torchtitan's and accelerate's ``dp_shard_cp``: the cp ranks hold the same parameters, so
they share its shards and reduce-scatter its gradients together), each decoder block then the root as
:class:`~autotune.measure.strategies.Sharded` wraps them, with its mixed-precision policy; fsdp over cp alone
(D = 1) still shards over the cp ranks.

With ``--tp`` (under fsdp: torchtitan's 3-D mesh for long sequences) the mesh is ``(dp, cp, tp)``, tp innermost,
and the measured rank is tp rank 0 of the cp rank measured: the model is parallelized over the tp ranks first, with
the plan :class:`~autotune.measure.strategies.TensorParallel` takes (autotune/measure/tensor_parallel.py); the
query, key and value leave their column-wise projections as local tensors of H / tp heads, which
``context_parallel``'s SDPA then shards along the sequence over the cp ranks; FSDP2 then shards over dp x cp.

What is refused, one line each: a model that is not a causal LM over ``input_ids`` and ``labels``, an attention
other than ``sdpa``, and a sequence length cp does not divide. Under ``--pp`` the stages run cp through
``pipeline.ShardedStage`` (this module's :func:`ring_ready`, :func:`sequence_buffers`, :func:`sequence_sharded` and
:func:`drop_masks`, once per step rather than per micro-batch).

With ``--tp`` over ddp the job is torch's TP + DDP over the dp x cp ranks (``DistributedDataParallel(device_mesh=...)``,
which makes each DTensor parameter its local shard): the buckets of the local shards are held, as ``--tp`` over ddp
holds them, and each gradient is kept as the parameter's shard (``parallelize.grads_as_local_shards``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from autotune.core.compositions import Dimensions, refuse_composition
from autotune.core.errors import AutotuneError, TaskError
from autotune.core.mesh import Mesh
from autotune.measure.layout import Layout
from autotune.measure.parallelize import Parallelism, compose
from autotune.measure.strategies import Strategy
from autotune.tasks.task import ProbeTask

__all__ = [
    "MEASURED_RANK",
    "ROTATION",
    "ContextParallel",
    "check_cp_model",
    "drop_masks",
    "install_cpu_flash_attention",
    "ring_ready",
    "sequence_buffers",
    "sequence_sharded",
]

# torch's default rotation (and accelerate's cp_comm_strategy default).
ROTATION = "allgather"
# The cp rank the probe measures when none is named: the most loaded one against the real processes.
MEASURED_RANK = 0

_aten = torch.ops.aten
_library: Any = None
# The dispatch modes live around the job's forward (the probe's meter), taken by ContextParallel before each
# forward: torch's ring runs inside a DTensor handler, where those modes are off (a mode is popped while it
# dispatches), so without them its own allocations (each block's output, the rotated key/value, the merges,
# the gradients' buffers) would not be counted. Empty in a job that has none (the truth's processes).
_outer_modes: list[Any] = []


@contextmanager
def _under_outer_modes() -> Iterator[None]:
    with ExitStack() as stack:
        for mode in _outer_modes:
            stack.enter_context(mode)
        yield


def _flash_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Any, ...]:
    """``aten._scaled_dot_product_flash_attention`` on the CPU: the CPU flash kernel, with the CUDA
    signature's other outputs empty (the CUDA kernel returns them undefined for a dense batch)."""
    out, logsumexp = _aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale
    )
    empty = query.new_empty(0)
    return out, logsumexp, empty, empty, 0, 0, empty, empty, empty


def _flash_cpu_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: torch.Tensor,
    cum_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: torch.Tensor,
    philox_offset: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_flash_attention_backward`` on the CPU: the CPU flash kernel's backward (the
    sequence offsets and the RNG state are for variable-length batches and dropout, neither of which the ring
    passes)."""
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(  # type: ignore[no-any-return]
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale
    )


def _as_dtensor(local: torch.Tensor, like: Any, last: int | None = None) -> Any:
    """local as a DTensor laid out like ``like`` (the query's sequence sharding); ``last`` replaces the
    global shape's last dimension, and a local of fewer dimensions (the log-sum-exp) drops the trailing ones."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = list(like.shape)[: local.dim()]
    if last is not None:
        shape[-1] = last
    stride = torch.empty(shape, device="meta").stride()
    meta = TensorMeta(torch.Size(shape), stride, local.dtype)
    return DTensor(local, DTensorSpec(like._spec.mesh, like._spec.placements, meta), requires_grad=False)


def _ring_flash_cpu(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The context-parallel rule of the CPU flash op: torch's ring flash attention over the query's mesh."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    query, key, value = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("context parallel attention takes no attn_mask (torch's ring has none)")
    with _under_outer_modes():
        out, logsumexp, *_ = ring._scaled_dot_product_ring_flash_attention(
            query.device_mesh,
            query.to_local(),
            key.to_local(),
            value.to_local(),
            dropout_p,
            is_causal,
            scale=kwargs.get("scale"),
        )
    return _as_dtensor(out, query, last=value.shape[-1]), _as_dtensor(logsumexp, query)


def _ring_flash_cpu_backward(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The context-parallel rule of the CPU flash backward: torch's ring flash attention backward."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args[:8]
    empty = query.to_local().new_empty(0)
    with _under_outer_modes():
        grads = ring._scaled_dot_product_ring_flash_attention_backward(
            query.device_mesh,
            grad_out.to_local(),
            query.to_local(),
            key.to_local(),
            value.to_local(),
            out.to_local(),
            logsumexp.to_local(),
            empty,
            empty,
            0,
            0,
            dropout_p,
            is_causal,
            empty,
            empty,
            scale=kwargs.get("scale"),
        )
    return _as_dtensor(grads[0], query), _as_dtensor(grads[1], key), _as_dtensor(grads[2], value)


# torch's ring, forward and backward: what its own context-parallel rules (``_sdpa_handler``, the CUDA kernels')
# call, by name, on the local shards.
_RING_FUNCTIONS = ("_templated_ring_attention", "_templated_ring_attention_backward")


@contextmanager
def _ring_under_outer_modes() -> Iterator[None]:
    """On CUDA the attention's context-parallel rules are torch's own, which call the ring with the dispatch modes
    off, as the CPU rules do: for as long as the block runs, the ring's two functions re-enter them."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    originals = {name: getattr(ring, name) for name in _RING_FUNCTIONS}

    def counted(function: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with _under_outer_modes():
                return function(*args, **kwargs)

        return run

    for name, function in originals.items():
        setattr(ring, name, counted(function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(ring, name, function)


def install_cpu_flash_attention() -> None:
    """Let torch's context-parallel ring attention run on the CPU (the module's docstring says how). Once per
    process; the DTensor rules are torch's ``custom_ops`` table, which ``context_parallel`` reads on entry."""
    global _library
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    if _library is None:
        # Registered only when no CPU kernel exists (a torch that grows one keeps its own).
        if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_dot_product_flash_attention", "CPU"):
            library = torch.library.Library("aten", "IMPL")
            library.impl("_scaled_dot_product_flash_attention", _flash_cpu, "CPU")
            library.impl("_scaled_dot_product_flash_attention_backward", _flash_cpu_backward, "CPU")
            _library = library
        else:
            _library = False
    ring.custom_ops[_aten._scaled_dot_product_flash_attention_for_cpu.default] = _ring_flash_cpu
    ring.custom_ops[_aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _ring_flash_cpu_backward


@contextmanager
def ring_ready(device: torch.device, rotation: str = ROTATION) -> Iterator[None]:
    """Within: torch's ring attention runs here with its allocations counted, at ``rotation``. On the CPU the ring's
    per-block kernel is the adapter (:func:`install_cpu_flash_attention`); on CUDA (fake CUDA tensors on an emulated
    card) SDPA reaches torch's own CUDA flash (or efficient, cuDNN) op and its context-parallel rule, whose ring
    re-enters the dispatch modes (:func:`_ring_under_outer_modes`)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    with ExitStack() as counting:
        if device.type == "cpu":
            install_cpu_flash_attention()
        else:
            counting.enter_context(_ring_under_outer_modes())
        before = ring._cp_options.rotate_method
        ring.set_rotate_method(rotation)
        try:
            yield
        finally:
            ring._cp_options.rotate_method = before


def sequence_buffers(batch: dict[str, Any], cp: int) -> list[torch.Tensor]:
    """A causal LM's micro-batch as transformers' Trainer readies it for context parallelism: ``input_ids``,
    ``labels``, ``shift_labels`` (the labels padded with -100 and shifted by one) and ``position_ids`` (an expanded
    ``arange(L)``), the buffers ``context_parallel`` shards along the sequence.

    Raises:
        TaskError: no (m, L) input_ids and labels, or a length cp does not divide.
    """
    input_ids, labels = batch.get("input_ids"), batch.get("labels")
    if not (isinstance(input_ids, torch.Tensor) and isinstance(labels, torch.Tensor) and input_ids.dim() == 2):
        raise TaskError(f"--cp {cp}: the batch must hold input_ids and labels of shape (m, L)")
    length = input_ids.shape[1]
    if length % cp:
        raise TaskError(f"--cp {cp} does not divide the sequence length {length} (--seq-len)")
    shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    position_ids = torch.arange(length, device=input_ids.device).expand(input_ids.shape[0], -1)
    return [input_ids, labels, shift_labels, position_ids]


@contextmanager
def sequence_sharded(cp_mesh: Any, buffers: list[torch.Tensor]) -> Iterator[None]:
    """torch's ``context_parallel`` over ``cp_mesh``: ``buffers`` sharded in place along the sequence (dimension 1,
    none restored) and SDPA the ring's within, the dispatch modes around it taken for the ring
    (:func:`_under_outer_modes`)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    _outer_modes[:] = _get_current_dispatch_mode_stack()
    try:
        with context_parallel(
            cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
        ):
            yield
    finally:
        _outer_modes.clear()


def drop_masks(model: nn.Module) -> None:
    """Each attention's mask dropped for causal SDPA (torch's ring attention takes no mask)."""
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(_drop_mask, with_kwargs=True)


def _drop_mask(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    # accelerate's _attach_context_parallel_hooks: the ring takes no mask; causal attention is is_causal=True.
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = None
        kwargs["is_causal"] = True
    return args, kwargs


def check_cp_model(model: nn.Module, cp: int, task_name: str = "") -> None:
    """The model is one torch's context parallelism runs (an hf: causal LM with SDPA attention); a one-line
    TaskError otherwise."""
    where = f"{type(model).__name__}" + (f" of task {task_name!r}" if task_name else "")
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if config is None or not type(model).__name__.endswith("ForCausalLM"):
        raise TaskError(
            f"--cp {cp}: context parallelism is measured for hf: causal LMs (input_ids, labels); {where} is not one"
        )
    if attention != "sdpa":
        raise TaskError(
            f"--cp {cp}: torch's context parallelism runs SDPA attention only; {where} uses {attention!r} "
            "(attn_implementation='sdpa')"
        )


def _check_model(model: nn.Module, task: ProbeTask, cp: int) -> None:
    check_cp_model(model, cp, task.name)
    if task.seq_len is not None and task.seq_len % cp:
        raise TaskError(f"--cp {cp} does not divide the sequence length {task.seq_len}")


class ContextParallel(Strategy):
    """One rank (``rank``) of a cp group of W ranks: each micro-batch under torch's ``context_parallel``, DDP
    (``inner`` "ddp") or FSDP2 (``inner`` "fsdp") over every rank."""

    name = "ddp"

    def __init__(
        self, world_size: int, mesh: Mesh, *, inner: str = "ddp", rank: int = MEASURED_RANK, rotation: str = ROTATION
    ) -> None:
        super().__init__(world_size)
        if inner not in ("ddp", "fsdp"):
            raise AutotuneError(f"--cp {mesh.cp} is measured over ddp or fsdp, not {inner}")
        refuse_composition(Dimensions.of(inner, world_size, mesh))
        if not 0 <= rank < mesh.cp:
            raise AutotuneError(f"the measured cp rank must be in [0, {mesh.cp}), got {rank}")
        self.name = inner
        self.inner = inner
        self.mesh = mesh
        self.replicas = mesh.data_parallel(world_size)
        self.rank = rank
        self.rotation = rotation
        self._device_mesh: Any = None
        # Under fsdp: the (dp, cp) dimensions flattened, the mesh FSDP2 shards over.
        self._shard_mesh: Any = None
        self._group: Any = None
        # The context_parallel a forward entered; closed after its backward (by sync's exit).
        self._inside = ExitStack()

    @property
    def describes_replicas(self) -> bool:
        return False

    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        if self.inner == "fsdp" and precision == "bf16":
            return None  # FSDP2's MixedPrecisionPolicy alone, as Sharded runs it
        return super().autocast_dtype(precision)

    @contextmanager
    def process_group(self, device: torch.device) -> Iterator[Any]:
        import torch.distributed as dist

        if dist.is_initialized():
            raise AutotuneError(
                "--cp probes one rank of N through a fake process group, and a process group is already "
                "initialized in this process: probe before init_process_group, or from `autotune probe`"
            )
        # The measured rank is (dp 0, cp rank[, tp 0]) of the (dp, cp[, tp]) mesh (autotune/measure/layout.py).
        layout = Layout(self.world_size, self.mesh)
        with (
            ring_ready(device, self.rotation),
            layout.fake_device_mesh(device.type, rank=layout.rank(cp=self.rank)) as mesh,
        ):
            try:
                self._device_mesh = mesh
                if self.inner == "fsdp":  # made here, outside the fake trials' modes (its rank map is a real tensor)
                    self._shard_mesh = self._device_mesh["dp", "cp"]._flatten("dp_cp")
                self._group = dist.group.WORLD
                yield self._group
            finally:
                self._inside.close()
                self._device_mesh = self._shard_mesh = self._group = None

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Before each forward: the batch made ready as transformers' Trainer makes it for context parallelism,
        and torch's context_parallel entered over it (left by sync's exit, after the backward)."""
        buffers = sequence_buffers(kwargs, self.mesh.cp)
        self._inside.close()
        self._inside.enter_context(sequence_sharded(self._device_mesh["cp"], buffers))
        shift_labels, position_ids = buffers[2:]
        return args, {**kwargs, "shift_labels": shift_labels, "position_ids": position_ids}

    def wrap(self, model: nn.Module, task: ProbeTask, device: torch.device) -> nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        refuse_composition(Dimensions.of(self.inner, self.world_size, self.mesh, offload=task.offload), TaskError)
        _check_model(model, task, self.mesh.cp)
        config = model.config
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if (
            device.type == "cuda"
            and task.precision == "fp32"
            and task.weights_dtype in (None, "fp32")
            and kv_heads != heads
        ):
            # transformers passes enable_gqa=True without a mask; flash takes bf16/fp16 only, the efficient kernel
            # no GQA: SDPA's math path, whose causal mask torch's ring cannot shard (a real job fails there too).
            raise TaskError(
                f"--cp {self.mesh.cp}: fp32 attention over grouped key/value heads ({kv_heads} for {heads}) takes "
                "SDPA's math path on CUDA, which torch's context parallelism cannot run: --precision bf16 (flash)"
            )
        # Tensor parallel inside each cp rank, as TensorParallel parallelizes (its plan, the heads divided per tp
        # rank): the attention's query, key and value leave their column-wise projections as local tensors of
        # H / tp heads, which context_parallel's SDPA then shards along the sequence over the cp ranks.
        # Under fsdp, FSDP2 over every rank, the (dp, cp) mesh flattened: the cp ranks hold the same parameters, so
        # their gradients are reduced together and their shards are cut over all W ranks (torchtitan's and
        # accelerate's dp_shard_cp mesh). The measured rank is global rank ``rank``: its shard is the rank-th of W
        # (FSDP2 pads the shards to one size, rank 0's the largest before padding).
        # Under ddp, DDP over every rank; a fake model holds its buckets instead (DDP's constructor broadcasts the
        # weights, which fake tensors cannot carry), as plain ddp's fake trials do (strategies.FakeReplicas). The
        # fake group's all-reduce completes with no value, which DDP's reducer refuses; a real one reduces each
        # bucket in place and hands the same buffer back, which is what noop_hook returns. With tp, DDP cannot take
        # the DTensor parameters itself (torch's TP + DDP swaps them for their local shards first): the buckets of
        # the local shards are held, real and fake trials alike, as strategies.TensorParallel holds them.
        parallelism = Parallelism(
            self.inner,
            replicas=self.world_size,
            tp_mesh=self._device_mesh["tp"] if self.mesh.tp > 1 else None,
            shard_mesh=self._shard_mesh,
            group=self._group if self.mesh.tp == 1 else None,
            comm_hook=noop_hook,
            context=self._install,
        )
        return compose(model, task, device, parallelism).model

    def _install(self, model: nn.Module) -> None:
        """cp's applier: each attention's mask dropped (torch's ring attention runs causal SDPA without one), and
        every forward entered under context_parallel (:meth:`_enter`)."""
        drop_masks(model)
        model.register_forward_pre_hook(self._enter, with_kwargs=True)

    @contextmanager
    def sync(self, model: nn.Module, last: bool) -> Iterator[None]:
        # DDP over every rank: only a group's last micro-batch all-reduces. The context_parallel its forward
        # entered is left here, after the backward ran inside it, as a job's train context does.
        with model.no_sync() if not last and hasattr(model, "no_sync") else nullcontext():  # type: ignore[operator]
            try:
                yield
            finally:
                self._inside.close()
