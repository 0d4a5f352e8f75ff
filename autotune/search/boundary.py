"""Find the largest micro-batch that fits, given a callable trial(m) -> Trial. Pure policy, no torch.

Memory is close to affine in m: peak(m) ~= fixed + per_sample x m. Two small sizes give a line;
the line predicts the boundary; a trial at the prediction and one step past it verifies it. Where
the prediction misses (allocator rounding, kernel workspaces) the next prediction uses the new
points, and after a few misses the search bisects the interval still open. The interval
[largest known fit, smallest known miss] shrinks with every trial, so the search always ends.

    >>> from autotune.core.schemas import Trial
    >>> def trial(m):  # fixed 100 bytes + 10 per sample, limit 400
    ...     peak = 100 + 10 * m
    ...     return Trial(micro_batch=m, peak_bytes=peak, fits=peak <= 400)
    >>> find_max_micro_batch(trial, limit_bytes=400).max_micro_batch
    30
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autotune.core.errors import AutotuneError
from autotune.core.plan import fit_affine, micro_batch_for_limit
from autotune.core.schemas import Fit, Trial

__all__ = [
    "APPROACH_FRACTION",
    "peaks_decrease",
    "FAKE_FAR_EXTRAPOLATION",
    "FAR_EXTRAPOLATION",
    "MAX_PREDICTED_TRIALS",
    "NoFitError",
    "SearchResult",
    "at_length",
    "find_max_micro_batch",
    "measured_fit",
    "reported",
]

# Trials guided by the fit before the search stops trusting it and bisects.
MAX_PREDICTED_TRIALS = 4
# A first prediction further than this many times the largest measured m is approached from below,
# at this fraction of the way (fake trials: FAKE_FAR_EXTRAPOLATION).
FAR_EXTRAPOLATION = 4
FAKE_FAR_EXTRAPOLATION = 16
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


def measured_fit(trials: list[Trial]) -> Fit | None:
    """The least-squares line through the measured trials' affine points (see _affine_points)."""
    return fit_affine(_affine_points(trials))


def _smooth_points(trials: list[Trial]) -> list[tuple[int, int]]:
    """The points that give the slope: on CUDA the allocator's allocated bytes, smooth in m where the
    reserved figure moves in steps (blocks and segments rounded); elsewhere the affine points."""
    measured = [t for t in trials if not t.oom]
    if measured and all(t.allocated_bytes is not None for t in measured):
        return sorted({t.micro_batch: int(t.allocated_bytes or 0) for t in measured}.items())
    return _affine_points(trials)


def _fit_near_boundary(trials: list[Trial]) -> Fit | None:
    """The line through the two largest measured micro-batches: the local slope."""
    measured = _affine_points(trials)
    return fit_affine(measured[-2:]) if len(measured) >= 2 else None


def _predict(trials: list[Trial], limit_bytes: int, slope: float | None, cap: int) -> int | None:
    """The largest m predicted to fit: a line through the measured trial whose peak is closest to the
    limit, with the guide's slope (the fake pre-search's, exact on the CPU) or the local slope of
    the smooth points. The anchor carries the device's full figure (on CUDA: reserved, rounded, plus
    memory outside the allocator), the slope comes from what is smooth in m."""
    measured = [t for t in trials if not t.oom]
    if not measured:
        return None
    if slope is None:
        points = _smooth_points(trials)
        if len(points) < 2:
            return None
        (m1, p1), (m2, p2) = points[-2], points[-1]
        slope = max(0.0, (p2 - p1) / (m2 - m1))
    anchor = min(measured, key=lambda t: abs(t.peak_bytes - limit_bytes))
    line = Fit(fixed_bytes=anchor.peak_bytes - slope * anchor.micro_batch, bytes_per_sample=slope)
    return micro_batch_for_limit(line, limit_bytes, cap=cap)


def peaks_decrease(trials: list[Trial]) -> tuple[Trial, Trial] | None:
    """Two real measured trials whose peak goes down as m goes up (cuDNN picks kernels and
    workspaces per shape; the allocator rounds), or None where the peak is monotone."""
    measured = sorted((t for t in trials if not t.oom and not t.fake), key=lambda t: t.micro_batch)
    highest: Trial | None = None
    for trial in measured:
        if highest is not None and trial.peak_bytes < highest.peak_bytes and trial.micro_batch > highest.micro_batch:
            return highest, trial
        if highest is None or trial.peak_bytes >= highest.peak_bytes:
            highest = trial
    return None


