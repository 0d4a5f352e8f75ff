"""The local probe of :func:`autotune_client.suggest`: the job's own model and batches measured on its own
device when the store has no profile for them, and the Suggestion read off the profile.

The caller's model is never touched: the probe runs on copies made on the CPU (:func:`cpu_copy`), with
torch's RNG restored after it (:func:`rng_preserved`). torch and autotune's probe are imported inside
these functions, only when a probe runs (tests replace ``autotune.orchestrate.probe.probe`` there).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from autotune.core.schemas import Profile, Suggestion, TagValue
from autotune_client._distributed import local_probe_starting
from autotune_client.errors import AutotuneClientError

if TYPE_CHECKING:
    from torch import nn

    from autotune.core.plan import PlanPolicy
    from autotune.core.schemas import Precision, Strategy
    from autotune.tasks.task import LossFn, OptimizerFactory

__all__ = ["cpu_copy", "probe_locally", "rng_preserved", "suggestion_from_profile", "timed_rate"]


def cpu_copy(model: nn.Module) -> nn.Module:
    """A deep copy of the model on the CPU, made without a second copy on the model's device.

    Parameters and buffers are copied to the CPU first and handed to deepcopy through its memo, so
    a GPU-resident model is never duplicated on the GPU; shared (tied) weights stay shared, and
    ``requires_grad`` is kept because frozen layers change memory.
    """
    import torch
    from torch import nn

    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) in memo:
            continue
        if tensor.is_meta:
            # A model built on the meta device (deferred init) has shapes but no values, and only
            # shapes decide memory: zeros stand in for the weights it does not have yet.
            data = torch.zeros_like(tensor, device="cpu")
        else:
            data = tensor.detach().to("cpu", copy=True)
        if isinstance(tensor, nn.Parameter):
            memo[id(tensor)] = nn.Parameter(data, requires_grad=tensor.requires_grad)
        else:
            memo[id(tensor)] = data
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def rng_preserved(device_spec: str) -> Iterator[None]:
    """torch's RNG state (the CPU's, and the job's CUDA device's) as it was before, after the block."""
    import torch

    # The probe draws random batches; a job seeded for reproducibility must not see its stream shift.
    devices = [int(device_spec[5:])] if device_spec.startswith("cuda:") else []
    with torch.random.fork_rng(devices=devices):
        yield


def probe_locally(
    model: nn.Module,
    batch_fn: Callable[[int], Any],
    *,
    loss: LossFn | None,
    optimizer: OptimizerFactory | None,
    precision: str,
    tags: dict[str, TagValue],
    device_spec: str,
    budget_bytes: int | None,
    target_batch: int,
    world_size: int,
    strategy: str = "ddp",
    plan_policy: str = "balanced",
    activation_checkpointing: str = "none",
    throughput: bool = False,
) -> Profile:
    """Probe the job here: a ProbeTask over copies of ``model`` and ``batch_fn``'s batches, on ``device_spec``.

    The arguments are what :func:`autotune_client.suggest` resolved (``plan_policy`` is its ``plan``).

    Returns:
        The Profile ``autotune.orchestrate.probe.probe`` measured.

    Raises:
        AutotuneClientError: a CPU probe without a budget.
        autotune.core.errors.AutotuneError: the probe failed (its message says why).
    """
    from autotune.orchestrate.probe import ProbeConfig, probe
    from autotune.tasks.task import ProbeTask

    if device_spec == "cpu" and budget_bytes is None:
        raise AutotuneClientError("probing on the CPU needs budget= (bytes or a size like '4GiB')")
    local_probe_starting()  # under a process group: the other ranks now wait for a probe
    template = cpu_copy(model)

    def fresh_model() -> nn.Module:
        # A fresh copy per trial, in training mode whatever mode the caller's model is in.
        return copy.deepcopy(template).train()

    task = ProbeTask(
        name=type(model).__name__,
        model=fresh_model,
        batch=batch_fn,
        loss=loss,
        optimizer=optimizer,
        precision=cast("Precision", precision),  # ProbeTask refuses another in one line
        tags=tags,
        # suggest()'s tag compile (autotune_client/_suggest.py: _compilation): the trials run compiled.
        compile=str(tags["compile"]) if "compile" in tags else None,
    )
    config = ProbeConfig(
        device=device_spec,
        budget_bytes=budget_bytes,
        target_batch=target_batch,
        world_size=world_size,
        # suggest() refused any other than ProbeConfig's Literals (autotune_client/_suggest.py: _validated).
        strategy=cast("Strategy", strategy),
        plan_policy=cast("PlanPolicy", plan_policy),
        activation_checkpointing=activation_checkpointing,
        throughput=throughput,
    )
    with rng_preserved(device_spec):
        return probe(task, config)


def suggestion_from_profile(
    profile: Profile,
    target_batch: int,
    world_size: int,
    profile_id: int | None,
    notes: list[str],
    policy: str = "balanced",
) -> Suggestion:
    """The answer a local probe gives, ``notes`` joined to the profile's warnings: the plan of
    ``autotune.core.plan.plan_profile`` (one step from ``Profile.single_step`` where it holds the target, else
    from the accumulating ``max_micro_batch``), which the probe stored for its own target and /suggest makes
    of the stored profile, so a job asking again gets the answer it got the first time."""
    from autotune.core.plan import is_single_step, plan_profile

    chosen = plan_profile(profile, target_batch, world_size, policy=policy)  # type: ignore[arg-type]
    single = is_single_step(chosen, profile.max_micro_batch)
    single_trials = profile.single_step.trials if single and profile.single_step is not None else []
    peak = next((t.peak_bytes for t in single_trials if t.micro_batch == chosen.micro_batch and t.fits), None)
    found = [*profile.warnings, *([chosen.note] if chosen.note else []), *notes]
    return Suggestion.from_plan(
        chosen,
        source="probed",
        profile_id=profile_id,
        fingerprint=profile.fingerprint,
        device_name=profile.device.name,
        max_micro_batch=profile.max_micro_batch,
        multiple_of=profile.multiple_of,
        peak_bytes=peak if single else profile.peak_at(chosen.micro_batch),
        budget_bytes=profile.budget_bytes,
        strategy=profile.strategy,
        activation_checkpointing=profile.activation_checkpointing,
        samples_per_second=timed_rate(profile, chosen),
        single_step=single,
        warnings=list(dict.fromkeys(found)),
    )


def timed_rate(profile: Profile, chosen: Any) -> float | None:
    """The samples per second the profile's timed runs give the chosen plan (None: not timed)."""
    from autotune.core.recommend import samples_per_second

    rate = samples_per_second(profile.throughput or [], chosen.micro_batches, chosen.world_size)
    return None if rate is None else round(rate[0], 4)
