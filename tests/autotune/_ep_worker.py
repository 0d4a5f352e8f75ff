"""One rank of a real expert-parallel Mixtral job on gloo (spawned by test_experts.py): the truth for --ep.

Shares no code with the probe: a tiny Mixtral built the ordinary way (``MixtralForCausalLM(MixtralConfig(...))``),
its experts sharded by hand (rank r keeps experts r E/ep .. (r+1) E/ep - 1 of each fused weight), each MoE block's
experts run by a forward written here: the token copies sorted by expert, the counts exchanged with
``all_to_all_single``, the copies sent to their experts' ranks and the outputs sent back by ``all_to_all_single``
(an autograd function whose backward runs the exchange the other way), combined with the router's weights. Then
FSDP2 as torchtitan's ``apply_fsdp`` writes it for a mixture of experts: each experts module over the experts'
data-parallel ranks (efsdp = W / ep), each decoder layer over every rank (the last not resharded after forward),
the root. The router's top-k is forced to an assignment written here, the same on every rank: balanced (token t's
j-th pick is expert (t k + j) mod E) or skewed (the first ``busiest`` tokens pick expert 0 first, every other pick
cycles over experts 1 .. E-1). Steps and peak (the CPU allocator's own running total) are
tests/autotune/_tp_worker.py's; rank 0 writes every rank's peak per size.
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from tests.autotune import _tp_worker
from tests.autotune._ordered_gloo import one_thread_groups, warmed_up

SEQ_LEN = _tp_worker.SEQ_LEN
# tokens -> the forced (tokens, k) assignment, made before a run is counted.
_FORCED: dict[int, torch.Tensor] = {}


def forced_assignment(tokens: int, experts: int, k: int, busiest: int | None) -> torch.Tensor:
    """The assignment every rank routes by (module docstring)."""
    others = itertools.cycle(range(1, experts))
    rows = []
    for token in range(tokens):
        if busiest is None:
            rows.append([(token * k + j) % experts for j in range(k)])
        elif token < busiest:
            rows.append([0] + [next(others) for _ in range(k - 1)])
        else:
            rows.append([next(others) for _ in range(k)])
    return torch.tensor(rows, dtype=torch.int64)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, into: list[int], out_of: list[int], group: Any) -> torch.Tensor:
        ctx.into, ctx.out_of, ctx.group = into, out_of, group
        buffer = rows.new_empty((sum(into), rows.shape[1]))
        dist.all_to_all_single(buffer, rows.contiguous(), into, out_of, group=group)
        return buffer

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        buffer = grad.new_empty((sum(ctx.out_of), grad.shape[1]))
        dist.all_to_all_single(buffer, grad.contiguous(), ctx.out_of, ctx.into, group=ctx.group)
        return buffer, None, None, None


def _expert_parallel_forward(experts: nn.Module, ep: int, group: Any) -> Any:
    total = experts.num_experts
    mine = total // ep

    def forward(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = index.shape[1]
        picks = index.reshape(-1)
        by_expert = torch.argsort(picks, stable=True)
        counts = torch.bincount(picks, minlength=total)
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=group)
        out_of = [int(n) for n in counts.view(ep, mine).sum(1)]
        per_segment = [int(n) for n in incoming]
        into = [sum(per_segment[r * mine : (r + 1) * mine]) for r in range(ep)]
        token = by_expert // k
        arrived = _Exchange.apply(hidden[token], into, out_of, group)
        results = []
        for segment_index, segment in enumerate(arrived.split(per_segment)):
            e = segment_index % mine
            gate, up = functional.linear(segment, experts.gate_up_proj[e]).chunk(2, dim=-1)
            results.append(functional.linear(experts.act_fn(gate) * up, experts.down_proj[e]))
        done = torch.cat(results)
        del results, arrived
        back = _Exchange.apply(done, out_of, into, group)
        scaled = back * weights.reshape(-1)[by_expert, None]
        return torch.zeros_like(hidden).index_add_(0, token, scaled.to(hidden.dtype))

    return forward


def _forced_router(router: nn.Module) -> None:
    original = router.forward

    def forward(hidden_states: torch.Tensor) -> Any:
        logits, scores, indices = original(hidden_states)
        # In place, under topk's own version counter (.data): its backward keeps the indices as a job's does.
        indices.data.copy_(_FORCED[indices.shape[0]])
        return logits, scores, indices

    router.forward = forward


def _model(meshes: Any, config: dict[str, Any]) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from transformers import MixtralConfig, MixtralForCausalLM

    dp_mesh, expert_mesh = meshes
    ep = expert_mesh["ep"].size()
    rank = expert_mesh["ep"].get_local_rank()
    model = MixtralForCausalLM(MixtralConfig(**config))
    layers = list(model.model.layers)
    for layer in layers:
        experts = layer.mlp.experts
        mine = experts.num_experts // ep
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                whole = getattr(experts, name)
                setattr(experts, name, nn.Parameter(whole[rank * mine : (rank + 1) * mine].detach().clone()))
                del whole
        experts.forward = _expert_parallel_forward(experts, ep, expert_mesh["ep"].get_group())
        _forced_router(layer.mlp.gate)
    for index, layer in enumerate(layers):
        fully_shard(layer.mlp.experts, mesh=expert_mesh["efsdp"], reshard_after_forward=index < len(layers) - 1)
    for index, layer in enumerate(layers):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=index < len(layers) - 1)
    fully_shard(model, mesh=dp_mesh)
    model.train()
    return model


def run(
    rank: int,
    world_size: int,
    ep: int,
    rendezvous: str,
    out_dir: str,
    config: dict[str, Any],
    sizes: list[int],
    busiest_per_token: float | None,
) -> None:
    import gc

    gc.freeze()  # the imports are never this rank's garbage: each collection walks only what the job made
    try:
        _run(rank, world_size, ep, rendezvous, out_dir, config, sizes, busiest_per_token)
    except BaseException:
        import traceback

        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def _run(
    rank: int,
    world_size: int,
    ep: int,
    rendezvous: str,
    out_dir: str,
    config: dict[str, Any],
    sizes: list[int],
    busiest_per_token: float | None,
) -> None:
    """busiest_per_token: expert 0's picks per token of the micro-batch (None: balanced)."""
    from torch.distributed.device_mesh import init_device_mesh

    _tp_worker._count_every_thread()
    one_thread_groups()
    _tp_worker._model = _model  # type: ignore[assignment]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        dp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        expert_mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("efsdp", "ep"))
        k, experts = config["num_experts_per_tok"], config["num_local_experts"]
        for m in {1, *sizes}:
            tokens = m * SEQ_LEN
            busiest = None if busiest_per_token is None else round(busiest_per_token * tokens)
            _FORCED[tokens] = forced_assignment(tokens, experts, k, busiest)
        meshes = (dp_mesh, expert_mesh)
        warmed_up(functools.partial(_tp_worker._steps, meshes, config, 1))
        peaks: dict[str, list[int]] = {}
        for m in sizes:
            mine = torch.tensor([_tp_worker._peak_bytes(meshes, config, m)])
            every = [torch.zeros_like(mine) for _ in range(world_size)]
            dist.all_gather(every, mine)
            peaks[str(m)] = [int(t.item()) for t in every]
        if rank == 0:
            Path(out_dir, "peaks.json").write_text(json.dumps(peaks))
        dist.barrier()
    finally:
        dist.destroy_process_group()
