"""Does a profile say what its own trials measured? The checks the store and the probe share.

A writer token is trust, not proof: a buggy client, a hand-edited JSON file or a profile from an
older version can carry a ``max_micro_batch`` its trials contradict, and every job that asks the
store would then run out of memory. :func:`profile_problems` lists each contradiction with the field
at fault and the trial that shows it; :func:`check_profile` raises them. The server runs it on every
upload (a 422) and on every stored profile it reads (one that fails is served with a warning and
never used by /suggest); the probe runs it before it writes a profile.

The rules read only the profile's deciding trials (``Profile.deciding_trials``: the real trials of a
measurement, the fake ones of an estimate); a measurement's fake pre-search points guided the search
and prove nothing. With limit = budget x (1 - headroom), a trial "fits" when it did not run out of
memory and its peak <= limit; m_max = ``max_micro_batch`` and u = ``multiple_of``:

- m_max is a multiple of u and at most the cap (``micro_batch_cap``).
- A trial at m_max exists, and no trial at m <= m_max failed (over the limit or OOM).
- Unless m_max + u passes the cap, a trial at m_max + u exists and failed.
- Every trial's ``fits`` agrees with its peak, the limit and its ``oom``.
- A size that fits above one that failed is a non-monotone peak: the profile must say so
  (``non_monotone``); m_max is then the largest size below the first failure (the two rules above).
- The plan: sizes <= m_max and multiples of u, the largest is ``micro_batch``, the counts sum to
  ``accumulation_steps``, the sizes' sum x ``world_size`` is ``effective_batch``, ``exact`` only when
  that is the target, ``max_micro_batch`` is m_max.
- A surface over lengths (``surface``) comes with the profile's ``seq_len``, covers it and lists
  it among its measured lengths.
- The fit's numbers are finite and non-negative; the limit is at least one byte; a measured budget
  is at most the device's memory; ``device.kind`` agrees with the kind ``device.name`` names, where
  the name tells it.

Torch-free: the service image imports this module.

    >>> from tests.factories import make_profile  # doctest: +SKIP
    >>> profile_problems(make_profile())  # doctest: +SKIP
    []
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from autotune.core.errors import AutotuneError
from autotune.core.schemas import Device, Profile, Trial

__all__ = [
    "InconsistentProfile",
    "Problem",
    "check_profile",
    "device_kind_of_name",
    "exceeds_host_budget",
    "profile_problems",
]

# Words in a device name that tell its kind. ROCm builds report AMD GPUs as "cuda" devices.
_GPU_WORDS = ("nvidia", "tesla", "geforce", "quadro", "titan", "radeon", "instinct")
_CPU_WORDS = ("xeon", "epyc", "ryzen", "core(tm)", "threadripper", "opteron", "neoverse", "graviton")


@dataclass(frozen=True)
class Problem:
    """One contradiction: the field at fault, a sentence, and the trial that shows it (if one does).

    ``trial`` is the trial's index in ``Profile.trials`` (``trials.<index>`` in a JSON body) and
    ``micro_batch`` its size.
    """

    field: str
    message: str
    trial: int | None = None
    micro_batch: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, for an error body's details."""
        return asdict(self)


class InconsistentProfile(AutotuneError):
    """A profile whose claims its own trials contradict; ``problems`` lists every one, the first
    names the field (``field``) and the trial."""

    def __init__(self, problems: list[Problem]) -> None:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"{first.field}: {first.message}{more}")
        self.problems = problems
        self.field = first.field


def device_kind_of_name(name: str) -> str | None:
    """"cpu" or "cuda" when a device name tells its kind ("cpu", "NVIDIA H100 80GB HBM3"), else None."""
    lowered = name.strip().lower()
    if lowered == "cpu" or lowered.startswith("cpu ") or any(word in lowered for word in _CPU_WORDS):
        return "cpu"
    if any(word in lowered for word in _GPU_WORDS):
        return "cuda"
    return None


def exceeds_host_budget(host_peak_bytes: int | None, host_budget_bytes: int | None) -> bool:
    """Under --host-budget, a size whose host bytes (--offload) exceed it does not fit: the rule a trial's ``fits``
    and this check both read.

    >>> exceeds_host_budget(300, 200), exceeds_host_budget(200, 200), exceeds_host_budget(300, None)
    (True, False, False)
    """
    return host_budget_bytes is not None and host_peak_bytes is not None and host_peak_bytes > host_budget_bytes


