"""The search for m_max on an emulated card, in a child process of its own: fake trials with CUDA
semantics, each replayed through the caching allocator's model, decided on reserved + outside bytes as a
real CUDA trial is (autotune/search/reserved.py; ``job: search`` of autotune/emulation/child.py).

The staircase of the allocator's segments (the H200's m = 1195 ... 1212 all reading 1.79 GiB) is in the
replay, so the search finds the step the card's figure crosses the limit at, not the line's crossing.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from autotune.core.cards import Card
from autotune.core.setup import JobSetup
from autotune.search.reserved import CUBLAS_HANDLES
from autotune.search.reserved import cublas_workspace_bytes as _for_capability

__all__ = ["CardSearch", "cublas_workspace_bytes", "search_on_card", "sharing_traces"]

MiB = 1 << 20
# Why a pipeline's stages are walked whole (autotune/search/depth.py covers a whole model's trials).
PIPELINE_WALKED_WHOLE = "a pipeline's stages are walked whole (the depth shortcut repeats a whole model's blocks)"
# Large enough to mean "search for it": what the card holds bounds every trial anyway.
SEARCH_TIMEOUT_SECONDS = 3600.0


# sharing_traces(): the folder where the searches of one run keep the templates of their walks.
_TRACES: ContextVar[str | None] = ContextVar("shared_traces", default=None)


@contextmanager
def sharing_traces() -> Iterator[None]:
    """The card searches started inside share their walks (autotune/search/depth.py): a card of the architecture of
    one searched before (the H100 and the H200: the same compute capability and SMs) reads the templates that one
    made instead of walking the model again; they are kept in a folder of this run, removed after it."""
    with tempfile.TemporaryDirectory(prefix="autotune-traces-") as folder:
        token = _TRACES.set(folder)
        try:
            yield
        finally:
            _TRACES.reset(token)


def cublas_workspace_bytes(card: Card, config: str | None = None) -> int:
    """The workspace of one cuBLAS handle on card (autotune/search/reserved.py says where it comes from).

    >>> from autotune.core.cards import lookup
    >>> cublas_workspace_bytes(lookup("h200")) // MiB
    32
    """
    return _for_capability(card.compute_capability[0], config)


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
    pipeline: dict[str, Any] | None = None  # --pp: each stage's figure at m_max and the bubble (PipelineStages)
    # With breakdown: the figures at m_max and the next size broken down (MemoryBreakdown dicts).
    breakdowns: list[dict[str, Any]] = field(default_factory=list)
    # With predict: the recorded steps at m_max and the plan's sizes (StepRecord dicts: autotune/core/step_records.py).
    steps: list[dict[str, Any]] = field(default_factory=list)


def search_on_card(
    spec: str,
    card: Card,
    *,
    limit_bytes: int,
    outside_bytes: int,
    seq_lens: Sequence[int | None],
    job: JobSetup,
    max_micro_batch: int,
    multiple_of: int,
    extra_sizes: Sequence[int] = (),
    python: str | None = None,
    breakdown: bool = False,
    predict: dict[str, Any] | None = None,
    full_walk: bool = False,
) -> list[CardSearch]:
    """Run the search at each length (None: a task that is not sequence-aware) in one child process with
    the card emulated (autotune/emulation/runner.py): one torch import and one task load for all. ``predict``
    ({"target_batch", "plan_policy"}) records the steps whose time the profile predicts (card_steps.py). ``job`` is the
    setup the child applies to the task it loads (its precision, policy and offload: ``ProbeTask.with_setup``)
    and holds it under (strategy, world size, mesh), sent whole (``JobSetup`` as JSON). ``full_walk``: every block
    of the model walked in every trial, not a few of them repeated (autotune/search/depth.py), to check the shortcut.

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
        "seq_lens": list(seq_lens),
        "setup": job.model_dump(mode="json"),
        "budget_bytes": chosen.device_total_bytes,
        "limit_bytes": limit_bytes,
        "outside_bytes": outside_bytes,
        "workspace_bytes": [cublas_workspace_bytes(chosen, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))] * CUBLAS_HANDLES,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "max_micro_batch": max_micro_batch,
        "multiple_of": multiple_of,
        "extra_sizes": [int(m) for m in extra_sizes],
        "moe_load_factor": current_load_factor(),
        "breakdown": breakdown,
        # The step to predict the time of: the target and plan policy the parent plans with (None: no prediction).
        "predict": predict,
        "full_walk": full_walk,
        "shared_traces": _TRACES.get(),
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
    return [
        CardSearch(
            max_micro_batch=int(one["max_micro_batch"]),
            trials=list(one["trials"]),
            device=dict(found["device"]),
            warnings=list(one["warnings"]),
            fit=one.get("fit"),
            no_fit=bool(one.get("no_fit")),
            pipeline=one.get("pipeline"),
            breakdowns=list(one.get("breakdowns") or ()),
            steps=list(one.get("steps") or ()),
        )
        for one in found["lengths"]
    ]


