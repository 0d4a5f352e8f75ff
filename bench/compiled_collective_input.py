"""torch's limit behind the refusal of a compiled tp block fed a pending collective (autotune/measure/pipeline/,
PENDING_COLLECTIVE_INPUT), on a job built by hand with no code of autotune: 2 gloo ranks, an embedding sharded
row-wise over tp (its output funcol's AsyncCollectiveTensor until waited) feeding a tp block compiled as a function
and as a module, then backward. Prints each way's outcome; the same block given the waited (plain) tensor runs.

    .venv/bin/python bench/compiled_collective_input.py
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _rank(rank: int, rendezvous: str) -> None:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        torch.manual_seed(0)
        embedding = nn.Embedding(16, 8)
        parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for how in ("compiled forward", "compiled module", "compiled forward, input waited"):
            torch._dynamo.reset()
            call = torch.compile(block) if how == "compiled module" else torch.compile(block.forward)
            hidden = embedding(torch.randint(0, 16, (2, 4)))
            kind = type(hidden).__name__
            if how.endswith("waited") and isinstance(hidden, AsyncCollectiveTensor):
                hidden = hidden.trigger_wait()
            try:
                call(hidden).sum().backward()
                outcome = "runs"
            except Exception as exc:  # the outcome is what this prints
                outcome = f"fails: {type(exc).__name__}: {exc}"
            if rank == 0:
                print(f"{how} (input {kind}): {outcome}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(f"torch {torch.__version__}")
    mp.spawn(_rank, args=(tempfile.mktemp(),), nprocs=2)
