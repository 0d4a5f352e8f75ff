"""Which setup and plan hold the target fastest: arithmetic on timed runs. Torch-free.

A setup is every choice a profile records that changes memory and time (:data:`DIMENSIONS`): the memory
policy, the offload, the loss, the quantization, the optimizer and what zero_grad does, and any other tag in which
the profiles compared differ. Each is read from the profile (``activation_checkpointing``, the task's tags), so a
new dimension is one entry of the table, or, with no entry, a tag that differs and is shown without an order.
The options are the setups whose plan holds the target batch (all of them where none does).

A policy's profile carries timed runs (``Profile.throughput``, autotune/measure/throughput.py): the seconds
of one forward+backward at each timed micro-batch size and of the optimizer step. An update of a
plan costs the sum over its micro-batches plus one step, so a plan whose sizes were timed is
priced exactly from them; a size that was not timed is priced from the nearest timed size at the
same seconds per sample (said as ``timed=False``). The recommendation is the option with the most
samples per second; ``objective="memory"`` keeps today's answer, the fewest accumulation steps (the
largest micro-batch), with the least extra work among equals.

Without timings (an estimate's fake trials, ``--no-throughput``) the stated ordering decides: the fewest
accumulation steps, then the least extra work per update, dimension by dimension in :data:`DIMENSIONS`'
order (offload's host copies on every micro-batch, then recomputation (of blocks, then of the loss's chunks), then
dequantization, then a slower optimizer step, which runs once per update), then the largest micro-batch.

    >>> t = Throughput(micro_batch=4, samples_per_second=2.0, seconds_per_update=2.0,
    ...                micro_batches=[(4, 1)], micro_batch_seconds=[(4, 1.5)], step_seconds=0.5)
    >>> update_seconds([t], [(4, 3)])
    (5.0, True)
    >>> update_seconds([t], [(8, 1)])
    (3.5, False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autotune.core.mesh import Mesh
from autotune.core.policy_names import recomputation_key
from autotune.core.schemas import MicroBatchCount, Plan, Profile, Throughput

__all__ = [
    "DIMENSIONS",
    "Dimension",
    "Option",
    "option_for",
    "options_for",
    "options_text",
    "recommend",
    "samples_per_second",
    "setup_of",
    "update_seconds",
]


def update_seconds(
    timings: Sequence[Throughput], micro_batches: Sequence[MicroBatchCount]
) -> tuple[float, bool] | None:
    """Seconds of one update of ``micro_batches`` (per replica) from timed runs, and whether every
    size of it was timed; None without timings."""
    per_size: dict[int, float] = {}
    step: list[float] = []
    for timing in timings:
        per_size.update(dict(timing.micro_batch_seconds))
        # A prediction's once-per-update part (a pipeline's bubble, the last reduction's end) rides with its step.
        step.append(timing.step_seconds + timing.per_update_seconds)
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


def _tag(name: str, default: str) -> Callable[[Profile], str]:
    return lambda profile: str(profile.tags.get(name, default))


def _optimizer_cost(spec: str) -> tuple[float, int]:
    """The default AdamW (foreach) and fused ones first; a for-loop step (foreach=false), 8- or 4-bit states
    (a dequantize and quantize per step) and factored ones (Adafactor) after."""
    text = spec.lower().replace(" ", "")
    if text == "default" or "fused=true" in text or text in ("adamw", "torch.optim.adamw", "adam", "torch.optim.adam"):
        return (0.0, 0)
    return (1.0, 0)


@dataclass(frozen=True)
class Dimension:
    """One choice of a setup that changes memory and time.

    Attributes:
        name: what the recommendation calls it (the CLI flag without dashes).
        read: its value in a profile.
        default: the value of a profile that does not record it.
        cost: extra work per update of a value, smaller first (the stated ordering without timings).
    """

    name: str
    read: Callable[[Profile], str]
    default: str
    cost: Callable[[str], tuple[float, int]]


# In the order the stated ordering weighs them: what costs on every micro-batch (host copies of every saved
# activation or every parameter; recomputing a forward; dequantizing every matmul's weights) before what costs
# once per update (the optimizer's step).
DIMENSIONS: tuple[Dimension, ...] = (
    Dimension(
        "offload",
        _tag("offload", "none"),
        "none",
        lambda value: (float({"none": 0, "activations": 1, "params": 2}.get(value, 3)), 0),
    ),
    Dimension("ac", lambda profile: profile.activation_checkpointing, "none", recomputation_key),
    # The loss (--loss, autotune/tasks/losses.py): TRL's chunks make their head again in the backward; Liger's
    # fused form and the plain loss make it once.
    Dimension(
        "loss",
        _tag("lm_loss", "plain"),
        "plain",
        lambda value: (1.0 if value.startswith("chunked:") else 0.0, 0),
    ),
    Dimension("quantize", _tag("quantize", "none"), "none", lambda value: (0.0 if value == "none" else 1.0, 0)),
    Dimension("optimizer", _tag("optimizer_spec", "default"), "default", _optimizer_cost),
    Dimension("zero_grad", _tag("zero_grad", "none"), "none", lambda value: (0.0, 0)),
    Dimension("precision", lambda profile: profile.precision, "fp32", lambda value: (0.0, 0)),
    # How the ranks hold the model (autotune/core/setup.py): profiles of one job under two strategies or meshes are
    # two setups, told apart in the recommendation (their plans are over their own D).
    Dimension("strategy", lambda profile: f"{profile.strategy} x{profile.world_size}", "ddp x1", lambda _: (0.0, 0)),
    Dimension("mesh", lambda profile: Mesh.from_dict(profile.mesh).label() or "none", "none", lambda value: (0.0, 0)),
)
_KNOWN = {dimension.name for dimension in DIMENSIONS}
# Tags a task writes for every profile of a setup, not choices between setups.
_NOT_CHOICES = {"offload", "quantize", "optimizer_spec", "zero_grad", "lm_loss"}


def setup_of(profile: Profile) -> tuple[tuple[str, str], ...]:
    """The profile's choice in every dimension, then its other tags (a dimension without an entry here)."""
    known = tuple((dimension.name, dimension.read(profile)) for dimension in DIMENSIONS)
    others = tuple(sorted((key, str(value)) for key, value in profile.tags.items() if key not in _NOT_CHOICES))
    return known + others


