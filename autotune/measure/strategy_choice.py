"""The strategy of a job by its name and mesh, the one selector: ``ddp`` or ``fsdp`` at a world size; with a mesh
of pp > 1 how a pipeline stage holds its part of the model; with tp > 1 or cp > 1 one rank of its tensor- or
context-parallel group (apart from autotune/measure/strategies.py so that the context-parallel and pipeline
strategies, which build on that module, are not imported by it: a circle otherwise). What does not compose is
refused by the composition table (autotune/core/compositions.py) before any of these is built.
"""

from __future__ import annotations

from autotune.core.compositions import Dimensions, refuse_composition
from autotune.core.errors import AutotuneError
from autotune.core.mesh import Mesh
from autotune.core.schemas import STRATEGIES
from autotune.measure.strategies import Replicated, Sharded, Strategy, TensorParallel

__all__ = ["make_strategy"]


def make_strategy(name: str, world_size: int, mesh: Mesh | None = None) -> Strategy:
    """The strategy called name ("ddp" or "fsdp") at world_size: with a mesh of pp > 1, how each stage holds its
    part (:func:`_stage_strategy`); with cp > 1, rank 0 of its context-parallel group, name over every rank
    (autotune/measure/context_parallel.py); with tp > 1, rank 0 of its tensor-parallel group
    (autotune/measure/tensor_parallel.py), name then over the data-parallel replicas.

    Raises:
        AutotuneError: a composition the table refuses, or a name that is not a strategy.
    """
    mesh = mesh or Mesh()
    refuse_composition(Dimensions.of(name, world_size, mesh))
    if name not in STRATEGIES:
        raise AutotuneError(f"strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")
    if mesh.pp > 1:
        return _stage_strategy(name, mesh, world_size)
    if mesh.cp > 1:
        from autotune.measure.context_parallel import ContextParallel

        return ContextParallel(world_size, mesh, inner=name)
    if mesh.tp > 1:
        return TensorParallel(world_size, mesh, inner=name)
    if mesh.ep > 1:  # fsdp alone beside it (the table): autotune/measure/experts.py
        from autotune.measure.experts import ExpertParallel

        return ExpertParallel(world_size, mesh.ep, capacity_factor=mesh.ep_capacity)
    return Replicated(world_size) if name == "ddp" else Sharded(world_size)


def _stage_strategy(name: str, mesh: Mesh, world_size: int) -> Strategy:
    """How a stage holds its part of the model: whole, as one replica of D = W / (pp x tp) (ddp: with D > 1 the
    stage holds the gradient buckets of the DDP that wraps it over its data-parallel group); sharded by FSDP2 over
    that group (fsdp); with tp > 1 parallelized over its tensor-parallel group first (ShardedStage; under ddp the
    buckets are of the local shards)."""
    from autotune.measure.pipeline import ShardedStage, StageStrategy

    if name == "fsdp" or mesh.tp > 1 or mesh.cp > 1:
        return ShardedStage(world_size, mesh.pp, tp=mesh.tp, cp=mesh.cp, inner=name)
    return StageStrategy(1, replicas=mesh.data_parallel(world_size))
