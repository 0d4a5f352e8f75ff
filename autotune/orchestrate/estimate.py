"""`autotune estimate`: the datasheet from fake-tensor trials only, for memory no device here holds.

"Does this 7B job fit an 80 GB card with FSDP on 8 GPUs, and at what m?" The trial runs under
FakeTensorMode (meters/fake.py): weights, gradients, optimizer state, activations, the step's
temporaries and FSDP2's sharding all counted, with no storage and no compute, on a machine without
the card. The Profile says ``source: estimate``; a measurement always wins over it in the store.

On a machine whose torch has no CUDA, an estimate for ``cuda`` runs the ops with CPU semantics: a
CPU build of torch cannot take fake CUDA tensors through autograd, and autocast's op lists and the
attention kernels differ between the two (measured at the same m against an H200: +2 % for an fp32
GPT-2, -17 % for a bf16 Llama-style model). The profile carries that as a warning.

    profile = estimate(load_task("examples/gpt.py:task_7b"),
                       EstimateConfig.of(budget_bytes=80 << 30, strategy="fsdp", world_size=8))

EstimateConfig (autotune/orchestrate/config.py) holds the probe's setup, ``config.probe``, and the card.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch

from autotune.core import units
from autotune.core.errors import AutotuneError
from autotune.core.schemas import Device, Lever, MemoryBreakdown, Profile, Trial
from autotune.measure.strategies import Strategy
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.trial import frozen_heap
from autotune.orchestrate.breakdowns import chosen_breakdowns
from autotune.orchestrate.card_estimate import EmulationUnavailable, estimate_on_card, estimate_on_card_lengths
from autotune.orchestrate.config import DeviceKind, EstimateConfig, ProbeConfig
from autotune.orchestrate.estimated import estimated_profile
from autotune.search.boundary import NoFitError, at_length
from autotune.search.diagnose import no_fit_error
from autotune.search.presearch import FakeSearch, FakeTrials, fake_search
from autotune.tasks.optimizers import eager_step_note, refuse_compiled_step
from autotune.tasks.task import ProbeTask

# EstimateConfig lives in autotune/orchestrate/config.py (the config family); imported here too, where the
# callers of the estimate have always found it.
__all__ = ["estimate", "estimate_device_type", "estimate_for_card_at_lengths"]


def estimate_device_type(device_kind: DeviceKind) -> tuple[str, str | None]:
    """The device the fake tensors claim, and the warning an estimate carries when it cannot be the
    card's own kind (a CUDA estimate on a torch without CUDA runs with CPU semantics)."""
    if device_kind == "cuda" and not torch.cuda.is_available():
        return "cpu", (
            "estimated with CPU semantics: this torch has no CUDA, and a CPU build cannot run fake CUDA "
            "tensors through autograd; autocast's op lists and attention kernels differ on CUDA "
            "(measured against an H200: +2 % for an fp32 GPT-2, -17 % for a bf16 Llama-style model)"
        )
    return device_kind, None


@frozen_heap()
def estimate(
    task: ProbeTask,
    config: EstimateConfig,
    *,
    on_trial: Callable[[Trial], None] | None = None,
    hint: int | None = None,
    known: Sequence[Trial] = (),
    fakes: FakeTrials | None = None,
) -> Profile:
    """The largest micro-batch that fits the budget by fake trials, and the plan for the target.

    ``hint``: m_max predicted already (a surface over lengths): the fake trials confirm it (at it and
    one step past it) instead of tracing a curve first; ``known``: fake trials of this setup already
    run (the surface's at this length), not run again; ``fakes``: the fake model and meter of a run
    over lengths, whose process group the caller holds (None: this estimate builds its own).

    Raises:
        BudgetError: no budget. CannotFitError (a BudgetError): micro-batch multiple_of does not fit
            even fake; its one line says what the job needs and what would fit (autotune/search/diagnose.py).
        AutotuneError: bad configuration; an op that cannot run fake (the message names it).
    """
    config.validate()
    setup = config.probe
    assert setup.budget_bytes is not None  # validate() refused None
    warnings = _eager_notes(task, setup)
    if config.card is not None and fakes is None:
        on_card = _on_card_or_why(task, config, warnings, on_trial)
        if on_card is not None:
            return on_card
    task = setup.applied_to(task)
    started = time.perf_counter()
    device_type, semantics = estimate_device_type(config.device_kind)
    warnings.extend([semantics] if semantics else [])
    device_name = config.device_name or f"{config.device_kind} (estimate)"
    if setup.mesh.pp > 1:  # every stage's fake trial replays its schedule, on a model of its own
        if fakes is not None:
            raise AutotuneError(f"--pp {setup.mesh.pp}: a pipeline's stages are not estimated on a shared fake model")
        return _estimate_pipeline(task, config, device_type, device_name, warnings, on_trial)
    found, breakdowns = _fake_searched(task, setup, device_type, device_name, on_trial, hint, known, fakes)
    warnings.extend(found.warnings)
    limit_bytes = units.limit_bytes(setup.budget_bytes, setup.headroom)
    if setup.breakdown and fakes is not None:  # a run over lengths: this length's own datasheet
        # The strategy whose process group the caller holds (a mesh's: its device mesh is that group's).
        breakdowns = _broken_down(task, found, setup, fakes.runner.strategy, device_type, device_name, limit_bytes)
    breakdown = chosen_breakdowns(breakdowns, task, setup, found.max_micro_batch, device_type, warnings)
    levers = None
    if setup.levers:  # what each change of the setup would buy (autotune/orchestrate/levers.py)
        from autotune.orchestrate.levers import pull_levers

        levers = pull_levers(
            task, setup, at_micro_batch=found.max_micro_batch, device_type=device_type, estimator=estimate
        )
    device = Device(
        kind=config.device_kind,
        name=device_name,
        total_bytes=setup.budget_bytes,
        torch_version=torch.__version__,
    )
    return estimated_profile(
        task,
        config,
        device=device,
        max_micro_batch=found.max_micro_batch,
        trials=found.trials,
        fit=found.fit,
        warnings=warnings,
        started=started,
        torch_version=torch.__version__,
        breakdown=breakdown,
        levers=levers,
    )


