"""Expert parallelism (``--ep N``): a mixture of experts' routed experts sharded over N ranks, as torchtitan lays
them out (torchtitan/distributed/expert_parallel.py, ``ExpertParallel``; its ``parallelize`` of DeepSeek-V3 and
Qwen3-MoE), applied to one rank's model by this module alone (the dimension's applier, docs/design.md).

What one rank holds and does:

- **The experts' weights**, ``Shard(0)`` on the expert dimension: each fused 3-D weight of an experts module
  (transformers 5's ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I), run by Mixtral, Qwen2/3-MoE, OLMoE,
  DeepSeek-V3) becomes its E / N rows of this rank's experts, sliced by hand.
- **The dispatch**: the router's top-k picks (T tokens x k) sorted by expert, the counts per expert exchanged
  (``all_to_all_single`` of E integers), the token copies sent to their experts' ranks by ``all_to_all_single``
  into a receive buffer of the size the counts give (dropless: as many rows as the routing sends, the buffer
  torchtitan's ``_token_dispatch`` holds), each local expert run over its rows from every source rank, the
  outputs sent back by the reverse ``all_to_all_single`` (autograd's backward runs the two exchanges the other
  way) and combined, weighted, into the tokens' rows.
- **The experts' data parallelism**: the remaining ranks of the shard mesh, torchtitan's efsdp = dp_shard x cp x tp
  / ep, shard each experts module by FSDP2 on its own mesh (``Shard(1)`` where efsdp x ep exceeds the experts,
  torchtitan's rule); the non-expert parameters stay under the job's strategy (FSDP2 over every rank: the blocks
  and the root, autotune/measure/parallelize.py), which leaves the experts' parameters to their own unit.

One process answers for rank 0 of the job through the fake process group, whose collectives move nothing: what the
other ranks send is the routing's to say. The rule: **every rank routes as this one does** (the counts rank 0
receives from each source are those it sends to itself), so under balanced routing rank 0 receives T x k rows, and
under a load factor f (autotune/measure/meters/fake.py: expert 0, rank 0's, takes f x its fair share) it receives N
times its own busiest share: rank 0 is the most loaded rank. Real trials route by the router's real top-k under the
same rule; a truth of real gloo ranks routing with the same forced assignment on every rank holds what this holds
(tests/autotune/test_experts.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from autotune.core.errors import TaskError
from autotune.measure.parallelize import LOW_PRECISION, _mesh_coordinates_outside_fake_modes, fsdp_api, is_fake
from autotune.measure.strategies import Sharded
from autotune.tasks.task import ProbeTask

__all__ = ["ExpertParallel", "apply_ep", "expert_modules"]

_WEIGHTS = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules of model: those holding the fused 3-D weights ``gate_up_proj`` and ``down_proj`` of
    ``num_experts`` experts (transformers 5's layout), in module order."""
    found = []
    for module in model.modules():
        weights = [getattr(module, name, None) for name in _WEIGHTS]
        experts = getattr(module, "num_experts", None)
        if isinstance(experts, int) and all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights):
            found.append(module)
    return found


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with receive buffers of the sizes given, and its backward the exchange the other way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, received: list[int], sent: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (received, sent), group
        out = rows.new_empty((sum(received), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        received, sent = ctx.splits
        back = grad.new_empty((sum(sent), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), sent, received, group=ctx.group)
        return back, None, None, None


def _received_counts(sent: torch.Tensor, ep: int, rank: int, group: Any) -> torch.Tensor:
    """The rows each source rank sends to each of this rank's experts, (ep x local experts) flattened by source: over
    a real group, exchanged; over the fake group, the module docstring's rule (every rank routes as this one)."""
    if dist.get_backend(group) == "fake":
        return sent.view(ep, -1)[rank].repeat(ep)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return received


def _within_capacity(order: torch.Tensor, sent: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The picks each expert keeps under its capacity, the first ``capacity`` of its own in token order (GShard's
    rule), and the counts kept: the others are dropped, their tokens' rows get nothing from that expert."""
    starts = torch.cumsum(sent, 0) - sent
    position = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(
        sent, output_size=order.numel()
    )
    return order[position < capacity], sent.clamp(max=capacity)


def _dispatched_forward(module: Any, ep: int, rank: int, group: Any, capacity_factor: float | None) -> Any:
    experts: int = module.num_experts
    local = experts // ep

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sent = torch.bincount(flat, minlength=experts)
        if capacity_factor is not None:
            order, sent = _within_capacity(order, sent, math.ceil(capacity_factor * flat.numel() / experts))
        received = _received_counts(sent, ep, rank, group)
        sent_splits = sent.view(ep, local).sum(1).tolist()
        received_rows = received.tolist()
        received_splits = [sum(received_rows[r * local : (r + 1) * local]) for r in range(ep)]
        token_of = order // k
        rows = _AllToAll.apply(hidden_states[token_of], received_splits, sent_splits, group)
        outputs = []
        for index, segment in enumerate(rows.split(received_rows)):
            expert = index % local
            gate, up = functional.linear(segment, module.gate_up_proj[expert]).chunk(2, dim=-1)
            outputs.append(functional.linear(module.act_fn(gate) * up, module.down_proj[expert]))
        computed = torch.cat(outputs)
        del outputs, rows
        returned = _AllToAll.apply(computed, sent_splits, received_splits, group)
        weighted = returned * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, token_of, weighted.to(hidden_states.dtype))

    return forward


def apply_ep(
    model: nn.Module, task: ProbeTask, device: torch.device, meshes: Any, capacity_factor: float | None = None
) -> None:
    """model's experts sharded over the ``ep`` dimension of ``meshes`` (a (efsdp, ep) device mesh) and dispatched by
    all-to-all (dropless, or with each expert's capacity ``capacity_factor`` x its fair share), then each experts
    module sharded by FSDP2 over ``efsdp`` (module docstring), in place.

    Raises:
        TaskError: a model without experts in transformers' fused layout, or experts ep does not divide.
    """
    found = expert_modules(model)
    ep_mesh, efsdp_mesh = meshes["ep"], meshes["efsdp"]
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    if not found:
        raise TaskError(f"--ep {ep}: {task.name} has no experts in transformers' fused layout to shard")
    for module in found:
        if module.num_experts % ep:
            raise TaskError(f"--ep {ep} does not divide the model's {module.num_experts} experts")
        local = module.num_experts // ep
        with torch.no_grad():
            for name in _WEIGHTS:
                weight = getattr(module, name)
                shard = weight[rank * local : (rank + 1) * local].detach().clone()
                setattr(module, name, nn.Parameter(shard, requires_grad=weight.requires_grad))
                del weight
        module.forward = _dispatched_forward(module, ep, rank, ep_mesh.get_group(), capacity_factor)
    _shard_experts(model, found, task, device, efsdp_mesh, ep)
    _profiler_marks_outside_checkpointing()


def _profiler_marks_outside_checkpointing() -> None:
    """The experts' FSDP2 unit sits inside its block, so under op-level checkpointing (``--ac op``) its hooks run
    inside the checkpointed region, and they mark the profiler a different number of times in the recomputation
    (FSDP2's ``FSDP::root_pre_forward``, which the forward, inside the root's, skips): torch's selective
    checkpointing keeps those marks by invocation and stopped the recomputation (a DeepSeek-V3 with its first block
    dense, 'profiler._record_function_enter_new.default invocation index 2 encountered during backward'). The marks
    hold no memory and change no result: they run as they come, as SAC runs ``detach`` (its ``SAC_IGNORED_OPS``)."""
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    SAC_IGNORED_OPS.update(
        (
            torch.ops.profiler._record_function_enter_new.default,
            torch.ops.profiler._record_function_exit._RecordFunction,
        )
    )


def _shard_experts(
    model: nn.Module, found: list[nn.Module], task: ProbeTask, device: torch.device, mesh: Any, ep: int
) -> None:
    """Each experts module an FSDP2 unit over the experts' data-parallel ranks, resharded after forward as the block
    it sits in is (the last block is not: autotune/measure/parallelize.py's apply_fsdp)."""
    fully_shard, mixed_precision_policy = fsdp_api()
    kwargs: dict[str, Any] = {"mesh": mesh}
    low = LOW_PRECISION.get(task.precision)
    if low is not None:
        kwargs["mp_policy"] = mixed_precision_policy(param_dtype=low, reduce_dtype=torch.float32)
    if task.offload == "params":
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda" and not is_fake(model))
    if mesh.size() * ep > found[0].num_experts:
        from torch.distributed.tensor import Shard

        kwargs["shard_placement_fn"] = lambda _: Shard(1)  # torchtitan's: fewer experts than shards of them
    with _mesh_coordinates_outside_fake_modes() if is_fake(model) else nullcontext():
        for index, module in enumerate(found):
            fully_shard(module, reshard_after_forward=index < len(found) - 1, **kwargs)


class ExpertParallel(Sharded):
    """FSDP2 over world_size ranks with the experts parallel over ``ep`` of them: rank 0's figures."""

    def __init__(self, world_size: int, ep: int, *, capacity_factor: float | None = None) -> None:
        super().__init__(world_size)
        self.ep = ep
        self.capacity_factor = capacity_factor
        self._meshes: Any = None

    @contextmanager
    def process_group(self, device: torch.device) -> Iterator[Any]:
        from torch.distributed.device_mesh import init_device_mesh

        with super().process_group(device) as group:
            shape = (self.world_size // self.ep, self.ep)
            self._meshes = init_device_mesh(device.type, shape, mesh_dim_names=("efsdp", "ep"))
            try:
                yield group
            finally:
                self._meshes = None

    def wrap(self, model: nn.Module, task: ProbeTask, device: torch.device) -> nn.Module:
        apply_ep(model, task, device, self._meshes, self.capacity_factor)
        return super().wrap(model, task, device)
