"""Observed drift: how far training jobs' peaks run above the probe's, and the m that still fits.

A probe's trial is four micro-batches and two optimizer steps; a job runs for hours, and its peak
creeps up (allocator fragmentation, longer batches later, other processes). Jobs report what they
saw (``POST /profiles/{id}/observations``); for each profile the store compares every reported peak
with what the probe says the same micro-batch peaks at (:meth:`Reference.peak_at`: the deciding
trial measured at that m, else the profile's fit, floored at the optimizer step's peak), as a
ratio ``observed / probe - 1``.

**The rule** (:func:`drift_of`). One ratio per observation; the drift is

- with one observation, that one (the only evidence there is);
- with n >= 2, the k-th largest, k = max(2, floor(n x (1 - QUANTILE)) + 1): the 90th percentile
  (nearest rank, from above), and never the single largest, so that one stray job (a neighbour
  process on its card, a leak of its own) does not move every later answer. A job that really runs
  out of memory reports an OOM, and an OOM caps the answer whatever the drift says.

Only a positive drift is applied: peaks below the probe never raise m above what was measured.
``/suggest`` then answers the largest m (at most the profile's m_max, in steps of multiple_of) whose
probe peak raised by the drift is within the limit, and says so: "3 jobs observed up to 4.0 % above
the probe at m = 26; answering 25". An observation at a micro-batch the profile never measured,
with no fit to compare with, is stored and left out of the drift (the POST answer says so).

Pure arithmetic on what ``candidates.lookup`` read; torch-free, like the rest of the server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.core.errors import AutotuneError
from autotune.core.mesh import Mesh
from autotune.core.plan import micro_batch_for_limit
from autotune.core.schemas import Fit, Observation, Profile
from autotune_server.candidates import Candidate
from autotune_server.convert import fit_of
from autotune_server.errors import BudgetTooSmall, ObservationMismatch
from autotune_server.models import ObservationRow, ProfileRow

__all__ = [
    "QUANTILE",
    "Drift",
    "ProfileDrift",
    "Reference",
    "check_observation",
    "drift_of",
    "fitting_micro_batch",
    "profile_drift",
    "reference_of",
    "unmatched_reason",
    "within_drift",
]

QUANTILE = 0.9
# Below the fit's intercept the search steps m down one multiple_of at a time: at most this many.
_MAX_STEPS = 4096


@dataclass(frozen=True)
class Reference:
    """What the probe says a micro-batch peaks at: its deciding trials (m, peak, fits, oom), its fit
    of the forward/backward peaks, and the optimizer step's peak (flat in m) that floors the fit."""

    trials: tuple[tuple[int, int, bool, bool], ...]
    fit: Fit | None = None
    step_floor: int | None = None

    def peak_at(self, micro_batch: int) -> int | None:
        """The probe's peak at micro_batch: measured where a deciding trial fitted there, else by the
        fit (never below the step's peak); None with neither."""
        measured = [peak for m, peak, fits, oom in self.trials if m == micro_batch and fits and not oom]
        if measured:
            return max(measured)
        if self.fit is None:
            return None
        by_fit = round(self.fit.fixed_bytes + self.fit.bytes_per_sample * micro_batch)
        return max(by_fit, self.step_floor or 0, 1)


@dataclass(frozen=True)
class Drift:
    """The drift of one profile: ``ratio`` by the rule (may be negative), from ``count`` observations;
    the highest one seen, at which micro-batch; ``ignored`` observations had nothing to compare with."""

    ratio: float
    count: int
    highest: float
    highest_at: int
    ignored: int = 0

    @property
    def applied(self) -> float:
        """What /suggest raises the probe's peaks by: the rule's drift, never below zero."""
        return max(0.0, self.ratio)

    def text(self) -> str:
        """'3 jobs observed up to 4.0 % above the probe at m = 26' (and what the rule took)."""
        jobs = "1 job" if self.count == 1 else f"{self.count} jobs"
        where = "above" if self.highest >= 0 else "below"
        text = f"{jobs} observed up to {abs(self.highest) * 100:.1f} % {where} the probe at m = {self.highest_at}"
        if self.count > 1 and self.ratio < self.highest:
            text += (
                f" (the drift rule takes {self.ratio * 100:+.1f} %: the 90th percentile, never the single "
                "largest report)"
            )
        return text