def _over_host(trial: Trial, host_budget: int | None) -> bool:
    return exceeds_host_budget(trial.host_peak_bytes, host_budget)


def _failed(trial: Trial, limit: int, host_budget: int | None = None) -> bool:
    return trial.oom or trial.peak_bytes > limit or _over_host(trial, host_budget)


def _verdict(trial: Trial, limit: int, host_budget: int | None = None) -> str:
    if trial.oom:
        return "ran out of memory"
    if _over_host(trial, host_budget):
        return f"held {trial.host_peak_bytes} host bytes, over the host budget of {host_budget}"
    if trial.peak_bytes > limit:
        return f"peaked at {trial.peak_bytes} bytes, over the limit of {limit}"
    return f"peaked at {trial.peak_bytes} bytes, within the limit of {limit}"


def _trial_problems(profile: Profile, deciding: list[tuple[int, Trial]], limit: int) -> list[Problem]:
    host = profile.host_budget_bytes  # --host-budget: a size over it does not fit either
    problems = []
    for index, t in deciding:
        if t.fits and t.oom:
            message = f"trial {index} (m={t.micro_batch}) says it fits, but it ran out of memory"
            problems.append(Problem(f"trials.{index}.fits", message, index, t.micro_batch))
        elif t.fits != (not _failed(t, limit, host)):
            claim = "fits" if t.fits else "does not fit"
            problems.append(
                Problem(
                    f"trials.{index}.fits",
                    f"trial {index} (m={t.micro_batch}) says it {claim}, but it {_verdict(t, limit, host)} "
                    f"(budget {profile.budget_bytes} x (1 - headroom {profile.headroom:g}))",
                    index,
                    t.micro_batch,
                )
            )
    return problems


def _max_micro_batch_problems(profile: Profile, deciding: list[tuple[int, Trial]], limit: int) -> list[Problem]:
    host = profile.host_budget_bytes  # --host-budget: a size over it does not fit either
    m_max, unit, cap = profile.max_micro_batch, profile.multiple_of, profile.micro_batch_cap
    what = "real" if profile.source != "estimate" else "fake (estimate)"
    problems = []
    # The strongest evidence first: a size at or below m_max that was measured not to fit.
    for index, t in deciding:
        if t.micro_batch <= m_max and _failed(t, limit, host):
            problems.append(
                Problem(
                    "max_micro_batch",
                    f"{m_max} is contradicted by trial {index}: m={t.micro_batch} {_verdict(t, limit, host)}",
                    index,
                    t.micro_batch,
                )
            )
    if m_max % unit:
        problems.append(Problem("max_micro_batch", f"{m_max} is not a multiple of multiple_of {unit}"))
    if m_max > cap:
        problems.append(Problem("max_micro_batch", f"{m_max} is above the cap micro_batch_cap {cap}"))
    # (A trial at m_max that failed is one of the contradictions above.)
    if not any(t.micro_batch == m_max for _, t in deciding):
        problems.append(Problem("max_micro_batch", f"no {what} trial measured m={m_max}"))
    above = m_max + unit
    if above <= cap:
        next_trials = [(i, t) for i, t in deciding if t.micro_batch == above]
        if not next_trials:
            problems.append(
                Problem(
                    "max_micro_batch",
                    f"no {what} trial measured m={above} (m_max + multiple_of), so nothing shows that "
                    f"{m_max} is the largest size that fits below the cap {cap}",
                )
            )
        elif not any(_failed(t, limit, host) for _, t in next_trials):
            index, t = next_trials[0]
            problems.append(
                Problem(
                    "max_micro_batch",
                    f"{m_max} is not the largest size that fits: trial {index} at m={above} {_verdict(t, limit, host)}",
                    index,
                    above,
                )
            )
    return problems