def _eager_notes(task: ProbeTask, setup: ProbeConfig) -> list[str]:
    """What an estimate says first of a step its fake trials run eagerly: torchao's compiled optimizer step (refused
    where it cannot), a compiled model (docs/compile.md)."""
    # torchao's compiled step runs eagerly on fake tensors, on one device (autotune/tasks/optimizers.py).
    refuse_compiled_step(task.optimizer, allocator_count=False, fake=True)
    warnings: list[str] = [note] if (note := eager_step_note(task.optimizer)) else []
    if (setup.compile or task.compile) is not None:  # fake trials run the eager model (docs/compile.md)
        from autotune.measure.meters.compiled import estimated_eager

        warnings.append(estimated_eager(setup.applied_to(task)))
    return warnings


def _on_card_or_why(
    task: ProbeTask, config: EstimateConfig, warnings: list[str], on_trial: Callable[[Trial], None] | None
) -> Profile | None:
    """The estimate on the emulated card (with its levers, each on the same card), or None with the reason it could
    not be emulated among the warnings: the estimate then runs with CPU semantics."""
    assert config.card is not None
    reason = config.emulation_failed
    if reason is None:
        try:  # the card's estimate applies the setup to the task itself
            on_card = estimate_on_card(task, config, on_trial=on_trial)
            on_card.warnings[:0] = warnings
            if config.probe.levers:  # each change estimated on the same card (autotune/orchestrate/levers.py)
                on_card.levers = card_levers(task, config, on_card)
            return on_card
        except EmulationUnavailable as exc:
            reason = str(exc)
    warnings.append(
        f"the {config.card.short_name} could not be emulated here ({reason}): estimated with CPU semantics, "
        "without the caching allocator or the memory outside it"
    )
    return None


def _fake_searched(
    task: ProbeTask,
    setup: ProbeConfig,
    device_type: str,
    device_name: str,
    on_trial: Callable[[Trial], None] | None,
    hint: int | None,
    known: Sequence[Trial],
    fakes: FakeTrials | None,
) -> tuple[FakeSearch, dict[int, MemoryBreakdown] | None]:
    """The search by fake trials, and its sizes broken down where asked; a size that does not fit raises the one line
    of the no-fit diagnosis with the cheapest change (outside the strategy's process group)."""
    assert setup.budget_bytes is not None
    strategy = make_strategy(setup.strategy, setup.world_size, setup.mesh)
    # The fake trials' peaks broken down (autotune/measure/breakdown.py); a run's shared fake model (a run over
    # lengths) records none: its sizes are broken down on a model of their own.
    breakdowns: dict[int, MemoryBreakdown] | None = {} if setup.breakdown and fakes is None else None
    # A shared fake model lives in its caller's process group; a model of its own needs one.
    group = nullcontext() if fakes is not None else strategy.process_group(torch.device(device_type))
    with group:
        try:
            found = fake_search(
                task,
                budget_bytes=setup.budget_bytes,
                limit_bytes=units.limit_bytes(setup.budget_bytes, setup.headroom),
                device_type=device_type,
                strategy=strategy,
                max_micro_batch=setup.max_micro_batch,
                multiple_of=setup.multiple_of,
                device_name=device_name,
                on_trial=on_trial,
                confirm=True,
                hint=hint,
                known=known,
                fakes=fakes,
                breakdowns=breakdowns,
            )
            return found, breakdowns
        except NoFitError:  # diagnosed by fake trials, outside this process group
            if fakes is not None:  # the caller holds the group: it diagnoses after the run
                raise
    from autotune.orchestrate.levers import with_cheapest_lever

    error = no_fit_error(task, setup, budget_bytes=setup.budget_bytes, device_type=device_type)
    raise with_cheapest_lever(error, task, setup, budget_bytes=setup.budget_bytes, device_type=device_type)


