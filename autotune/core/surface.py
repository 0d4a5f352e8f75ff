"""The peak-memory surface over micro-batch m and sequence length L, from six traced trials. Pure
arithmetic, no torch (the server imports it to answer lengths nobody measured).

The curve of ``curve.py`` generalized: a trial's trace (live bytes after every storage the meter
counts) runs the same ops in the same order at every (m, L), and every tensor's size is a polynomial
in the terms 1, m, L, m·L, L², m·L² (weights; the batch's activations; position tables; the
activations of linear layers; masks; materialized attention scores). So is every point of the
trace, and six traces, at two sizes of m and three lengths, give each point's polynomial exactly:
a line in m through the two sizes at each length, then a parabola in L through the three lines.
The peak at any (m, L) is the largest of these polynomials.

Coefficients are kept as integers over one common denominator, so predictions are exact to the byte
where the model of memory holds:

    >>> traces = {(m, L): [1000 + 10 * m * L, 1000 + 10 * m * L + m * L * L] for m in (2, 3) for L in (8, 16, 32)}
    >>> surface = PeakSurface.from_traces(traces)
    >>> surface.peak_bytes(5, 64)  # 1000 + 10 x 5 x 64 + 5 x 64 x 64
    24680
    >>> surface.max_fitting(24680, 64, cap=4096)
    5
    >>> surface.longest_fitting(24680, 5, cap=1000)
    64

Where the model does not hold (a kernel chosen by size, a model that branches on L), the traces do
not line up, a held-out trace disagrees with the prediction (``predicts``), or the real trials at
the answers disagree; the probe then falls back per length.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = ["TERMS", "PeakSurface"]

# The terms of each point's polynomial, in the order of a piece's coefficients.
TERMS = ("1", "m", "L", "m*L", "L^2", "m*L^2")

Piece = tuple[int, int, int, int, int, int]


def _lagrange_basis(lengths: Sequence[int]) -> list[tuple[Fraction, Fraction, Fraction]]:
    """For each length L_j, the coefficients (of 1, L, L²) of the parabola that is 1 at L_j and 0 at
    the other two lengths."""
    basis = []
    for j, at in enumerate(lengths):
        a, b = (length for i, length in enumerate(lengths) if i != j)
        scale = Fraction(1, (at - a) * (at - b))
        basis.append((a * b * scale, -(a + b) * scale, scale))
    return basis


@dataclass(frozen=True)
class PeakSurface:
    """peak(m, L) = max over pieces of (c · (1, m, L, mL, L², mL²)) // denominator.

    ``sizes`` and ``lengths`` are the traced micro-batches and lengths the pieces came from.
    """

    denominator: int
    pieces: tuple[Piece, ...]
    sizes: tuple[int, int]
    lengths: tuple[int, int, int]

    @classmethod
    def from_traces(cls, traces: Mapping[tuple[int, int], Sequence[int]]) -> PeakSurface | None:
        """The surface through traces at (m, L) for two sizes and three lengths, or None where there
        are not exactly those six or they cannot be lined up (different lengths of trace: the trial
        ran different ops at different sizes)."""
        sizes = sorted({m for m, _ in traces})
        lengths = sorted({length for _, length in traces})
        if len(sizes) != 2 or len(lengths) != 3 or len(traces) != 6 or min(sizes) < 1 or min(lengths) < 1:
            return None
        counts = {len(trace) for trace in traces.values()}
        if len(counts) != 1 or 0 in counts:
            return None
        m1, m2 = sizes
        span = m2 - m1
        basis = _lagrange_basis(lengths)
        denominator = span * math.lcm(*(b[2].denominator for b in basis))
        # weight[j][c]: the integer multiplier of length j's line for coefficient c (of 1, L, L²).
        weights = [[int(coef * denominator) // span for coef in b] for b in basis]
        pieces: list[Piece] = []
        for point in zip(*(traces[(m, length)] for length in lengths for m in (m1, m2)), strict=True):
            # point: (v(m1, L1), v(m2, L1), v(m1, L2), ...); the line at L_j is (alpha + beta m) / span.
            alphas = [point[2 * j] * m2 - point[2 * j + 1] * m1 for j in range(3)]
            betas = [point[2 * j + 1] - point[2 * j] for j in range(3)]
            const = [sum(alphas[j] * weights[j][c] for j in range(3)) for c in range(3)]
            slope = [sum(betas[j] * weights[j][c] for j in range(3)) for c in range(3)]
            pieces.append((const[0], slope[0], const[1], slope[1], const[2], slope[2]))
        return cls(
            denominator=denominator,
            pieces=tuple(pieces),
            sizes=(m1, m2),
            lengths=(lengths[0], lengths[1], lengths[2]),
        )

    def _lines(self, seq_len: int) -> list[tuple[int, int]]:
        """Each piece at seq_len as a line in m: (constant, slope), over the denominator."""
        sq = seq_len * seq_len
        return [(c[0] + c[2] * seq_len + c[4] * sq, c[1] + c[3] * seq_len + c[5] * sq) for c in self.pieces]

    def peak_bytes(self, micro_batch: int, seq_len: int) -> int:
        """The predicted peak at (micro_batch, seq_len), rounded down where it falls between bytes."""
        return max(a + b * micro_batch for a, b in self._lines(seq_len)) // self.denominator

    def trace(self, micro_batch: int, seq_len: int) -> list[int]:
        """The predicted trace at (micro_batch, seq_len), point by point (only for an unpruned surface)."""
        return [(a + b * micro_batch) // self.denominator for a, b in self._lines(seq_len)]

    def predicts(self, micro_batch: int, seq_len: int, trace: Sequence[int]) -> bool:
        """Whether a held-out trace at (micro_batch, seq_len) is what the surface predicts, point by point."""
        return len(trace) == len(self.pieces) and self.trace(micro_batch, seq_len) == list(trace)

    def max_fitting(self, limit_bytes: int, seq_len: int, *, cap: int, multiple_of: int = 1) -> int:
        """The largest m (a multiple of multiple_of, at most cap) predicted to peak at or under
        limit_bytes at seq_len, or 0 where even multiple_of is not.

        A piece that grows with m allows m up to where its line reaches the limit; a piece that does
        not grow is at most what it is at m = multiple_of.
        """
        # floor(x / d) <= limit  <=>  x <= (limit + 1) d - 1
        bound = (limit_bytes + 1) * self.denominator - 1
        lines = self._lines(seq_len)
        if max(a + b * multiple_of for a, b in lines) > bound:
            return 0
        largest = cap
        for a, b in lines:
            if b > 0:
                largest = min(largest, (bound - a) // b)
        return largest // multiple_of * multiple_of

    def longest_fitting(self, limit_bytes: int, micro_batch: int, *, cap: int, shortest: int = 1) -> int:
        """The largest L in [shortest, cap] such that every length from shortest to L is predicted to
        fit at micro_batch, or 0 where shortest does not. Peaks grow with L, so this is a bisection."""
        if self.peak_bytes(micro_batch, shortest) > limit_bytes:
            return 0
        lo, hi = shortest, cap + 1  # lo fits; hi is past the cap or predicted not to fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.peak_bytes(micro_batch, mid) <= limit_bytes:
                lo = mid
            else:
                hi = mid
        return lo

    def pruned(self, micro_batch_cap: int, lengths: Iterable[int]) -> PeakSurface:
        """The same surface with only the pieces that are the largest somewhere in m in [1, cap] at
        one of ``lengths``: a trace has thousands of points, and a handful decide the peak (what the
        store keeps). Exact at the given lengths; between them it assumes the same pieces lead."""
        keep: set[int] = set()
        for seq_len in lengths:
            keep.update(_upper_envelope(self._lines(seq_len), 1, micro_batch_cap))
        return PeakSurface(
            denominator=self.denominator,
            pieces=tuple(p for i, p in enumerate(self.pieces) if i in keep),
            sizes=self.sizes,
            lengths=self.lengths,
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (integers may exceed 64 bits: JSON keeps them exact)."""
        return {
            "denominator": self.denominator,
            "pieces": [list(p) for p in self.pieces],
            "sizes": list(self.sizes),
            "lengths": list(self.lengths),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PeakSurface:
        pieces = tuple(tuple(int(c) for c in p) for p in data["pieces"])
        if any(len(p) != len(TERMS) for p in pieces) or not pieces:
            raise ValueError(f"a surface piece has {len(TERMS)} coefficients ({', '.join(TERMS)})")
        denominator = int(data["denominator"])
        if denominator <= 0:
            raise ValueError("a surface's denominator is positive")
        sizes = tuple(int(m) for m in data["sizes"])
        lengths = tuple(int(length) for length in data["lengths"])
        return cls(
            denominator=denominator,
            pieces=pieces,  # type: ignore[arg-type]
            sizes=(sizes[0], sizes[1]),
            lengths=(lengths[0], lengths[1], lengths[2]),
        )


def _upper_envelope(lines: Sequence[tuple[int, int]], low: int, high: int) -> set[int]:
    """Indices of the lines (a + b m) that are the largest at some m in [low, high]."""
    # The largest constant among equal slopes; then, by slope, the convex hull from above.
    best: dict[int, int] = {}
    for i, (a, b) in enumerate(lines):
        if b not in best or a > lines[best[b]][0]:
            best[b] = i
    order = sorted(best.values(), key=lambda i: lines[i][1])
    hull: list[int] = []
    for i in order:
        a3, b3 = lines[i]
        while len(hull) >= 2:
            a1, b1 = lines[hull[-2]]
            a2, b2 = lines[hull[-1]]
            # Line 2 is nowhere above both when line 3 overtakes line 1 no later than line 2 does.
            if (a1 - a3) * (b2 - b1) <= (a1 - a2) * (b3 - b1):
                hull.pop()
            else:
                break
        hull.append(i)
    # The hull's line k leads on [x_k, x_{k+1}]; keep those whose stretch meets [low, high].
    kept: set[int] = set()
    for k, i in enumerate(hull):
        a, b = lines[i]
        start = -math.inf if k == 0 else Fraction(lines[hull[k - 1]][0] - a, b - lines[hull[k - 1]][1])
        end = math.inf if k == len(hull) - 1 else Fraction(a - lines[hull[k + 1]][0], lines[hull[k + 1]][1] - b)
        if start <= high and end >= low:
            kept.add(i)
    return kept