def _rank_from_top(count: int) -> int:
    """k of the k-th largest ratio the rule takes (see the module docstring)."""
    if count <= 1:
        return 1
    return max(2, math.floor(round(count * (1.0 - QUANTILE), 9)) + 1)  # round: 40 x 0.1 is 3.99...


def drift_of(observations: Sequence[tuple[int, int]], reference: Reference) -> Drift | None:
    """The drift of (micro_batch, peak_bytes) observations against the probe; None with none usable.

    >>> ref = Reference(trials=((26, 1000, True, False),))
    >>> drift_of([(26, 1040)], ref).text()
    '1 job observed up to 4.0 % above the probe at m = 26'
    >>> d = drift_of([(26, 1020), (26, 1020), (26, 1400)], ref)
    >>> round(d.ratio, 3), round(d.highest, 3)
    (0.02, 0.4)
    """
    ratios: list[tuple[float, int]] = []
    ignored = 0
    for micro_batch, peak in observations:
        probe_peak = reference.peak_at(micro_batch)
        if probe_peak is None or probe_peak <= 0:
            ignored += 1
            continue
        ratios.append((peak / probe_peak - 1.0, micro_batch))
    if not ratios:
        return None
    ranked = sorted(ratios, reverse=True)
    highest, highest_at = ranked[0]
    ratio = ranked[min(_rank_from_top(len(ranked)), len(ranked)) - 1][0]
    return Drift(ratio=ratio, count=len(ranked), highest=highest, highest_at=highest_at, ignored=ignored)


def fitting_micro_batch(
    reference: Reference, drift: float, *, max_micro_batch: int, limit: float, multiple_of: int
) -> int:
    """The largest m <= max_micro_batch, a multiple of multiple_of, whose probe peak x (1 + drift) is
    within limit (0 when none is). A drift <= 0 answers max_micro_batch: peaks below the probe never
    raise m above what was measured.

    >>> ref = Reference(trials=((26, 1000, True, False),), fit=Fit(fixed_bytes=220.0, bytes_per_sample=30.0))
    >>> fitting_micro_batch(ref, 0.04, max_micro_batch=26, limit=1010, multiple_of=1)
    25
    """
    if drift <= 0:
        return max_micro_batch
    raised_limit = limit / (1.0 + drift)

    def fits(m: int) -> bool:
        peak = reference.peak_at(m)
        return peak is not None and peak <= raised_limit

    if fits(max_micro_batch):
        return max_micro_batch
    candidates = {m for m, _peak, ok, oom in reference.trials if ok and not oom and m < max_micro_batch}
    if reference.fit is not None:
        by_fit = micro_batch_for_limit(reference.fit, raised_limit, max_micro_batch)
        by_fit -= by_fit % multiple_of
        # A measured point can sit above the line: step down from the fit's answer until one fits.
        candidates.update(range(by_fit, max(0, by_fit - _MAX_STEPS * multiple_of), -multiple_of))
    fitting = [m for m in candidates if m >= 1 and m % multiple_of == 0 and m <= max_micro_batch and fits(m)]
    return max(fitting, default=0)


def unmatched_reason(micro_batch: int, reference: Reference, profile_id: int) -> str | None:
    """Why an observation at micro_batch cannot count towards the drift (None: it counts)."""
    if reference.peak_at(micro_batch) is not None:
        return None
    return (
        f"stored, but left out of the drift: profile {profile_id} never measured micro-batch {micro_batch} "
        "and has no memory fit to compare the observed peak with"
    )


def reference_of(c: Candidate) -> Reference:
    """What the probe of a stored profile says its micro-batches peak at."""
    return Reference(trials=c.trials, fit=c.fit, step_floor=c.smallest_peak)


def within_drift(c: Candidate, m_max: int, limit: float, warnings: list[str]) -> int:
    """m_max lowered to the largest m whose probe peak, raised by c's observed drift, is within limit
    (``suggest._measured`` composes it before the OOM cap); a warning says what was observed.

    Raises:
        BudgetTooSmall: with the drift, not even one micro-batch of multiple_of fits.
    """
    reference = reference_of(c)
    drift = drift_of(c.observed, reference)
    if drift is None or drift.applied <= 0:
        return m_max
    answer = fitting_micro_batch(
        reference,
        drift.applied,
        max_micro_batch=m_max,
        limit=limit,
        multiple_of=c.multiple_of,
    )
    if answer >= m_max:
        warnings.append(f"{drift.text()}; m = {m_max} still fits within {int(limit)} bytes with that drift")
        return m_max
    if answer < 1:
        raise BudgetTooSmall(
            f"{drift.text()}: with that drift not even micro-batch {c.multiple_of} of profile {c.id} fits "
            f"within {int(limit)} bytes",
            field="fingerprint",
        )
    warnings.append(f"{drift.text()}; answering {answer}")
    return answer


