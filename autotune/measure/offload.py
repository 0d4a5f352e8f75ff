"""Offload: what a job keeps in host memory instead of the device's, and how the probe counts it.

A dimension of the task (``ProbeTask.offload``, ``--offload``), applied in one place each: the blocks' saved
activations where a trial builds its model (``autotune.measure.trial.build_model``, after the memory policy),
FSDP2's ``CPUOffloadPolicy`` where the fsdp strategy shards it (``autotune.measure.strategies``). The device's
bytes decide m, as always; the host's are their own figure (``Trial.host_peak_bytes``, the ledger of
``autotune.measure.meters.host``), and ``--host-budget`` can refuse a size by them.

- ``activations``: every block (the modules a memory policy wraps and ``--strategy fsdp`` shards) runs its
  forward under ``torch.autograd.graph.save_on_cpu``: each tensor autograd saves for the block's backward is
  copied to the host when saved (pinned on a card) and copied back to the device when the backward needs it.
  What is not inside a block (embeddings, the head, the loss) keeps its activations on the device. A block a
  policy checkpoints saves nothing through these hooks (checkpoint's own, innermost, keep its inputs and
  recompute the rest), so offload and checkpointing compose block by block.
- ``params`` (``--strategy fsdp`` only): FSDP2's ``CPUOffloadPolicy``: the sharded parameters, their gradients
  and the optimizer's state live on the host, each unit's shards are copied to the device to be all-gathered,
  each gradient shard is copied to the host after its reduce-scatter, and the optimizer steps on the CPU.

What each device measures, and what it assumes:

- **A card** (CUDA): the device's figure is the caching allocator's, as without offload; the host's is the
  bytes of the packed activations (``activations``), of the shards, gradients and optimizer state as held when
  a step ends (``params``; the CPU step's own temporaries are not counted on a card).
- **An emulated card** (fake CUDA tensors): device and host are told apart by the tensors' devices; both are
  counted, the host's as on a card.
- **The CPU**: host and device are one memory, and torch's own hooks move nothing there (``tensor.cpu()`` is
  the tensor itself; FSDP2's ``.cpu()`` and ``.to(device)`` of a CPU mesh are no-ops). The probe counts what a
  card would hold on the host as host bytes and leaves it out of the device's: a packed activation is a copy
  made on the host and its unpacking a copy made on the device, as a card makes them (the copies are forced
  here, so the device's bytes are a card's); under ``params`` the shards, each unit's gradient shards from
  their reduce-scatter on, and everything the optimizer step makes are host bytes. Not seen under ``params``:
  the staging copies of one unit's shards that a card makes on the device just before the all-gather copies
  them in (at most one unit's shard bytes, for the moment of an all-gather).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import save_on_cpu

from autotune.core.errors import TaskError
from autotune.core.schemas import OFFLOADS
from autotune.measure.meters.host import HOST, host_span

__all__ = [
    "OFFLOADS",
    "CPU_HOST_NOTE",
    "HostActivations",
    "apply_offload",
    "check_offload",
    "host_capped_hint",
    "host_storages_of",
    "offload_fields",
    "offload_params_to_host",
    "step_on_host",
]

# What an offloaded block's instance carries, so that its forward is never wrapped twice.
_MARK = "_autotune_offloaded"

Forward = Callable[..., Any]


def check_offload(offload: str) -> str:
    """``offload`` when it names an offload; a one-line TaskError otherwise (with which strategy it goes is the
    composition table's: autotune/core/compositions.py)."""
    if offload not in OFFLOADS:
        raise TaskError(f"--offload {offload!r}: not an offload; use one of {', '.join(OFFLOADS)}")
    return offload


class HostActivations(save_on_cpu):
    """``torch.autograd.graph.save_on_cpu`` with its copies counted as a card makes them.

    On a card it is torch's hook pair as it stands (pinned copies where ``pin_memory``); every packed copy is
    added to the host ledger. On the CPU, where torch's pack returns the tensor itself, the pack makes the
    host copy and the unpack the device copy that a card's ``tensor.cpu()`` and ``tensor.to(device)`` make.
    """

    def __init__(self, pin_memory: bool = False) -> None:
        super().__init__(pin_memory=pin_memory, device_type="cuda")
        torch_pack, torch_unpack = self.pack_hook, self.unpack_hook

        def pack(tensor: torch.Tensor) -> Any:
            with host_span("activations"):
                if tensor.device.type == "cpu":
                    packed = (tensor.device, tensor.to("cpu", copy=True))
                else:
                    packed = torch_pack(tensor)
            host = packed[1]
            if host.layout == torch.strided:
                HOST.add(host.untyped_storage(), "activations")
            return packed

        def unpack(packed: Any) -> torch.Tensor:
            device, host = packed
            if device.type == "cpu":
                return host.to(device, copy=True)  # type: ignore[no-any-return]
            return torch_unpack(packed)  # type: ignore[no-any-return]

        self.pack_hook, self.unpack_hook = pack, unpack


def _offloaded(forward: Forward, pin_memory: bool) -> Forward:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with HostActivations(pin_memory=pin_memory):
            return forward(*args, **kwargs)

    return run


def _pins(model: nn.Module) -> bool:
    """Whether host copies are pinned: on a real card (torch's recommendation for save_on_cpu), not on the
    CPU or an emulated card (fake tensors have no host pages to pin)."""
    first = next(iter(model.parameters()), None)
    return (
        first is not None
        and first.device.type == "cuda"
        and not isinstance(first, FakeTensor)
        and torch.cuda.is_available()
    )


def apply_offload(
    model: nn.Module,
    offload: str,
    shard_classes: tuple[type[nn.Module], ...] | None,
    *,
    task_name: str = "task",
) -> int:
    """Run every block of ``model`` under :class:`HostActivations` where ``offload`` is ``activations``.

    Returns:
        How many blocks offload their saved activations (0 for another offload).

    Raises:
        TaskError: an unknown offload; ``activations`` on a model with no block (one line naming shard_classes).
    """
    check_offload(offload)
    if offload != "activations":
        return 0
    from autotune.measure.policies import blocks

    units = blocks(model, shard_classes)
    if not units:
        raise TaskError(
            f"--offload activations found no block in {type(model).__name__} of task {task_name!r}: it has no "
            "nn.ModuleList; name the block classes in the task (ProbeTask(shard_classes=(Block,)))"
        )
    pin_memory = _pins(model)
    for unit in units:
        if not getattr(unit, _MARK, False):
            unit.forward = _offloaded(unit.forward, pin_memory)  # type: ignore[method-assign]
            setattr(unit, _MARK, True)
    return len(units)


def _storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages holding a tensor's bytes: a DTensor's local shard, a plain tensor's own."""
    local = getattr(tensor, "_local_tensor", None)
    inner = local if isinstance(local, torch.Tensor) else tensor
    if inner.layout == torch.strided:
        yield inner.untyped_storage()


def _to_host(meter: Any, storage: torch.UntypedStorage, part: str) -> None:
    to_host = getattr(meter, "to_host", None)  # the CPU meter's (and the fake one's): off the device's count
    if to_host is not None:
        to_host(storage, part)
    else:
        HOST.add(storage, part)


def offload_params_to_host(model: nn.Module, offload: str, meter: Any) -> None:
    """Under ``params``, after the strategy sharded ``model``: its shards are host memory, and so is each
    gradient shard from the moment FSDP2 hands it over (a post-accumulate-grad hook, which FSDP2 calls right
    after its copy to the host)."""
    if offload != "params":
        return
    for param in model.parameters():
        for storage in _storages(param):
            _to_host(meter, storage, _parameters_part(param))

        def grad_to_host(param: torch.Tensor) -> None:
            if param.grad is not None:
                for storage in _storages(param.grad):
                    _to_host(meter, storage, "gradients")

        param.register_post_accumulate_grad_hook(grad_to_host)


def _parameters_part(param: torch.Tensor) -> str:
    return "trainable_parameters" if param.requires_grad else "frozen_parameters"


def host_storages_of(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.UntypedStorage, str]]:
    """The storages of the optimizer's parameters, their gradients and its state, each with its part."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            for storage in _storages(param):
                yield storage, _parameters_part(param)
            if param.grad is not None:
                for storage in _storages(param.grad):
                    yield storage, "gradients"
            for value in optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor):
                    for storage in _storages(value):
                        yield storage, "optimizer_state"


@contextmanager
def step_on_host(offload: str, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around the optimizer's step and zero_grad: under ``params`` the step runs on the CPU, so all it makes
    is host memory (the CPU meter counts it there, as temporaries), and what it holds after is added to the host
    ledger with its part (a card's meter sees no host memory of its own; the CPU's learns which of the step's
    allocations are the optimizer's state)."""
    if offload != "params":
        yield
        return
    with host_span("temporaries"):
        yield
    for storage, part in host_storages_of(optimizer):
        if storage.device.type == "cpu":
            HOST.add(storage, part)