@dataclass(frozen=True)
class Option:
    """One setup's answer: its plan (None without a target: one micro-batch of m_max per update)
    and the samples per second timed for it (None: not timed).

    ``policy`` is the memory policy; ``setup`` every dimension's value (:func:`setup_of`; empty: the policy
    alone); ``label`` what the recommendation calls it (the values in which the options compared differ);
    ``holds_target`` whether its plan reaches the target batch.
    """

    policy: str
    max_micro_batch: int
    micro_batches: tuple[MicroBatchCount, ...]
    accumulation_steps: int
    samples_per_second: float | None
    timed: bool = True
    plan: Plan | None = None
    setup: tuple[tuple[str, str], ...] = ()
    label: str | None = None
    holds_target: bool = True
    # The timings are an emulated estimate's prediction (autotune/core/step_time.py), not a timed run.
    predicted: bool = False
    # Every GPU of the job (W), over which options of different meshes compare, and its tokens per second on each
    # where the sample's length is known.
    gpus: int = 1
    tokens_per_second_per_gpu: float | None = None

    @property
    def per_gpu(self) -> float | None:
        """Samples per second per GPU of the job: what options over different numbers of GPUs compare by."""
        return None if self.samples_per_second is None else self.samples_per_second / self.gpus

    def value(self, name: str) -> str | None:
        """The option's value in dimension name (the policy for ``ac``), None where it has none."""
        if name == "ac":
            return self.policy
        return dict(self.setup).get(name)

    def text(self) -> str:
        sizes = " + ".join(f"{count}x{size}" for size, count in self.micro_batches)
        rate = "not timed" if self.samples_per_second is None else f"{self.samples_per_second:.4g} samples/s"
        if self.samples_per_second is not None and self.predicted:  # an emulated estimate's: per GPU, and said
            if self.tokens_per_second_per_gpu is not None:
                rate += f", {self.tokens_per_second_per_gpu:,.0f} tokens/s/GPU"
            rate += " predicted"
        if self.samples_per_second is not None and not self.timed:
            rate += " (priced from the nearest timed size)"
        # The policy said as the flag that asks for it: "none" alone read as "nothing recommended".
        name = self.label or f"--ac {self.policy}"
        held = "" if self.holds_target else ", does not reach the target"
        return f"{name}: m_max {self.max_micro_batch}, update {sizes} ({self.accumulation_steps} steps), {rate}{held}"


def option_for(profile: Profile) -> Option:
    """The option a profile offers: its plan (or one micro-batch of m_max) priced from its timings."""
    the_plan = profile.plan
    micro_batches = tuple(the_plan.micro_batches) if the_plan else ((profile.max_micro_batch, 1),)
    steps = the_plan.accumulation_steps if the_plan else 1
    world = the_plan.world_size if the_plan else profile.world_size
    rate = samples_per_second(profile.throughput or [], micro_batches, world)
    length = profile.seq_len or _tagged_length(profile)
    tokens = None if rate is None or not length else rate[0] * length / profile.world_size
    return Option(
        policy=profile.activation_checkpointing,
        max_micro_batch=the_plan.max_micro_batch if the_plan else profile.max_micro_batch,
        micro_batches=micro_batches,
        accumulation_steps=steps,
        samples_per_second=None if rate is None else rate[0],
        timed=True if rate is None else rate[1],
        plan=the_plan,
        setup=setup_of(profile),
        holds_target=the_plan is None or the_plan.exact,
        predicted=any(timing.predicted for timing in profile.throughput or []),
        gpus=profile.world_size,
        tokens_per_second_per_gpu=tokens,
    )