def _monotone_problems(profile: Profile, deciding: list[tuple[int, Trial]], limit: int) -> list[Problem]:
    host = profile.host_budget_bytes  # --host-budget: a size over it does not fit either
    failures = [(i, t) for i, t in deciding if _failed(t, limit, host)]
    if not failures or profile.non_monotone:
        return []
    first_index, first = min(failures, key=lambda pair: pair[1].micro_batch)
    above = [(i, t) for i, t in deciding if t.micro_batch > first.micro_batch and not _failed(t, limit, host)]
    if not above:
        return []
    index, t = above[0]
    return [
        Problem(
            "non_monotone",
            f"trial {index} at m={t.micro_batch} fits above trial {first_index} at m={first.micro_batch}, "
            "which did not: a non-monotone peak the profile must declare (non_monotone: true)",
            index,
            t.micro_batch,
        )
    ]


def _m_max_for(profile: Profile, steps: int) -> int:
    """The m_max an update of steps micro-batches is held to: a single step's (A = 1, measured by trials of
    its own: Profile.single_step) where there is one, else the accumulating job's."""
    if steps == 1 and profile.single_step is not None:
        return max(profile.single_step.max_micro_batch, profile.max_micro_batch)
    return profile.max_micro_batch


def _plan_problems(profile: Profile) -> list[Problem]:
    plan = profile.plan
    if plan is None:
        return []
    m_max, unit = _m_max_for(profile, plan.accumulation_steps), profile.multiple_of
    if plan.micro_batch <= profile.max_micro_batch:  # planned from it, single step or not (core.plan.plan_profile)
        m_max = profile.max_micro_batch
    problems = []
    sizes = [size for size, _ in plan.micro_batches]
    if plan.micro_batch > m_max:
        problems.append(Problem("plan.micro_batch", f"{plan.micro_batch} is above max_micro_batch {m_max}"))
    for size in sizes:
        if size > m_max and size != plan.micro_batch:
            problems.append(Problem("plan.micro_batches", f"size {size} is above max_micro_batch {m_max}"))
        if size % unit:
            problems.append(Problem("plan.micro_batches", f"size {size} is not a multiple of multiple_of {unit}"))
    if max(sizes) != plan.micro_batch:
        problems.append(
            Problem("plan.micro_batch", f"{plan.micro_batch} is not the largest of the plan's sizes {sizes}")
        )
    steps = sum(count for _, count in plan.micro_batches)
    if steps != plan.accumulation_steps:
        problems.append(
            Problem(
                "plan.accumulation_steps",
                f"{plan.accumulation_steps} differs from the {steps} micro-batches the plan lists",
            )
        )
    effective = sum(size * count for size, count in plan.micro_batches) * plan.world_size
    if effective != plan.effective_batch:
        problems.append(
            Problem(
                "plan.effective_batch",
                f"{plan.effective_batch} differs from the plan's micro-batches x world_size = {effective}",
            )
        )
    if plan.exact != (plan.effective_batch == plan.target_batch):
        problems.append(
            Problem(
                "plan.exact",
                f"{str(plan.exact).lower()} with effective_batch {plan.effective_batch} and "
                f"target_batch {plan.target_batch}",
            )
        )
    if plan.max_micro_batch != m_max:
        problems.append(
            Problem("plan.max_micro_batch", f"{plan.max_micro_batch} differs from max_micro_batch {m_max}")
        )
    return problems


def _device_problems(profile: Profile) -> list[Problem]:
    problems = []
    named: list[tuple[str, Device]] = [("device", profile.device)]
    named += [(f"devices.{i}", d) for i, d in enumerate(profile.devices)]
    for where, device in named:
        kind = device_kind_of_name(device.name)
        if kind is not None and kind != device.kind:
            problems.append(
                Problem(f"{where}.kind", f"{device.kind!r}, but the name {device.name!r} is a {kind} device")
            )
    total = profile.device.total_bytes
    if profile.source != "estimate" and total is not None and profile.budget_bytes > total:
        problems.append(
            Problem(
                "budget_bytes",
                f"{profile.budget_bytes} is more than the {total} bytes of the device it was measured on",
            )
        )
    if profile.limit_bytes < 1:
        problems.append(
            Problem("headroom", f"{profile.headroom:g} leaves no memory of the budget {profile.budget_bytes} bytes")
        )
    return problems


def _fit_problems(profile: Profile) -> list[Problem]:
    if profile.fit is None:
        return []
    fit = profile.fit
    return [
        Problem(f"fit.{name}", f"{value} is not a finite, non-negative number of bytes")
        for name, value in (("fixed_bytes", fit.fixed_bytes), ("bytes_per_sample", fit.bytes_per_sample))
        if not (math.isfinite(value) and value >= 0)
    ]


