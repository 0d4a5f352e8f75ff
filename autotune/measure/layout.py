"""A job's device mesh, laid out once: torchtitan's fixed order of dimensions (pp, dp, cp, tp; tp innermost, so a
tp group's ranks are neighbours, on one host), the dimensions of more than one rank and dp always (the strategies
shard or reduce over it by name). Every strategy that answers for one rank through a fake process group builds
its mesh here (strategies.py's Sharded and TensorParallel, pipeline/stages.py's ShardedStage, context_parallel.py's
ContextParallel), so a new dimension is laid out in one place.

    >>> Layout(8, Mesh(tp=2, cp=2)).dims
    (('dp', 2), ('cp', 2), ('tp', 2))
    >>> Layout(8, Mesh(tp=2, cp=2)).rank(cp=1)
    2
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from autotune.core.mesh import Mesh
from autotune.measure.fake_group import fake_process_group

__all__ = ["ORDER", "Layout"]

ORDER = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """The mesh of world_size ranks under ``mesh`` (D = W / (tp x pp x cp) data-parallel replicas)."""

    world_size: int
    mesh: Mesh = Mesh()

    @property
    def sizes(self) -> dict[str, int]:
        """Every dimension's size, in ORDER."""
        data_parallel = self.mesh.data_parallel(self.world_size)
        return {"pp": self.mesh.pp, "dp": data_parallel, "cp": self.mesh.cp, "tp": self.mesh.tp}

    @property
    def dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the mesh's dimensions, in ORDER: those of more than one rank, and dp always."""
        return tuple((name, size) for name, size in self.sizes.items() if size > 1 or name == "dp")

    def rank(self, **coordinates: int) -> int:
        """The global rank at coordinates (a dimension left out is 0), row-major in ORDER."""
        rank = 0
        for name, size in self.sizes.items():
            at = coordinates.get(name, 0)
            if not 0 <= at < size:
                raise ValueError(f"{name} coordinate {at} is outside [0, {size})")
            rank = rank * size + at
        return rank

    @contextmanager
    def fake_device_mesh(self, device_type: str, *, rank: int = 0) -> Iterator[Any]:
        """The DeviceMesh of this layout over a fake process group of world_size ranks, this process rank
        ``rank``; the group destroyed on exit (autotune/measure/fake_group.py). The caller checks first that no
        group is initialized, in its own flag's words."""
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = zip(*self.dims, strict=True)
        with fake_process_group(rank, self.world_size):
            yield init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