def _replicas(row: ProfileRow) -> int:
    """D of the profile's setup: its world size over the mesh the stored document holds."""
    try:
        mesh = Mesh.from_dict((row.document or {}).get("mesh"))
    except (AutotuneError, TypeError):
        return int(row.world_size)
    try:
        return mesh.data_parallel(int(row.world_size))
    except AutotuneError:
        return int(row.world_size)


def check_observation(observation: Observation, row: ProfileRow) -> list[str]:
    """What the POST of an observation answers beside the stored row: an observation from another
    device model or world size is refused (its drift would be another setup's), one the drift cannot
    use is stored with a warning saying why.

    Raises:
        ObservationMismatch: ``device_name`` or an explicit ``world_size`` differs from the profile's.
    """
    if observation.device_name is not None and observation.device_name != row.device_name:
        raise ObservationMismatch(
            f"device_name {observation.device_name!r} is not the device of profile {row.id} "
            f"({row.device_name!r}): post it against a profile of that device",
            field="device_name",
        )
    replicas = _replicas(row)
    if "world_size" in observation.model_fields_set and observation.world_size not in (row.world_size, replicas):
        # A job's plan says its replicas D (Suggestion.world_size), which under a mesh are fewer than the W ranks the
        # profile was measured over: either is the profile's own setup.
        raise ObservationMismatch(
            f"world_size {observation.world_size} is not the world size profile {row.id} was measured at "
            f"({row.world_size} ranks, {replicas} data-parallel replicas): post it against a profile of that world "
            "size",
            field="world_size",
        )
    if observation.oom or observation.peak_bytes is None:
        return []
    estimate = row.source == "estimate"
    deciding = [t for t in row.trials if bool(t.fake) == estimate]
    steps = [t.step_bytes for t in deciding if t.step_bytes is not None and not t.oom]
    reference = Reference(
        trials=tuple((t.micro_batch, t.peak_bytes, t.fits, t.oom) for t in deciding),
        fit=fit_of(row),
        step_floor=max(steps) if steps else None,
    )
    reason = unmatched_reason(observation.micro_batch, reference, row.id)
    return [] if reason is None else [reason]


@dataclass(frozen=True)
class ProfileDrift:
    """A datasheet's view of the drift: the rule's verdict, each observation's ratio to the probe (None
    where nothing compares), and the micro-batch /suggest answers with it at the profile's own limit."""

    drift: Drift | None
    ratios: tuple[float | None, ...]
    answer: int

    def text(self) -> str:
        if self.drift is None:
            return ""
        verdict = (
            f"/suggest answers m = {self.answer} within the profile's limit"
            if self.drift.applied > 0
            else "peaks below the probe never raise m"
        )
        return f"{self.drift.text()}; drift {self.drift.ratio * 100:+.1f} %: {verdict}"


def profile_drift(profile: Profile, observations: Sequence[ObservationRow]) -> ProfileDrift:
    """The drift of a stored profile from its observations (rows as the datasheet lists them)."""
    deciding = profile.deciding_trials
    reference = Reference(
        trials=tuple((t.micro_batch, t.peak_bytes, t.fits, t.oom) for t in deciding),
        fit=profile.fit,
        step_floor=profile.step_floor_bytes,
    )
    ratios: list[float | None] = []
    usable: list[tuple[int, int]] = []
    for o in observations:
        probe_peak = None if o.oom or o.peak_bytes is None else reference.peak_at(o.micro_batch)
        if o.peak_bytes is None or probe_peak is None:
            ratios.append(None)
            continue
        ratios.append(o.peak_bytes / probe_peak - 1.0)
        usable.append((o.micro_batch, o.peak_bytes))
    drift = drift_of(usable, reference)
    answer = profile.max_micro_batch
    if drift is not None:
        answer = fitting_micro_batch(
            reference,
            drift.applied,
            max_micro_batch=profile.max_micro_batch,
            limit=profile.limit_bytes,
            multiple_of=profile.multiple_of,
        )
    return ProfileDrift(drift=drift, ratios=tuple(ratios), answer=answer)
