"""The search for m_max on an emulated card: fake trials with CUDA semantics, each replayed through the
caching allocator's model, decided on reserved + outside bytes as a real CUDA trial is.

One child process runs the whole search (``job: search`` of autotune/emulation/child.py): the search
policy (autotune/search/boundary.py) asks for one size after another, and each answer is

    peak_bytes = reserved bytes of (the cuBLAS workspaces, the trial's allocations and frees in order)
                 + the memory outside the allocator (the CUDA context and modules: autotune/core/cards.py)

The staircase of the allocator's segments (the H200's m = 1195 ... 1212 all reading 1.79 GiB) is in the
replay, so the search finds the step the card's figure crosses the limit at, not the line's crossing.

The named allocations beside the trace (no fudge factor: each is an allocation the source makes):

- two cuBLAS workspaces, one per handle: the forward thread's and the autograd engine's backward
  thread's (ATen/cuda/CublasHandlePool.cpp, ``getChosenWorkspaceSize``: 32 MiB on compute capability 9.x
  and up, 4096 * 1024 * 2 + 16 * 1024 * 8 bytes before; ``CUBLAS_WORKSPACE_CONFIG`` overrides), allocated
  through the caching allocator at the first matmul of each thread and kept for the process's life.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune.core.cards import Card

__all__ = ["CardSearch", "cublas_workspace_bytes", "search_on_card"]

MiB = 1 << 20
# cuBLAS handles whose workspaces a training step holds: the forward thread's and the backward's.
CUBLAS_HANDLES = 2
# Large enough to mean "search for it": what the card holds bounds every trial anyway.
SEARCH_TIMEOUT_SECONDS = 3600.0


def cublas_workspace_bytes(card: Card, config: str | None = None) -> int:
    """The workspace of one cuBLAS handle on card (ATen/cuda/CublasHandlePool.cpp).

    ``config``: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs, their products summed), None for
    the default.

    >>> from autotune.core.cards import lookup
    >>> cublas_workspace_bytes(lookup("h200")) // MiB
    32
    >>> cublas_workspace_bytes(lookup("a100-80gb"))
    8519680
    >>> cublas_workspace_bytes(lookup("h200"), ":4096:2:16:8") == 4096 * 1024 * 2 + 16 * 1024 * 8
    True
    """
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if card.compute_capability[0] >= 9:
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclass(frozen=True)
class CardSearch:
    """What the search on an emulated card found: m_max, every trial (as Trial dicts), the device as
    the child's torch read it, and the warnings of its task."""

    max_micro_batch: int
    trials: list[dict[str, Any]]
    device: dict[str, Any]
    warnings: list[str]
    fit: dict[str, float] | None
    no_fit: bool


def search_on_card(
    spec: str,
    card: Card,
    *,
    limit_bytes: int,
    outside_bytes: int,
    seq_len: int | None,
    strategy: str,
    world_size: int,
    precision: str | None,
    activation_checkpointing: str | None,
    max_micro_batch: int,
    multiple_of: int,
    extra_sizes: Sequence[int] = (),
    python: str | None = None,
) -> CardSearch:
    """Run the search in one child process with the card emulated (autotune/emulation/runner.py).

    Raises:
        CudaTorchMissing: no CUDA build of torch here (the caller falls back to CPU semantics).
        EmulationError: the emulation or the child failed, in one line.
    """
    from autotune.emulation.runner import _prepare, _run_child
    from autotune.measure.meters.fake import current_load_factor

    chosen, torch, libraries = _prepare(card, python)
    request = {
        "job": "search",
        "task": spec,
        "seq_len": seq_len,
        "strategy": strategy,
        "world_size": world_size,
        "precision": precision,
        "activation_checkpointing": activation_checkpointing,
        "budget_bytes": chosen.device_total_bytes,
        "limit_bytes": limit_bytes,
        "outside_bytes": outside_bytes,
        "workspace_bytes": [cublas_workspace_bytes(chosen, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))]
        * CUBLAS_HANDLES,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "max_micro_batch": max_micro_batch,
        "multiple_of": multiple_of,
        "extra_sizes": [int(m) for m in extra_sizes],
        "moe_load_factor": current_load_factor(),
    }
    found, _ = _run_child(
        chosen,
        torch,
        libraries,
        request,
        timeout_seconds=SEARCH_TIMEOUT_SECONDS,
        disable=(),
        what=f"the search of {spec}",
    )
    return CardSearch(
        max_micro_batch=int(found["max_micro_batch"]),
        trials=list(found["trials"]),
        device=dict(found["device"]),
        warnings=list(found["warnings"]),
        fit=found.get("fit"),
        no_fit=bool(found.get("no_fit")),
    )


