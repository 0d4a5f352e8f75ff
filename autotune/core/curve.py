"""The whole peak-memory curve from two traced trials. Pure arithmetic, no torch.

A trial's live bytes, read after every storage the meter counts, form a trace; the peak is its
maximum. Two trials of the same job at micro-batches ``low`` and ``high`` run the same ops in the same
order, and every tensor's size is affine in m (its batch dimension), so each point of the trace is
affine in m too: point k holds ``at_low[k] + (m - low) x (at_high[k] - at_low[k]) / (high - low)``
bytes at m. The peak at any m is the largest of these lines, a convex piecewise-affine curve, and
the largest m under a limit follows without another trial:

    >>> curve = PeakCurve.from_traces(2, [100, 300, 250], 3, [100, 350, 330])
    >>> curve.peak_bytes(10)  # point 2 (80 bytes a sample) overtakes point 1 (50) past m = 4
    890
    >>> curve.max_fitting(1000, cap=4096, multiple_of=1)
    11

The assumption holds, and the curve is exact to the byte, for the examples and the transformers
models the benchmarks use (tests/autotune/test_curve.py checks the examples against real trials).
Where it does not (a model that branches on m, so the traces differ in length, or that allocates
something not affine in m), ``from_traces`` gives None or the real trials at the prediction
disagree, and the search goes on from what they show.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PeakCurve"]


@dataclass(frozen=True)
class PeakCurve:
    """Per-point lines through two traces of the same trial at micro-batches low < high."""

    low: int
    high: int
    at_low: tuple[int, ...]
    at_high: tuple[int, ...]

    @classmethod
    def from_traces(cls, low: int, trace_low: Sequence[int], high: int, trace_high: Sequence[int]) -> PeakCurve | None:
        """The curve, or None where the traces cannot be lined up (different lengths: the trial ran
        different ops at the two sizes)."""
        if not 0 < low < high or not trace_low or len(trace_low) != len(trace_high):
            return None
        return cls(low=low, high=high, at_low=tuple(trace_low), at_high=tuple(trace_high))

    def peak_bytes(self, micro_batch: int) -> int:
        """The predicted peak at micro_batch (rounded down where a line falls between bytes)."""
        span = self.high - self.low
        steps = micro_batch - self.low
        return max((a * span + steps * (b - a)) // span for a, b in zip(self.at_low, self.at_high, strict=True))

    def max_fitting(self, limit_bytes: int, *, cap: int, multiple_of: int = 1) -> int:
        """The largest m (a multiple of multiple_of, at most cap) predicted to peak at or under
        limit_bytes, or 0 where even ``high`` does not (the curve then predicts nothing above it).

        Points whose bytes do not grow with m never decide it above ``high``: they are at most what
        they were there, which fits. Every growing point k allows m up to
        ``low + (limit - at_low[k]) x (high - low) / (at_high[k] - at_low[k])``.
        """
        if self.peak_bytes(self.high) > limit_bytes:
            return 0
        span = self.high - self.low
        largest = cap
        for a, b in zip(self.at_low, self.at_high, strict=True):
            if b > a:
                largest = min(largest, self.low + (limit_bytes - a) * span // (b - a))
        return largest // multiple_of * multiple_of
