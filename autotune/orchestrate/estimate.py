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
                       EstimateConfig(budget_bytes=80 << 30, strategy="fsdp", world_size=8))
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from autotune.core import units
from autotune.core.errors import AutotuneError, BudgetError
from autotune.core.schemas import Device, Profile, Trial
from autotune.measure.strategies import make_strategy
from autotune.measure.trial import frozen_heap
from autotune.orchestrate.estimated import estimated_profile
from autotune.orchestrate.probe import ProbeConfig
from autotune.search.boundary import NoFitError
from autotune.search.diagnose import no_fit_error
from autotune.search.presearch import FakeTrials, fake_search
from autotune.tasks.task import ProbeTask

__all__ = ["DEVICE_KINDS", "EstimateConfig", "estimate", "estimate_device_type", "estimate_for_card_at_lengths"]

DEVICE_KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class EstimateConfig:
    """The flags of `autotune estimate`: the probe's, with the device given by kind, not by index."""

    budget_bytes: int | None = None
    device_kind: str = "cuda"
    device_name: str | None = None
    headroom: float = 0.10
    target_batch: int | None = None
    world_size: int = 1
    strategy: str = "ddp"
    max_micro_batch: int = 4096
    multiple_of: int = 1
    precision: str | None = None
    plan_policy: str = "balanced"
    # The memory policy (none, every-2, full): None keeps the task's own activation_checkpointing.
    activation_checkpointing: str | None = None
    # A card of the catalog (autotune/core/cards.py: "h100", "h200", ...): its name, budget and CUDA
    # semantics, by emulated fake trials (autotune/orchestrate/card_estimate.py).
    gpu: str | None = None
    # Memory outside the caching allocator (the CUDA context): None takes the catalog's figure; where
    # it came from when not from --context-bytes (the store's measurements: autotune/cli/estimate.py).
    context_bytes: int | None = None
    context_source: str | None = None
    # Sizes estimated besides the search's (their trials in the profile): "will m = 32 fit?".
    micro_batches: tuple[int, ...] = ()
    # Why the card could not be emulated, where a run over lengths found out already: CPU semantics then.
    emulation_failed: str | None = None

    def applied_to(self, task: ProbeTask) -> ProbeTask:
        """task with the precision and the memory policy asked for, where they are given."""
        if self.precision is not None and self.precision != task.precision:
            task = dataclasses.replace(task, precision=self.precision)
        if self.activation_checkpointing is not None:
            task = dataclasses.replace(task, activation_checkpointing=self.activation_checkpointing)
        return task

    def on_card(self) -> EstimateConfig:
        """This config with the card's name and budget where --gpu names one and they are not given."""
        if self.gpu is None:
            return self
        from autotune.orchestrate.card_estimate import card_of

        card = card_of(self.gpu)
        return dataclasses.replace(
            self,
            budget_bytes=self.budget_bytes if self.budget_bytes is not None else card.device_total_bytes,
            device_name=self.device_name or card.nvml_name,
        )

    def validate(self) -> None:
        if self.gpu is not None:
            from autotune.orchestrate.card_estimate import card_of

            card = card_of(self.gpu)
            if self.device_kind != "cuda":
                raise AutotuneError(
                    f"--gpu {self.gpu} names a CUDA card: it cannot go with --device-kind {self.device_kind}"
                )
            if self.context_bytes is not None and not 0 <= self.context_bytes < card.device_total_bytes:
                raise AutotuneError(
                    f"--context-bytes must be at least 0 and below the {card.short_name}'s memory "
                    f"({card.device_total_bytes} bytes), got {self.context_bytes}"
                )
        elif self.context_bytes is not None:
            raise AutotuneError("--context-bytes applies to an estimate for a card: name it with --gpu")
        if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in self.micro_batches):
            raise AutotuneError(f"--micro-batches must be positive integers, got {list(self.micro_batches)}")
        if self.budget_bytes is None:
            raise BudgetError("estimate needs a budget: pass --budget (for example --budget 80GiB)")
        if self.budget_bytes <= 0:
            raise BudgetError(f"budget must be positive, got {self.budget_bytes} bytes")
        if self.device_kind not in DEVICE_KINDS:
            raise AutotuneError(f"device kind must be one of {', '.join(DEVICE_KINDS)}, got {self.device_kind!r}")
        self.as_probe_config().validate()

    def as_probe_config(self) -> ProbeConfig:
        return ProbeConfig(
            device="cpu",
            budget_bytes=self.budget_bytes,
            headroom=self.headroom,
            target_batch=self.target_batch,
            world_size=self.world_size,
            max_micro_batch=self.max_micro_batch,
            multiple_of=self.multiple_of,
            precision=self.precision,
            strategy=self.strategy,
            plan_policy=self.plan_policy,
            activation_checkpointing=self.activation_checkpointing,
        )


