"""The strategy of a job by its name and mesh: ``ddp`` or ``fsdp`` at a world size, and with a mesh of tp > 1 or
cp > 1 one rank of its tensor- or context-parallel group (apart from autotune/measure/strategies.py so that the
context-parallel strategy, which builds on that module, is not imported by it: a circle otherwise).
"""

from __future__ import annotations

from autotune.core.errors import AutotuneError
from autotune.core.mesh import Mesh
from autotune.core.schemas import STRATEGIES
from autotune.measure.strategies import Replicated, Sharded, Strategy, TensorParallel

__all__ = ["make_strategy"]


def make_strategy(name: str, world_size: int, mesh: Mesh | None = None) -> Strategy:
    """The strategy called name ("ddp" or "fsdp") at world_size; with a mesh of tp > 1, rank 0 of its
    tensor-parallel group (autotune/measure/tensor_parallel.py), name then over the data-parallel replicas; with
    cp > 1, rank 0 of its context-parallel group, name over every rank (autotune/measure/context_parallel.py)."""
    if mesh is not None and not mesh.trivial:
        if mesh.cp > 1:  # one rank of a context-parallel group: autotune/measure/context_parallel.py
            from autotune.measure.context_parallel import ContextParallel

            return ContextParallel(world_size, mesh, inner=name)
        if mesh.pp > 1:
            raise AutotuneError(f"--pp is not measured here (asked: {mesh.describe()})")
        return TensorParallel(world_size, mesh, inner=name)
    if name == "ddp":
        return Replicated(world_size)
    if name == "fsdp":
        return Sharded(world_size)
    raise AutotuneError(f"strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")
