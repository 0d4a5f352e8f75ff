"""An estimate of a CUDA card re-derived with what the fleet measured outside the caching allocator.

``autotune estimate --gpu NAME`` records each trial's figure as the allocator model's reserved bytes
plus an assumption: the memory outside the allocator (the CUDA context and the kernel modules loaded),
from the card catalog or ``--context-bytes``. The store knows what real probes of that card held there
(``repository.device_context``). When /suggest answers from such an estimate, it re-reads the
estimate's trials with the measured figure instead of the assumed one:

- each trial's figure becomes (peak_bytes - outside_allocator_bytes) + the measured outside bytes, and
  it fits when that is within the profile's limit, budget x (1 - headroom); an OOM trial (the allocator
  model refused it) stays a failure, since its reserved bytes were never known;
- m_max becomes the largest tested size (a multiple of ``multiple_of``, within the cap) such that every
  tested size up to it fits. Sizes between tested ones were never run, so m_max is always a tested size:
  with less memory outside than assumed it may rise to a tested size that now fits, never into an
  untested gap; with more, it falls to the largest tested size below the first that no longer fits.

The stored profile is never changed: this is arithmetic on what ``lookup`` read. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from autotune.core.schemas import DeviceContext, Fit
from autotune.core.units import format_bytes as human_bytes
from autotune.core.units import limit_bytes_unrounded
from autotune_server.candidates import Candidate

__all__ = ["EstimateTrial", "Rederived", "TrialFigure", "for_candidate", "rederive"]


class EstimateTrial(NamedTuple):
    """One deciding trial of an estimate, as the estimate recorded it."""

    micro_batch: int
    peak_bytes: int
    oom: bool
    # What the estimate assumed outside the allocator (None: the trial records none).
    outside_allocator_bytes: int | None


class TrialFigure(NamedTuple):
    """A trial re-read with the measured figure; the shape of ``Candidate.trials``."""

    micro_batch: int
    peak_bytes: int
    fits: bool
    oom: bool


@dataclass(frozen=True)
class Rederived:
    """An estimate's answer with the measured outside figure."""

    # 0: not even the smallest tested size fits with the measured figure.
    max_micro_batch: int
    trials: tuple[TrialFigure, ...]
    # What the estimate's figures moved by where it assumed least outside the allocator (its one
    # figure, for ``autotune estimate --gpu``): the shift of a fit of its figures that no trial
    # contradicts in the conservative direction.
    shift_bytes: int
    note: str


def rederive(
    trials: Sequence[EstimateTrial],
    *,
    max_micro_batch: int,
    limit_bytes: float,
    measured: DeviceContext,
    multiple_of: int = 1,
    micro_batch_cap: int | None = None,
) -> Rederived | None:
    """The estimate's trials and m_max with ``measured.outside_allocator_bytes`` outside the allocator.

    Args:
        trials: the estimate's deciding trials; max_micro_batch: its stored m_max (for the note).
        limit_bytes: the profile's limit, budget x (1 - headroom).
        measured: what measured profiles of the card hold outside the allocator.
        multiple_of, micro_batch_cap: the profile's; m_max respects both.

    Returns:
        None where there is nothing to re-derive: a trial that ran (not OOM) records no outside figure
        (the estimate did not assume one, so its figure cannot be split), or every trial assumed exactly
        what was measured.
    """
    assumed = [t.outside_allocator_bytes for t in trials if not t.oom]
    outside = measured.outside_allocator_bytes
    if not assumed or any(figure is None for figure in assumed):
        return None
    figures = [int(f) for f in assumed if f is not None]  # all of them: checked above, for mypy
    if all(figure == outside for figure in figures):
        return None
    refigured = tuple(_refigured(t, outside, limit_bytes) for t in trials)
    m_max = _largest_fitting_prefix(refigured, multiple_of, micro_batch_cap)
    return Rederived(
        max_micro_batch=m_max,
        trials=refigured,
        shift_bytes=outside - min(figures),
        note=_note(measured, min(figures), max(figures), m_max, max_micro_batch, multiple_of),
    )


def _refigured(trial: EstimateTrial, outside_bytes: int, limit_bytes: float) -> TrialFigure:
    if trial.oom or trial.outside_allocator_bytes is None:
        return TrialFigure(trial.micro_batch, trial.peak_bytes, fits=False, oom=trial.oom)
    figure = trial.peak_bytes - trial.outside_allocator_bytes + outside_bytes
    return TrialFigure(trial.micro_batch, figure, fits=figure <= limit_bytes, oom=False)


def _largest_fitting_prefix(trials: Sequence[TrialFigure], multiple_of: int, cap: int | None) -> int:
    """The largest tested size below the first tested size that does not fit (0: none)."""
    first_failure = min((t.micro_batch for t in trials if not t.fits), default=None)
    return max(
        (
            t.micro_batch
            for t in trials
            if (first_failure is None or t.micro_batch < first_failure)
            and t.micro_batch % multiple_of == 0
            and (cap is None or t.micro_batch <= cap)
        ),
        default=0,
    )


def _note(
    measured: DeviceContext, assumed_low: int, assumed_high: int, m_max: int, stored_m_max: int, multiple_of: int
) -> str:
    assumed = human_bytes(assumed_low) + ("" if assumed_low == assumed_high else f" to {human_bytes(assumed_high)}")
    torch = f", torch {measured.torch_version}" if measured.torch_version else ""
    profiles = f"{measured.profiles} profile{'s' if measured.profiles != 1 else ''}"
    where = (
        f"estimate re-derived with the {human_bytes(measured.outside_allocator_bytes)} outside the allocator "
        f"measured on {measured.device_name} ({profiles}{torch}) instead of the estimate's {assumed}"
    )
    if m_max < 1:
        return f"{where}: not even micro-batch {multiple_of} fits"
    return f"{where}: max micro-batch {m_max} (the estimate's {stored_m_max})"


def for_candidate(c: Candidate) -> tuple[Candidate, str | None]:
    """c re-derived with the outside figure measured on its card, and the note that says so; c itself
    and None where there is nothing to re-derive (not an estimate, nothing measured, see ``rederive``).

    A re-derived m_max of 0 is for the caller to refuse. The fit moves by ``shift_bytes``: an estimate's
    fit is of its figures, outside bytes included, and must not predict below the re-derived trials.
    """
    # Figures that no longer line up with the trials (sequence.covering's candidates have no trials) say nothing.
    if not c.estimate or c.measured_context is None or len(c.outside_allocator_bytes) != len(c.trials):
        return c, None
    found = rederive(
        [
            EstimateTrial(m, peak, oom, outside)
            for (m, peak, _fits, oom), outside in zip(c.trials, c.outside_allocator_bytes, strict=True)
        ],
        max_micro_batch=c.max_micro_batch,
        limit_bytes=limit_bytes_unrounded(c.budget_bytes, c.headroom),
        measured=c.measured_context,
        multiple_of=c.multiple_of,
        micro_batch_cap=c.micro_batch_cap,
    )
    if found is None:
        return c, None
    fit = (
        None
        if c.fit is None
        else Fit(fixed_bytes=c.fit.fixed_bytes + found.shift_bytes, bytes_per_sample=c.fit.bytes_per_sample)
    )
    return replace(c, max_micro_batch=found.max_micro_batch, trials=found.trials, fit=fit), found.note