def _shared_walks(request: dict[str, Any], seq_len: int | None) -> Any:
    """In the child: where this length's search shares its walks (None: this run shares none). The key is what the
    walks depend on: the task, the setup, the length, routing, the breakdown asked for, and what the card's kernels
    take their temporaries and their choice by (its compute capability and SMs: autotune/measure/meters/
    temporaries.py), under this torch; not the card's memory."""
    if not request.get("shared_traces"):
        return None
    import hashlib
    from pathlib import Path

    import torch

    from autotune.measure.meters.temporaries import kernel_facts
    from autotune.search.depth import SharedWalks

    said = [
        request["task"],
        request["setup"],
        seq_len,
        request.get("moe_load_factor"),
        bool(request.get("breakdown")),
        repr(kernel_facts(torch.device("cuda", 0))),
        torch.__version__,
    ]
    key = hashlib.sha256(json.dumps(said, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return SharedWalks(Path(request["shared_traces"]), key)


def child_search(request: dict[str, Any]) -> dict[str, Any]:
    """In the child (torch with the emulation loaded): the search, trial by trial replayed."""
    from contextlib import nullcontext

    import torch

    from autotune.emulation.fake_cuda import device_facts, prepare_fake_cuda
    from autotune.measure.meters.fake import moe_routing
    from autotune.measure.strategy_choice import make_strategy
    from autotune.measure.trial import frozen_heap
    from autotune.search.presearch import fake_strategy
    from autotune.search.reserved import reserved_search
    from autotune.tasks.load import load_task

    prepare_fake_cuda()
    job = JobSetup.model_validate(request["setup"])
    task = load_task(request["task"]).with_setup(job)
    device = device_facts()
    mesh = job.mesh
    # A pipeline's stages run in no process group of their own (autotune/emulation/card_pipeline.py).
    strategy = None if mesh.pp > 1 else fake_strategy(make_strategy(job.strategy, job.world_size, mesh))
    torch.set_num_threads(1)  # fake tensors compute nothing
    routing = moe_routing(float(request.get("moe_load_factor") or 1.0))
    multiple_of = int(request["multiple_of"])
    results: list[dict[str, Any]] = []
    hint: int | None = None
    previous: tuple[int, int] | None = None  # (L, m_max) of the last length that fitted
    group = nullcontext() if strategy is None else strategy.process_group(torch.device("cuda", 0))
    with routing, group, frozen_heap():
        for seq_len in request["seq_lens"]:
            at_length = task if seq_len is None else task.at_length(int(seq_len))
            if strategy is None:
                from autotune.emulation.card_pipeline import pipeline_search_on_card

                found_stages = pipeline_search_on_card(at_length, request, device["name"])
                if not request.get("full_walk"):  # the datasheet says where the depth shortcut is not taken
                    found_stages["warnings"].append(f"depth: every block walked, {PIPELINE_WALKED_WHOLE}")
                results.append(found_stages)
                continue
            if previous is not None and seq_len is not None:
                # Activations grow about as L: the last length's answer, scaled, is where to start.
                hint = max(multiple_of, previous[1] * previous[0] // int(seq_len) // multiple_of * multiple_of)
            found = reserved_search(
                at_length,
                device_type="cuda",
                device_name=device["name"],
                budget_bytes=int(request["budget_bytes"]),
                limit_bytes=int(request["limit_bytes"]),
                outside_bytes=int(request["outside_bytes"]),
                workspace_bytes=[int(n) for n in request["workspace_bytes"]],
                strategy=strategy,
                max_micro_batch=int(request["max_micro_batch"]),
                multiple_of=multiple_of,
                alloc_conf=request.get("alloc_conf"),
                extra_sizes=[int(m) for m in request.get("extra_sizes") or ()],
                hint=hint,
                breakdown=bool(request.get("breakdown")),
                depth_shortcut=not request.get("full_walk"),
                shared_walks=_shared_walks(request, seq_len),
            )
            if not found.no_fit and seq_len is not None:
                previous = (int(seq_len), found.max_micro_batch)
            steps, recorded_how = _steps(request, job, at_length, strategy, device["name"], found)
            results.append(
                {
                    "seq_len": seq_len,
                    "max_micro_batch": found.max_micro_batch,
                    "trials": [t.model_dump(mode="json") for t in found.trials.values()],
                    "warnings": [*found.warnings, *([recorded_how] if recorded_how else [])],
                    "fit": found.fit.model_dump(mode="json") if found.fit is not None else None,
                    "no_fit": found.no_fit,
                    # The profile keeps m_max's and the next size's (autotune/orchestrate/breakdowns.py).
                    "breakdowns": [
                        found.breakdowns[m].model_dump(mode="json")
                        for m in (found.max_micro_batch, found.max_micro_batch + multiple_of)
                        if m in found.breakdowns
                    ],
                    "steps": steps,
                }
            )
    return {"device": device, "lengths": results}


def _steps(
    request: dict[str, Any], job: JobSetup, task: Any, strategy: Any, device_name: str, found: Any
) -> tuple[list[Any], str]:
    """With ``predict``: the recorded steps at m_max and the plan's sizes (autotune/emulation/card_steps.py), and the
    datasheet's line on how the model's depth was recorded (empty: nothing to say)."""
    predict = request.get("predict")
    if not predict or found.no_fit:
        return [], ""
    from autotune.emulation.card_steps import record_steps, sizes_to_record

    sizes = sizes_to_record(job, found.max_micro_batch, predict, int(request["multiple_of"]))
    budget_bytes = int(request["budget_bytes"])
    return record_steps(task, job, strategy, device_name, sizes, budget_bytes, full_walk=bool(request.get("full_walk")))