def _tagged_length(profile: Profile) -> int | None:
    value = profile.tags.get("seq_len")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def options_for(profiles: Sequence[Profile]) -> list[Option]:
    """The options of profiles of one job in different setups, each labelled by the values in which they
    differ (the policy alone where only it does, as the probe's ``--ac`` list gives them)."""
    options = [option_for(profile) for profile in profiles]
    names = [name for name, _ in options[0].setup] if options else []
    names += sorted({name for o in options for name, _ in o.setup} - set(names))
    differ = [name for name in names if len({o.value(name) for o in options}) > 1]
    if not differ or differ == ["ac"]:
        return options
    return [dataclasses.replace(o, label=", ".join(f"{name} {o.value(name)}" for name in differ)) for o in options]


def _extra_work(option: Option) -> tuple[tuple[float, int], ...]:
    """The stated ordering's key: each dimension's cost, in DIMENSIONS' order (unknown values last)."""
    key = []
    for dimension in DIMENSIONS:
        value = option.value(dimension.name)
        key.append(dimension.cost(dimension.default if value is None else value))
    return tuple(key)



def recommend(options: Sequence[Option], objective: str = "throughput") -> Option:
    """The best option among those that hold the target (all where none does): the most samples per
    second (timed ones before untimed; untimed ones by the stated ordering: the fewest accumulation steps),
    or for ``objective="memory"`` the fewest accumulation steps and the largest micro-batch; the least extra
    work among equals (offload none first; none, every-K with the larger K first, op, full:
    ``policy_names.recomputation_key``; no quantization; the default or fused optimizer), then the largest
    micro-batch.

    >>> fast = Option("none", 10, ((10, 3),), 3, 50.0)
    >>> slow = Option("full", 30, ((30, 1),), 1, 40.0)
    >>> recommend([slow, fast]).policy, recommend([slow, fast], "memory").policy
    ('none', 'full')

    Raises:
        ValueError: no options, or an unknown objective.
    """
    if not options:
        raise ValueError("no policy to recommend from")
    held = [o for o in options if o.holds_target] or list(options)
    if objective == "throughput":
        return min(
            held,
            key=lambda o: (
                o.samples_per_second is None,
                -(o.per_gpu or 0.0),
                o.accumulation_steps if o.samples_per_second is None else 0,
                _extra_work(o),
                -o.max_micro_batch,
            ),
        )
    if objective == "memory":
        return min(held, key=lambda o: (o.accumulation_steps, -o.max_micro_batch, _extra_work(o)))
    raise ValueError(f"objective must be memory or throughput, got {objective!r}")


def options_text(best: Option, options: Sequence[Option], objective: str) -> str:
    """The ``recommended:`` line: the chosen policy and plan, the others beside it."""
    others = [o for o in options if o is not best]
    line = f"recommended: {best.text()} (objective {objective})"
    margin = _margin(best, options, objective)
    if margin:
        line += f", {margin}"
    if others:
        line += "; beside it " + "; ".join(o.text() for o in others)
    return line


def _margin(best: Option, options: Sequence[Option], objective: str) -> str | None:
    """How far ahead of the next option (among those holding the target, by samples per second per GPU) the best
    one is, under objective throughput.

    >>> fast = Option("none", 10, ((10, 3),), 3, 50.0)
    >>> slow = Option("full", 30, ((30, 1),), 1, 40.0)
    >>> _margin(fast, [fast, slow], "throughput")
    '25.0% faster than --ac full (50 against 40 samples/s per GPU)'
    """
    if objective != "throughput" or best.per_gpu is None:
        return None
    held = [o for o in options if o.holds_target] or list(options)
    rivals = [o for o in held if o is not best and o.per_gpu is not None]
    if not rivals:
        return None
    runner_up = max(rivals, key=lambda o: o.per_gpu or 0.0)
    assert runner_up.per_gpu is not None
    ahead = best.per_gpu / runner_up.per_gpu - 1 if runner_up.per_gpu else 0.0
    said = "predicted " if best.predicted else ""
    return (
        f"{said}{ahead:.1%} faster than {runner_up.label or '--ac ' + runner_up.policy} "
        f"({best.per_gpu:.4g} against {runner_up.per_gpu:.4g} samples/s per GPU)"
    )