def at_length(on_trial: Callable[[Trial], None] | None, seq_len: int | None) -> Callable[[Trial], None] | None:
    """``on_trial`` for the trials of one length of a run over lengths: each handed on labelled with its length
    (``Trial.at_length``), so that the progress line names it; on_trial itself where there is no length."""
    if on_trial is None or seq_len is None:
        return on_trial
    report = on_trial

    def labelled(trial: Trial) -> None:
        report(trial.at_length(seq_len))

    return labelled


def reported(run: Callable[[int], Trial], on_trial: Callable[[Trial], None] | None) -> Callable[[int], Trial]:
    """``run`` as the search's trial, each result handed to ``on_trial`` (the CLI's progress line) first."""

    def trial(micro_batch: int) -> Trial:
        result = run(micro_batch)
        if on_trial is not None:
            on_trial(result)
        return result

    return trial


def find_max_micro_batch(
    trial: Callable[[int], Trial],
    *,
    limit_bytes: int,
    max_micro_batch: int = 4096,
    multiple_of: int = 1,
    hint: int | None = None,
    guide: Fit | None = None,
    far_extrapolation: float = FAR_EXTRAPOLATION,
) -> SearchResult:
    """The exact largest m (a multiple of multiple_of, at most max_micro_batch) whose trial fits.

    Exact means: trial(m) fits and trial(m + multiple_of) does not, or m is the cap. Where the peak
    is not monotone in m, it is the largest m below the smallest size measured not to fit.

    Args:
        trial: runs one measurement at m.
        limit_bytes: the peak that still fits, used to predict the boundary.
        max_micro_batch: the cap on m.
        multiple_of: every m tried is a multiple of this.
        hint: a predicted m_max (the fake pre-search's): the first trials go there and one step past
            it, and the search starts from what they show.
        guide: the pre-search's line; its slope predicts the boundary from the real trials.
        far_extrapolation: a first prediction further than this many times the largest fitting m is
            approached from below (an overshoot costs an OOM, and on a convex peak the chord
            overshoots); fake trials, whose OOMs cost nothing on the device, go further first.

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

    lo, hi = 0, top + 1  # lo fits (0: none known yet); hi is the smallest k known not to fit
    slope = guide.bytes_per_sample if guide is not None else None
    if hint is not None:
        k = min(max(hint // multiple_of, 1), top)
        if run(k):
            lo = k
            if k < top:
                if run(k + 1):
                    lo = k + 1
                else:
                    hi = k + 1
        else:
            hi = k
    if hint is None:
        if not run(1):
            raise NoFitError(trials[0], f"micro-batch {multiple_of} does not fit")
        lo = 1
        if top >= 2:
            if run(2):
                lo = 2
            else:
                hi = 2
    predicted = 0
    measured_at_last_prediction = -1
    while hi - lo > 1:
        measured_now = sum(1 for t in trials if not t.oom)
        # A prediction needs a measurement it has not used yet: after a missed prediction that
        # ended in an OOM the line is unchanged and would only point at the same place again.
        guess = None
        if predicted < MAX_PREDICTED_TRIALS and measured_now > measured_at_last_prediction:
            smooth = any(t.allocated_bytes is not None for t in trials)
            if slope is None and hint is None and not smooth:
                fit = _fit_near_boundary(trials)
                guess = micro_batch_for_limit(fit, limit_bytes, cap=max_micro_batch) if fit is not None else None
            else:
                guess = _predict(trials, limit_bytes, slope, max_micro_batch)
        if guess is not None:
            predicted += 1
            measured_at_last_prediction = measured_now
            guess //= multiple_of
            if hi > top and guess > far_extrapolation * lo:
                # Peak memory is a maximum of affine phases, so convex in m: a chord from small m
                # underestimates the slope further out and overshoots. Land short of the line
                # first; the point it measures near the boundary makes the next line close to exact.
                guess = lo + int(APPROACH_FRACTION * (guess - lo))
            # Clamping to the open interval turns a confirmed prediction into its verification
            # one step past it.
            k = min(max(guess, lo + 1), hi - 1)
        elif hi > top and lo > 0:
            k = min(top, 2 * lo)  # no miss seen yet: gallop
        else:
            k = (lo + hi) // 2
        if run(k):
            lo = k
        else:
            hi = k
    if lo == 0:  # from a hint that did not fit, down to the smallest size
        smallest = next(t for t in trials if t.micro_batch == multiple_of)
        raise NoFitError(smallest, f"micro-batch {multiple_of} does not fit")
    return SearchResult(max_micro_batch=lo * multiple_of, trials=trials, fit=measured_fit(trials))
