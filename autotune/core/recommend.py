"""Which memory policy and plan hold the target fastest: arithmetic on timed runs. Torch-free.

A policy's profile carries timed runs (``Profile.throughput``, autotune/measure/throughput.py): the seconds
of one forward+backward at each timed micro-batch size and of the optimizer step. An update of a
plan costs the sum over its micro-batches plus one step, so a plan whose sizes were timed is
priced exactly from them; a size that was not timed is priced from the nearest timed size at the
same seconds per sample (said as ``timed=False``). The recommendation is the option with the most
samples per second; ``objective="memory"`` keeps today's answer, the fewest accumulation steps (the
largest micro-batch), with the least recomputation among equals.

    >>> t = Throughput(micro_batch=4, samples_per_second=2.0, seconds_per_update=2.0,
    ...                micro_batches=[(4, 1)], micro_batch_seconds=[(4, 1.5)], step_seconds=0.5)
    >>> update_seconds([t], [(4, 3)])
    (5.0, True)
    >>> update_seconds([t], [(8, 1)])
    (3.5, False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotune.core.policy_names import recomputation_key
from autotune.core.schemas import MicroBatchCount, Plan, Profile, Throughput

__all__ = ["Option", "option_for", "options_text", "recommend", "samples_per_second", "update_seconds"]


def update_seconds(
    timings: Sequence[Throughput], micro_batches: Sequence[MicroBatchCount]
) -> tuple[float, bool] | None:
    """Seconds of one update of ``micro_batches`` (per replica) from timed runs, and whether every
    size of it was timed; None without timings."""
    per_size: dict[int, float] = {}
    step: list[float] = []
    for timing in timings:
        per_size.update(dict(timing.micro_batch_seconds))
        step.append(timing.step_seconds)
    if not per_size:
        return None
    total = sum(step) / len(step)
    timed = True
    for size, count in micro_batches:
        seconds = per_size.get(size)
        if seconds is None:  # the nearest timed size, at its seconds per sample
            nearest = min(per_size, key=lambda s: (abs(s - size), -s))
            seconds = per_size[nearest] * size / nearest
            timed = False
        total += count * seconds
    return total, timed


def samples_per_second(
    timings: Sequence[Throughput], micro_batches: Sequence[MicroBatchCount], world_size: int = 1
) -> tuple[float, bool] | None:
    """Samples per second of updates of ``micro_batches`` on ``world_size`` replicas, and whether
    every size was timed; None without timings."""
    priced = update_seconds(timings, micro_batches)
    if priced is None or priced[0] <= 0:
        return None
    seconds, timed = priced
    samples = world_size * sum(size * count for size, count in micro_batches)
    return samples / seconds, timed


@dataclass(frozen=True)
class Option:
    """One policy's answer: its plan (None without a target: one micro-batch of m_max per update)
    and the samples per second timed for it (None: not timed)."""

    policy: str
    max_micro_batch: int
    micro_batches: tuple[MicroBatchCount, ...]
    accumulation_steps: int
    samples_per_second: float | None
    timed: bool = True
    plan: Plan | None = None

    def text(self) -> str:
        sizes = " + ".join(f"{count}x{size}" for size, count in self.micro_batches)
        rate = "not timed" if self.samples_per_second is None else f"{self.samples_per_second:.4g} samples/s"
        if self.samples_per_second is not None and not self.timed:
            rate += " (priced from the nearest timed size)"
        return f"{self.policy}: m_max {self.max_micro_batch}, update {sizes} ({self.accumulation_steps} steps), {rate}"


def option_for(profile: Profile) -> Option:
    """The option a profile offers: its plan (or one micro-batch of m_max) priced from its timings."""
    the_plan = profile.plan
    micro_batches = tuple(the_plan.micro_batches) if the_plan else ((profile.max_micro_batch, 1),)
    steps = the_plan.accumulation_steps if the_plan else 1
    world = the_plan.world_size if the_plan else profile.world_size
    rate = samples_per_second(profile.throughput or [], micro_batches, world)
    return Option(
        policy=profile.activation_checkpointing,
        max_micro_batch=profile.max_micro_batch,
        micro_batches=micro_batches,
        accumulation_steps=steps,
        samples_per_second=None if rate is None else rate[0],
        timed=True if rate is None else rate[1],
        plan=the_plan,
    )


def _policy_rank(policy: str) -> tuple[float, int]:
    return recomputation_key(policy)


def recommend(options: Sequence[Option], objective: str = "throughput") -> Option:
    """The best option: the most samples per second (timed ones before untimed), or for
    ``objective="memory"`` the fewest accumulation steps and the largest micro-batch; the least
    recomputation (none, every-K with the larger K first, op, full: ``policy_names.recomputation_key``)
    among equals.

    >>> fast = Option("none", 10, ((10, 3),), 3, 50.0)
    >>> slow = Option("full", 30, ((30, 1),), 1, 40.0)
    >>> recommend([slow, fast]).policy, recommend([slow, fast], "memory").policy
    ('none', 'full')

    Raises:
        ValueError: no options, or an unknown objective.
    """
    if not options:
        raise ValueError("no policy to recommend from")
    if objective == "throughput":
        return min(
            options,
            key=lambda o: (o.samples_per_second is None, -(o.samples_per_second or 0.0), _policy_rank(o.policy)),
        )
    if objective == "memory":
        return min(options, key=lambda o: (o.accumulation_steps, -o.max_micro_batch, _policy_rank(o.policy)))
    raise ValueError(f"objective must be memory or throughput, got {objective!r}")


def options_text(best: Option, options: Sequence[Option], objective: str) -> str:
    """The ``recommended:`` line: the chosen policy and plan, the others beside it."""
    others = [o for o in options if o is not best]
    line = f"recommended: {best.text()} (objective {objective})"
    if others:
        line += "; beside it " + "; ".join(o.text() for o in others)
    return line
