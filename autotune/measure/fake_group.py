"""The fake process group one process answers for one rank through, and what it leaves behind in DTensor once
it is destroyed, forgotten.

A probe answers for one rank through a fake process group of the world size (strategies.py, pipeline/stages.py,
context_parallel.py), and a process may probe several meshes in turn (a test worker, a fleet, ``estimate`` over
lengths). DTensor caches its sharding propagation (a Python LRU cache and the C++ dispatcher's fast-path cache),
keyed by specs whose ``DeviceMesh`` compares equal by its ranks, layout and dimension names only, not by its process
groups; a cached output spec carries the mesh of the first call. So a later job whose mesh equals an earlier,
destroyed one (the tp 2 sub-mesh of ranks [0, 1], say, of a (dp, cp, tp) job then of a (dp, tp) job) was handed
the old mesh, and its first collective asked for a group that no longer exists: "Could not resolve the process
group registered under the name 7". Emptying those caches when a group ends makes each job resolve its own: every
strategy's group is made by :func:`fake_process_group`, which does it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["fake_process_group", "forget_meshes"]


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """torch's fake process group (collectives that move nothing) as the default group of ``world_size`` ranks, this
    process rank ``rank``; destroyed on exit, and DTensor's caches of its meshes emptied (:func:`forget_meshes`).
    The caller checks first that no group is initialized, in its own flag's words."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Empty DTensor's sharding-propagation caches (Python and C++), whose entries may hold a destroyed group's
    meshes. Costs the next job a cold cache, nothing else."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()  # type: ignore[attr-defined]
    torch._C._clear_DTensor_sharding_propagator_cache()  # type: ignore[attr-defined]