def estimate_device_type(device_kind: str) -> tuple[str, str | None]:
    """The device the fake tensors claim, and the warning an estimate carries when it cannot be the
    card's own kind (a CUDA estimate on a torch without CUDA runs with CPU semantics)."""
    if device_kind == "cuda" and not torch.cuda.is_available():
        return "cpu", (
            "estimated with CPU semantics: this torch has no CUDA, and a CPU build cannot run fake CUDA "
            "tensors through autograd; autocast's op lists and attention kernels differ on CUDA "
            "(measured against an H200: +2 % for an fp32 GPT-2, -17 % for a bf16 Llama-style model)"
        )
    return device_kind, None


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
    config = config.on_card()
    config.validate()
    assert config.budget_bytes is not None  # validate() refused None
    task = config.applied_to(task)
    warnings: list[str] = []
    if config.gpu is not None and fakes is None:
        from autotune.orchestrate.card_estimate import EmulationUnavailable, estimate_on_card

        reason = config.emulation_failed
        if reason is None:
            try:
                return estimate_on_card(task, config, on_trial=on_trial)
            except EmulationUnavailable as exc:
                reason = str(exc)
        warnings.append(
            f"the {config.gpu} could not be emulated here ({reason}): estimated with CPU semantics, without the "
            "caching allocator or the memory outside it"
        )
    started = time.perf_counter()
    device_type, semantics = estimate_device_type(config.device_kind)
    warnings.extend([semantics] if semantics else [])
    limit_bytes = units.limit_bytes(config.budget_bytes, config.headroom)
    strategy = make_strategy(config.strategy, config.world_size)
    device_name = config.device_name or f"{config.device_kind} (estimate)"
    no_fit: NoFitError | None = None
    # A shared fake model lives in its caller's process group; a model of its own needs one.
    group = nullcontext() if fakes is not None else strategy.process_group(torch.device(device_type))
    with group, frozen_heap():
        try:
            found = fake_search(
                task,
                budget_bytes=config.budget_bytes,
                limit_bytes=limit_bytes,
                device_type=device_type,
                strategy=strategy,
                max_micro_batch=config.max_micro_batch,
                multiple_of=config.multiple_of,
                device_name=device_name,
                on_trial=on_trial,
                confirm=True,
                hint=hint,
                known=known,
                fakes=fakes,
            )
        except NoFitError as exc:  # diagnosed by fake trials, outside this process group
            if fakes is not None:  # the caller holds the group: it diagnoses after the run
                raise
            no_fit = exc
    if no_fit is not None:
        raise no_fit_error(task, config, budget_bytes=config.budget_bytes, device_type=device_type)
    warnings.extend(found.warnings)
    device = Device(
        kind=config.device_kind,  # type: ignore[arg-type]
        name=device_name,
        total_bytes=config.budget_bytes,
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
    )


def estimate_for_card_at_lengths(
    task: ProbeTask,
    config: EstimateConfig,
    lengths: Sequence[int],
    *,
    on_trial: Callable[[Trial], None] | None = None,
) -> list[Profile]:
    """``autotune estimate --gpu --seq-len``: every length's estimate for config.gpu in one emulated child;
    where the card cannot be emulated here, each length with CPU semantics, saying why (estimate() does)."""
    from autotune.orchestrate.card_estimate import EmulationUnavailable, estimate_on_card_lengths

    try:
        return estimate_on_card_lengths(task, config.on_card(), lengths, on_trial=on_trial)
    except EmulationUnavailable as exc:
        config = dataclasses.replace(config, emulation_failed=str(exc))
    return [estimate(task.at_length(seq_len), config, on_trial=on_trial) for seq_len in lengths]
