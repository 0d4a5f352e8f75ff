"""Find the largest micro-batch that fits, given a callable trial(m) -> Trial. Pure policy, no torch.

Memory is close to affine in m: peak(m) ~= fixed + per_sample x m. Two small sizes give a line;
the line predicts the boundary; a trial at the prediction and one step past it verifies it. Where
the prediction misses (allocator rounding, kernel workspaces) the next prediction uses the new
points, and after a few misses the search bisects the interval still open. The interval
[largest known fit, smallest known miss] shrinks with every trial, so the search always ends.

    >>> from autotune.schemas import Trial
    >>> def trial(m):  # fixed 100 bytes + 10 per sample, limit 400
    ...     peak = 100 + 10 * m
    ...     return Trial(micro_batch=m, peak_bytes=peak, fits=peak <= 400)
    >>> find_max_micro_batch(trial, limit_bytes=400).max_micro_batch
    30
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autotune.errors import AutotuneError
from autotune.plan import fit_affine, micro_batch_for_limit
from autotune.schemas import Fit, Trial

__all__ = [
    "APPROACH_FRACTION",
    "FAR_EXTRAPOLATION",
    "MAX_PREDICTED_TRIALS",
    "NoFitError",
    "SearchResult",
    "find_max_micro_batch",
]

# Trials guided by the fit before the search stops trusting it and bisects.
MAX_PREDICTED_TRIALS = 4
# A first prediction further than this many times the largest measured m is approached from below,
# at this fraction of the way.
FAR_EXTRAPOLATION = 4
APPROACH_FRACTION = 0.8


class NoFitError(AutotuneError):
    """Even the smallest allowed micro-batch does not fit."""

    def __init__(self, trial: Trial, message: str) -> None:
        super().__init__(message)
        self.trial = trial


@dataclass
class SearchResult:
    max_micro_batch: int
    trials: list[Trial] = field(default_factory=list)
    fit: Fit | None = None

    @property
    def oom_count(self) -> int:
        return sum(1 for trial in self.trials if trial.oom)


def _affine_points(trials: list[Trial]) -> list[tuple[int, int]]:
    """(m, bytes) of the measured trials, by the forward/backward peak where the trial has it:
    that part is affine in m, while the whole-trial peak stays flat as long as the optimizer
    step dominates it."""
    points = {
        t.micro_batch: t.forward_backward_bytes if t.forward_backward_bytes is not None else t.peak_bytes
        for t in trials
        if not t.oom
    }
    return sorted(points.items())


def _fit_near_boundary(trials: list[Trial]) -> Fit | None:
    """The line through the two largest measured micro-batches: the local slope."""
    measured = _affine_points(trials)
    return fit_affine(measured[-2:]) if len(measured) >= 2 else None


def find_max_micro_batch(
    trial: Callable[[int], Trial],
    *,
    limit_bytes: int,
    max_micro_batch: int = 4096,
    multiple_of: int = 1,
) -> SearchResult:
    """The exact largest m (a multiple of multiple_of, at most max_micro_batch) whose trial fits.

    Exact means: trial(m) fits and trial(m + multiple_of) does not, or m is the cap.

    Args:
        trial: runs one measurement at m; must be monotone (a larger m never uses less memory).
        limit_bytes: the peak that still fits, used to predict the boundary from the fit.
        max_micro_batch: the cap on m.
        multiple_of: every m tried is a multiple of this.

    Returns:
        SearchResult with m_max, every trial in order, and the least-squares fit of the measurements.

    Raises:
        NoFitError: m = multiple_of does not fit.
        ValueError: the cap is smaller than multiple_of, or non-positive values.
    """
    if multiple_of < 1 or max_micro_batch < 1:
        raise ValueError("max_micro_batch and multiple_of must be positive")
    top = max_micro_batch // multiple_of  # the search runs over k, with m = k x multiple_of
    if top < 1:
        raise ValueError(f"max_micro_batch {max_micro_batch} is smaller than multiple_of {multiple_of}")

    trials: list[Trial] = []

    def run(k: int) -> bool:
        result = trial(k * multiple_of)
        trials.append(result)
        return result.fits

    if not run(1):
        raise NoFitError(trials[0], f"micro-batch {multiple_of} does not fit")
    lo, hi = 1, top + 1  # lo fits; hi is the smallest k known not to fit (top + 1: none known)
    if top >= 2:
        if run(2):
            lo = 2
        else:
            hi = 2
    predicted = 0
    measured_at_last_prediction = -1
    while hi - lo > 1:
        measured_now = sum(1 for t in trials if not t.oom)
        fit = _fit_near_boundary(trials)
        # A prediction needs a measurement it has not used yet: after a missed prediction that
        # ended in an OOM the line is unchanged and would only point at the same place again.
        if fit is not None and predicted < MAX_PREDICTED_TRIALS and measured_now > measured_at_last_prediction:
            predicted += 1
            measured_at_last_prediction = measured_now
            guess = micro_batch_for_limit(fit, limit_bytes, cap=max_micro_batch) // multiple_of
            if hi > top and guess > FAR_EXTRAPOLATION * lo:
                # Peak memory is a maximum of affine phases, so convex in m: a chord from small m
                # underestimates the slope further out and overshoots. Land short of the line
                # first; the point it measures near the boundary makes the next line close to exact.
                guess = lo + int(APPROACH_FRACTION * (guess - lo))
            # Clamping to the open interval turns a confirmed prediction into its verification
            # one step past it.
            k = min(max(guess, lo + 1), hi - 1)
        elif hi > top:
            k = min(top, 2 * lo)  # no miss seen yet: gallop
        else:
            k = (lo + hi) // 2
        if run(k):
            lo = k
        else:
            hi = k
    return SearchResult(max_micro_batch=lo * multiple_of, trials=trials, fit=fit_affine(_affine_points(trials)))