def child_search(request: dict[str, Any]) -> dict[str, Any]:
    """In the child (torch with the emulation loaded): the search, trial by trial replayed."""
    import dataclasses

    import torch

    from autotune.core.allocator import AllocatorConfig, replay
    from autotune.core.schemas import Trial
    from autotune.emulation.fake_cuda import device_facts, prepare_fake_cuda, renumbered
    from autotune.measure.meters.fake import FakeMeter, moe_routing
    from autotune.measure.strategies import make_strategy
    from autotune.measure.trial import TrialRunner, frozen_heap
    from autotune.search.boundary import NoFitError, find_max_micro_batch
    from autotune.search.presearch import fake_strategy
    from autotune.tasks.load import load_task

    prepare_fake_cuda()
    task = load_task(request["task"])
    changes = {k: request[k] for k in ("precision", "activation_checkpointing") if request.get(k) is not None}
    if changes:
        task = dataclasses.replace(task, **changes)
    if request.get("seq_len") is not None:
        task = task.at_length(int(request["seq_len"]))
    budget = int(request["budget_bytes"])
    limit = int(request["limit_bytes"])
    outside = int(request["outside_bytes"])
    config = AllocatorConfig.parse(request.get("alloc_conf"))
    # The workspaces come first: each is made at its thread's first matmul, before the trial's peak.
    workspaces = [(-(i + 1), int(n)) for i, n in enumerate(request["workspace_bytes"])]
    device = device_facts()
    meter = FakeMeter(budget, "cuda", device["name"])
    strategy = fake_strategy(make_strategy(request["strategy"], int(request["world_size"])))
    torch.set_num_threads(1)  # fake tensors compute nothing
    seen: dict[int, Trial] = {}

    def trial(micro_batch: int) -> Trial:
        meter.release()
        with meter.record_events() as recorded:
            live = runner(micro_batch)
        if live.oom:  # live bytes alone crossed the card's memory: no replay can fit
            result = live.model_copy(update={"fake": True, "fits": False})
        else:
            held, events = renumbered(recorded.held, recorded.events)
            # A release of a storage the recording never saw (id 0) frees nothing the replay holds.
            trace = workspaces + [(k, n) for k, n in held] + [(k, n) for k, n in events if k != 0]
            peaks = replay(trace, config, budget - outside)
            oom = peaks.oom
            if oom:
                figure = budget + 1
                result = Trial(micro_batch=micro_batch, peak_bytes=figure, fits=False, oom=True, fake=True)
            else:
                figure = peaks.peak_reserved_bytes + outside
                result = Trial(
                    micro_batch=micro_batch,
                    peak_bytes=figure,
                    fits=figure <= limit,
                    forward_backward_bytes=None,
                    step_bytes=live.step_bytes,
                    allocated_bytes=peaks.peak_allocated_bytes,
                    outside_allocator_bytes=outside,
                    seconds=live.seconds,
                    fake=True,
                )
        seen[micro_batch] = result
        return result

    no_fit = False
    routing = moe_routing(float(request.get("moe_load_factor") or 1.0))
    with routing, strategy.process_group(meter.device), frozen_heap():
        runner = TrialRunner(task, meter, limit_bytes=budget, strategy=strategy)
        try:
            try:
                found = find_max_micro_batch(
                    trial,
                    limit_bytes=limit,
                    max_micro_batch=int(request["max_micro_batch"]),
                    multiple_of=int(request["multiple_of"]),
                    far_extrapolation=1e9,  # fake trials: an overshoot costs no device
                )
                m_max, fit = found.max_micro_batch, found.fit
            except NoFitError:
                m_max, fit, no_fit = 0, None, True
            for size in request.get("extra_sizes") or ():
                if size not in seen:
                    trial(int(size))
        finally:
            runner.close()
    return {
        "max_micro_batch": m_max,
        "trials": [t.model_dump(mode="json") for t in seen.values()],
        "device": device,
        "warnings": runner.warnings,
        "fit": fit.model_dump(mode="json") if fit is not None else None,
        "no_fit": no_fit,
    }