# What the datasheet says of the CPU device's host bytes (module docstring: what is measured, what assumed).
CPU_HOST_NOTE = (
    "--offload {offload} on the CPU: host and device are one memory here; the device's bytes leave out what a "
    "card would hold on the host ({what}), counted as host bytes"
)
_CPU_WHAT = {
    "activations": "the copies save_on_cpu packs, made here as a card makes them",
    "params": "FSDP2's shards, gradient shards and optimizer state, and the CPU step; not the device copies of "
    "one unit's shards a card stages for an all-gather",
}


def offload_fields(
    offload: str,
    host_budget_bytes: int | None,
    trials: list[Any],
    m_max: int,
    device_type: str,
    warnings: list[str],
) -> dict[str, Any]:
    """The profile's offload fields (``offload``, ``host_peak_bytes`` at m_max, ``host_budget_bytes``), and on
    the CPU a warning saying what its host bytes are; nothing for a job without offload (its profile stays as
    it was)."""
    if offload == "none":
        return {}
    if device_type == "cpu":
        warnings.append(CPU_HOST_NOTE.format(offload=offload, what=_CPU_WHAT[offload]))
    at_max = [t.host_peak_bytes for t in trials if t.micro_batch == m_max and t.host_peak_bytes is not None]
    return {
        "offload": offload,
        "host_peak_bytes": max(at_max) if at_max else None,
        "host_budget_bytes": host_budget_bytes,
    }


def host_capped_hint(hint: int, trials: list[Any], host_budget_bytes: int | None, multiple_of: int) -> int:
    """The fake pre-search's m_max (``hint``) capped where the host's bytes cross ``host_budget_bytes``: the line
    through the fake trials' host bytes (affine in m: packed activations grow with m, shards do not), read at
    multiples of ``multiple_of``. The real trials decide either way; this only spares those above the cap.

    >>> from types import SimpleNamespace as T
    >>> host_capped_hint(64, [T(micro_batch=2, host_peak_bytes=300), T(micro_batch=3, host_peak_bytes=400)], 1000, 1)
    9
    """
    points = sorted({(t.micro_batch, t.host_peak_bytes) for t in trials if t.host_peak_bytes is not None})
    if host_budget_bytes is None or len({m for m, _ in points}) < 2:
        return hint
    (m0, h0), (m1, h1) = points[0], points[-1]
    slope = (h1 - h0) / (m1 - m0)
    fixed = h0 - slope * m0
    if slope <= 0:
        return hint if fixed <= host_budget_bytes else multiple_of
    largest = int((host_budget_bytes - fixed) // slope)
    return max(multiple_of, min(hint, largest - largest % multiple_of))