def _surface_problems(profile: Profile) -> list[Problem]:
    """A surface belongs to a sequence-aware profile, whose length it covers and was measured at;
    its coefficients are what autotune/core/surface.py can read."""
    surface = profile.surface
    if surface is None:
        return []
    if profile.seq_len is None:
        return [Problem("surface", "a memory surface over lengths needs the profile's seq_len")]
    problems = []
    low, high = surface.covered
    if not low <= profile.seq_len <= high:
        problems.append(Problem("seq_len", f"{profile.seq_len} is outside the surface's covered lengths {low}..{high}"))
    if profile.seq_len not in surface.measured_lengths:
        problems.append(
            Problem("surface.measured_lengths", f"does not list the profile's own seq_len {profile.seq_len}")
        )
    return problems


def _throughput_problems(profile: Profile) -> list[Problem]:
    """Timed runs are of sizes that fit, on the device (an estimate's fake trials have no time: its throughput is
    predicted, autotune/core/step_time.py, and says so; a measurement's is timed), their samples per second is the
    update's samples over its seconds, and a prediction's parts add up to its seconds."""
    problems = []
    for index, timing in enumerate(profile.throughput or []):
        where = f"throughput.{index}"
        if profile.source == "estimate" and not timing.predicted:
            problems.append(Problem(where, "an estimate (fake-tensor trials only) cannot have been timed"))
        if profile.source == "measured" and timing.predicted:
            problems.append(Problem(f"{where}.predicted", "a measured profile's throughput is timed, not predicted"))
        parts = timing.parts
        if parts is not None:
            total = (
                parts.compute_seconds + parts.exposed_communication_seconds + parts.bubble_seconds
                + parts.optimizer_seconds
            )  # fmt: skip
            if not math.isclose(total, timing.seconds_per_update, rel_tol=0.01, abs_tol=1e-6):
                said = f"add up to {total:.4g} s, not the update's {timing.seconds_per_update} s"
                problems.append(Problem(f"{where}.parts", said))
        sizes = [size for size, _ in timing.micro_batches]
        m_max = _m_max_for(profile, sum(count for _, count in timing.micro_batches))
        if max(sizes) > m_max:
            above = f"size {max(sizes)} is above max_micro_batch {m_max}"
            problems.append(Problem(f"{where}.micro_batches", above))
        samples = timing.world_size * sum(size * count for size, count in timing.micro_batches)
        expected = samples / timing.seconds_per_update
        if not math.isclose(timing.samples_per_second, expected, rel_tol=0.01):
            problems.append(
                Problem(
                    f"{where}.samples_per_second",
                    f"{timing.samples_per_second} is not the update's {samples} samples over its "
                    f"{timing.seconds_per_update} s ({expected:.4g})",
                )
            )
    return problems


def profile_problems(profile: Profile) -> list[Problem]:
    """Every contradiction in a profile, the most telling first (an empty list: consistent).

    Args:
        profile: a validated Profile.

    Returns:
        Problems: the budget, headroom and device first (every verdict rests on them), then
        ``max_micro_batch`` against the trials, the trials' own verdicts, the monotonicity, the plan
        and the fit.
    """
    deciding_ids = {id(t) for t in profile.deciding_trials}
    deciding = [(i, t) for i, t in enumerate(profile.trials) if id(t) in deciding_ids]
    limit = profile.limit_bytes
    return [
        *_device_problems(profile),  # the premises: a limit and a device every verdict rests on
        *_max_micro_batch_problems(profile, deciding, limit),
        *_trial_problems(profile, deciding, limit),
        *_monotone_problems(profile, deciding, limit),
        *_plan_problems(profile),
        *_fit_problems(profile),
        *_surface_problems(profile),
        *_throughput_problems(profile),
    ]


def check_profile(profile: Profile) -> None:
    """Raise when a profile contradicts itself.

    Raises:
        InconsistentProfile: with every problem; its message and ``field`` are the first one's,
            naming the field and the trial (``max_micro_batch: 1000000 is contradicted by trial 4:
            m=27 peaked at ... over the limit of ...``).
    """
    problems = profile_problems(profile)
    if problems:
        raise InconsistentProfile(problems)
