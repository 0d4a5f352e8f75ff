"""`autotune estimate --gpu NAME`: the datasheet of a named card, from a host without it.

The search runs in a child process where a CUDA build of torch sees the card emulated (autotune/emulation/):
CUDA's dispatch, autocast lists, attention kernels and optimizer paths. Each fake trial's allocations are
replayed through the caching allocator's model (autotune/core/allocator.py), and the figure the search
decides on is the one a real CUDA trial records: reserved bytes + the memory outside the allocator.

Without a CUDA build of torch here, the estimate runs with CPU semantics (autotune/orchestrate/estimate.py)
for the card's budget and name, and says what to install.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autotune.core import units
from autotune.core.cards import OUTSIDE_ALLOCATOR, Card, outside_allocator, outside_allocator_stand_in
from autotune.core.errors import AutotuneError, CannotFitError
from autotune.core.schemas import Device, Fit, MemoryBreakdown, PipelineStages, Profile, Throughput, Trial
from autotune.core.units import format_bytes
from autotune.core.unmodelled import UnmodelledBound, unmodelled_bound
from autotune.orchestrate.config import EstimateConfig
from autotune.orchestrate.estimated import estimated_profile
from autotune.tasks.task import ProbeTask

if TYPE_CHECKING:
    from collections.abc import Callable

    from autotune.emulation.card_search import CardSearch

__all__ = ["EmulationUnavailable", "context_bytes_for", "estimate_on_card", "estimate_on_card_lengths"]


class EmulationUnavailable(AutotuneError):
    """The card cannot be emulated here (no CUDA build of torch, a runtime the emulation does not cover,
    a child that died or hung): the estimate runs with CPU semantics and says why, in this one line."""


def context_bytes_for(
    card: Card, given: int | None, torch_version: str, cuda_version: str, given_source: str | None = None
) -> tuple[int, str]:
    """The memory outside the allocator an estimate adds for card, and where the figure comes from.

    ``given`` (``--context-bytes``) wins; then what is known for this card, torch and CUDA; then what is
    known for this card with another torch; then the H200's measured figure, said to be a stand-in.
    """
    if given is not None:
        return given, f"{format_bytes(given)} outside the allocator ({given_source or '--context-bytes'})"
    known = outside_allocator(card, torch_version, cuda_version)
    if known is not None:
        return known.bytes, f"{format_bytes(known.bytes)} outside the allocator ({known.source})"
    for (short, torch_mm, cuda_mm), figure in OUTSIDE_ALLOCATOR.items():
        if short == card.short_name:
            return figure.bytes, (
                f"{format_bytes(figure.bytes)} outside the allocator, measured with torch {torch_mm} and CUDA "
                f"{cuda_mm}, not {torch_version} and {cuda_version} (--context-bytes to say otherwise)"
            )
    stand_in = outside_allocator_stand_in(card)
    return stand_in.bytes, (
        f"{format_bytes(stand_in.bytes)} outside the allocator: not measured on a {card.short_name}; the H200's "
        f"figure stands in ({stand_in.source}; --context-bytes to say otherwise)"
    )


def bound_line(bound: UnmodelledBound) -> str:
    """The datasheet's words for the safe bound: its share and each part's."""
    parts = "; ".join(f"{part.name} {format_bytes(part.bytes)} ({part.why})" for part in bound.parts)
    return (
        f"safe bound: each figure includes {format_bytes(bound.bytes)} for what the emulation does not model: "
        f"{parts} (--estimate-bound tight leaves it out; docs/cuda-estimates.md)"
    )


def estimate_on_card(
    task: ProbeTask, config: EstimateConfig, *, on_trial: Callable[[Trial], None] | None = None
) -> Profile:
    """The estimate for config.card by emulated CUDA fake trials.

    Raises:
        EmulationUnavailable: the card cannot be emulated here (the caller estimates with CPU semantics).
        EmulatedJobError (a TrialError): the task failed in the emulated child, at a size or at its load: an
            error of the estimate, not a reason for CPU semantics (autotune/emulation/runner.py says which is which).
        CannotFitError: micro-batch multiple_of does not fit the card.
        AutotuneError: the task has no spec to load in the child.
    """
    return _on_card(task, config, [task.seq_len], on_trial)[0]


def estimate_on_card_lengths(
    task: ProbeTask,
    config: EstimateConfig,
    lengths: Sequence[int],
    *,
    on_trial: Callable[[Trial], None] | None = None,
) -> list[Profile]:
    """The estimate at each length for config.card, in one child process (one torch import, one task
    load; each length's search starts from the last one's answer, scaled by the lengths); a length where
    nothing fits is named in the others' warnings.

    Raises:
        CannotFitError: nothing fits at any length (the shortest length's figure is named).
        EmulationUnavailable, AutotuneError: as :func:`estimate_on_card`.
    """
    return _on_card(task, config, list(lengths), on_trial)


def _on_card(
    task: ProbeTask,
    config: EstimateConfig,
    seq_lens: Sequence[int | None],
    on_trial: Callable[[Trial], None] | None,
) -> list[Profile]:
    from autotune.emulation.build import EmulationError, inspect_cuda_torch
    from autotune.emulation.card_search import search_on_card
    from autotune.emulation.runner import CudaTorchMissing, find_cuda_python

    setup, card = config.probe, config.card
    assert card is not None and setup.budget_bytes is not None
    task = setup.applied_to(task)  # the child gets the precision and policy by name, from the task
    if task.source is None:
        raise AutotuneError(
            f"--gpu runs the fake trials of task {task.name!r} in a process of its own, which loads it from its "
            "spec: load it with autotune.load_task('file.py:name') (or from the command line)"
        )
    try:
        cuda_torch = inspect_cuda_torch(find_cuda_python())
    except (CudaTorchMissing, EmulationError) as exc:
        raise EmulationUnavailable(str(exc)) from None
    started = time.perf_counter()
    outside, outside_source = context_bytes_for(
        card, config.context_bytes, cuda_torch.torch_version, cuda_torch.cuda_version, config.context_source
    )
    limit_bytes = units.limit_bytes(setup.budget_bytes, setup.headroom)
    # --estimate-bound safe: what the figure does not model, bounded, joins the memory outside the allocator.
    bound = unmodelled_bound(card, setup.world_size, setup.mesh, os.environ)
    bounded = config.estimate_bound == "safe" and bound.bytes > 0
    bound_notes: list[str] = []
    if bounded:
        outside += bound.bytes
        bound_notes.append(bound_line(bound))
    elif bound.bytes:
        bound_notes.append(
            f"tight (--estimate-bound tight): NCCL's buffers are not in the figures, up to "
            f"{format_bytes(bound.bytes)} more on the card"
        )
    if outside >= limit_bytes:
        safe = (
            f" (with the safe bound's {format_bytes(bound.bytes)} for NCCL's buffers: --estimate-bound tight "
            "leaves it out)"
            if bounded
            else ""
        )
        raise CannotFitError(
            f"the {format_bytes(outside)} outside the allocator on a {card.short_name}{safe} leave nothing of the "
            f"{format_bytes(limit_bytes)} limit (budget less headroom)"
        )
    try:
        searches = search_on_card(
            task.source,
            card,
            limit_bytes=limit_bytes,
            outside_bytes=outside,
            seq_lens=seq_lens,
            # The setup, whole: the task's precision, policy and offload as applied above, and the config's ranks.
            job=task.job_setup(strategy=setup.strategy, world_size=setup.world_size, mesh=setup.mesh),
            max_micro_batch=setup.max_micro_batch,
            multiple_of=setup.multiple_of,
            extra_sizes=config.micro_batches,
            breakdown=setup.breakdown,
            # The steps whose time the profile predicts (autotune/orchestrate/predicted.py), at the plan's sizes.
            predict={"target_batch": setup.target_batch, "plan_policy": setup.plan_policy} if config.predict else None,
            full_walk=config.full_walk,
        )
    except EmulationError as exc:
        raise EmulationUnavailable(str(exc)) from None
    semantics = (
        f"emulated {card.nvml_name} (compute capability {card.capability}) with CUDA semantics: fake trials "
        f"under torch {cuda_torch.torch_version}, reserved bytes by the caching allocator's model, "
        f"plus {outside_source}"
    )
    # --gpu NAME --gpu-memory: a card the catalog lacks, with the architecture it was given.
    unlisted = [f"{card.nvml_name} is {card.source}; assumed: {card.assumed}"] if card.assumed_from else []
    device = Device(
        kind="cuda",
        name=card.nvml_name,
        total_bytes=setup.budget_bytes,
        torch_version=cuda_torch.torch_version,
        cuda_version=cuda_torch.cuda_version,
        compute_capability=card.capability,
    )
    nothing_fits: list[str] = []
    made: list[tuple[ProbeTask, CardSearch, list[Trial]]] = []
    for seq_len, found in zip(seq_lens, searches, strict=True):
        at_length = task if seq_len is None or task.seq_len == seq_len else task.at_length(seq_len)
        trials = [Trial.model_validate(raw) for raw in found.trials]
        for trial in trials:
            if on_trial is not None:
                on_trial(trial.at_length(seq_len))
        if found.no_fit:
            at = next((t for t in trials if t.micro_batch == setup.multiple_of), None)
            read = at is not None and not at.oom
            figure = f" reads {format_bytes(at.peak_bytes)}" if read and at is not None else " does not fit the card"
            where = "" if seq_len is None else f" at seq_len {seq_len}"
            nothing_fits.append(
                f"micro-batch {setup.multiple_of} of {task.name}{where} on an emulated {card.short_name}{figure} "
                f"(reserved + {format_bytes(outside)} outside the allocator), over the limit of "
                f"{format_bytes(limit_bytes)}"
            )
            continue
        made.append((at_length, found, trials))
    if not made:
        raise CannotFitError(nothing_fits[0])
    profiles = [
        estimated_profile(
            at_length,
            config,
            device=device,
            max_micro_batch=found.max_micro_batch,
            trials=trials,
            fit=Fit.model_validate(found.fit) if found.fit else None,
            warnings=[semantics, *bound_notes, *unlisted, *found.warnings, *nothing_fits],
            started=started,
            torch_version=cuda_torch.torch_version,
            breakdown=[MemoryBreakdown.model_validate(raw) for raw in found.breakdowns] or None,
        )
        for at_length, found, trials in made
    ]
    for profile, (_, found, _) in zip(profiles, made, strict=True):  # --pp: each stage's figure (issue 34)
        profile.pipeline = PipelineStages.model_validate(found.pipeline) if found.pipeline else None
        profile.throughput = _predicted(profile, found, config)
    return profiles


def _predicted(profile: Profile, found: CardSearch, config: EstimateConfig) -> list[Throughput] | None:
    """The profile's predicted throughput (autotune/orchestrate/predicted.py), checked as the store checks it."""
    from autotune.core.consistency import check_profile
    from autotune.orchestrate.predicted import predicted_throughput

    assert config.card is not None
    if not found.steps:
        return None
    made = predicted_throughput(
        found.steps,
        config.card,
        precision=profile.precision,
        world_size=profile.world_size,
        mesh=config.probe.mesh,
        max_micro_batch=profile.max_micro_batch,
        plan=profile.plan,
        overrides=config.figures,
        warnings=profile.warnings,
    )
    check_profile(profile.model_copy(update={"throughput": made}))
    return made