def _broken_down(
    task: ProbeTask,
    found: FakeSearch,
    setup: ProbeConfig,
    strategy: Strategy,
    device_type: str,
    device_name: str,
    limit_bytes: int,
) -> dict[int, MemoryBreakdown]:
    """The fake trials at m_max and the next size broken down on a fake model of their own, as one estimate's are
    (inside the caller's process group, of ``strategy``). A run over lengths shares one fake model between its lengths,
    its lanes run trials in other processes, and a trial run again on that shared model after the run's last one at
    another setup did not always read what the first did: a model of its own reads what the length's own trials read."""
    ran = {trial.micro_batch for trial in found.trials if trial.fake}
    sizes = [m for m in (found.max_micro_batch, found.max_micro_batch + setup.multiple_of) if m in ran]
    recorded: dict[int, MemoryBreakdown] = {}
    own = FakeTrials(task, device_type=device_type, strategy=strategy, device_name=device_name)
    own.runner.breakdowns = recorded
    try:
        assert setup.budget_bytes is not None
        for size in sizes:
            own.run_here(task, size, budget_bytes=setup.budget_bytes, limit_bytes=limit_bytes)
    finally:
        own.close()
    return recorded


def _estimate_pipeline(
    task: ProbeTask,
    config: EstimateConfig,
    device_type: str,
    device_name: str,
    warnings: list[str],
    on_trial: Callable[[Trial], None] | None,
) -> Profile:
    from autotune.orchestrate.levers import pull_levers, with_cheapest_lever
    from autotune.orchestrate.pipelined import estimate_pipeline

    setup = config.probe
    assert setup.budget_bytes is not None
    try:
        profile = estimate_pipeline(task, config, device_type, device_name, warnings, on_trial)
    except NoFitError:
        budget = setup.budget_bytes
        error = no_fit_error(task, setup, budget_bytes=budget, device_type=device_type)
        raise with_cheapest_lever(error, task, setup, budget_bytes=budget, device_type=device_type) from None
    if setup.levers:  # what each change would buy, on every stage (autotune/orchestrate/levers.py)
        profile.levers = pull_levers(
            task, setup, at_micro_batch=profile.max_micro_batch, device_type=device_type, estimator=estimate
        )
    return profile


def card_levers(task: ProbeTask, config: EstimateConfig, profile: Profile) -> list[Lever]:
    """``--levers`` on an emulated card: each change of the setup estimated on the same card, its m_max and its figure
    at the job's m_max the card's (reserved + outside the allocator), against the job's own figure there."""
    from autotune.orchestrate.levers import pull_levers

    m_max = profile.max_micro_batch
    job = next((t for t in reversed(profile.trials) if t.micro_batch == m_max and not t.oom), None)
    return pull_levers(
        task,
        config.probe,
        at_micro_batch=m_max,
        device_type="cuda",
        estimator=estimate,
        on_card=config,
        job_peak_bytes=job.peak_bytes if job is not None else None,
    )


def estimate_for_card_at_lengths(
    task: ProbeTask,
    config: EstimateConfig,
    lengths: Sequence[int],
    *,
    on_trial: Callable[[Trial], None] | None = None,
) -> list[Profile]:
    """``autotune estimate --gpu --seq-len``: every length's estimate for config.card in one emulated child;
    where the card cannot be emulated here, each length with CPU semantics, saying why (estimate() does)."""
    refuse_compiled_step(task.optimizer, allocator_count=False, fake=True)
    try:
        profiles = estimate_on_card_lengths(task, config, lengths, on_trial=on_trial)
    except EmulationUnavailable as exc:
        config = dataclasses.replace(config, emulation_failed=str(exc))
        return [estimate(task.at_length(seq_len), config, on_trial=at_length(on_trial, seq_len)) for seq_len in lengths]
    note = eager_step_note(task.optimizer)
    for profile in profiles:
        if note is not None:
            profile.warnings.insert(0, note)
        if config.probe.levers:  # each length's changes on the same card
            at_length = task if profile.seq_len is None else task.at_length(profile.seq_len)
            profile.levers = card_levers(at_length, config, profile)
    return profiles
