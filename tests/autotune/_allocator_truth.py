"""A truth that shares no code with the probe: the model built the ordinary way (its factory on the CPU),
a training step written out by hand, and the peak counted by the CPU allocator itself
(``torch.profiler``'s memory events: every allocation and free the allocator makes, summed in order).

Nothing here imports the probe's meters, trials or strategies: an exactness test that compares the probe
with this is a comparison with the allocator, not with another path of the project.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.profiler import ProfilerActivity, profile

__all__ = ["allocator_peak_bytes"]


@contextmanager
def _fake_group(world_size: int) -> Iterator[Any]:
    """A process group of world_size whose collectives do nothing (rank 0's memory is what is real)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


@contextmanager
def _no_group() -> Iterator[None]:
    yield None


def _sharded(model: nn.Module, block_classes: tuple[type[nn.Module], ...], mesh: Any) -> nn.Module:
    """The FSDP2 recipe as torchtitan's apply_fsdp writes it: every block, the last one not resharded after
    forward (backward gathers it first), then the root."""
    from torch.distributed.fsdp import fully_shard

    blocks = [module for module in model.modules() if isinstance(module, block_classes) and module is not model]
    for index, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=index < len(blocks) - 1)
    fully_shard(model, mesh=mesh)
    return model


def _steps(
    task: Any, micro_batch: int, mesh: Any, build: Callable[[], nn.Module] | None, set_to_none: bool
) -> None:
    """2 micro-batches forward and backward, an AdamW step, zero_grad; twice (docs/design.md, "The trial")."""
    model = task.model() if build is None else build()
    if mesh is not None:
        model = _sharded(model, task.shard_classes, mesh)
    model.train()
    optimizer = task.make_optimizer(model.parameters())
    for _ in range(2):
        for _ in range(2):
            batch = task.batch(micro_batch)
            loss = task.compute_loss(model, batch) / 2
            loss.backward()
            del batch, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    del model, optimizer


def allocator_peak_bytes(
    task: Any,
    micro_batch: int,
    *,
    world_size: int = 1,
    model: Callable[[], nn.Module] | None = None,
    set_to_none: bool = True,
) -> int:
    """The CPU allocator's peak of live bytes over an ordinary build and two accumulated steps at micro_batch.

    world_size > 1: rank 0 of FSDP2 over a fake process group of that size (the task's block classes
    sharded one by one, then the root). model: the model built the ordinary way, written out by the test
    (``get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(...))``,
    ``from_config(config, dtype=torch.bfloat16)``); None calls the task's own factory. Its optimizer gets
    ``model.parameters()``, frozen ones included, as a training script passes them. set_to_none: False for a
    job that keeps its gradients between steps (``zero_grad(set_to_none=False)``).
    """
    # Cyclic garbage of an earlier run (FSDP2's) freed inside the profile makes the count come out low (a
    # block of unknown size to the profiler): collect it before the profile starts.
    gc.collect()
    with _fake_group(world_size) if world_size > 1 else _no_group() as mesh:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _steps(task, micro_batch, mesh, model, set_to_none)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak
