"""The sequence-length view of a datasheet: a sequence-aware profile among its sibling lengths.

A probe over lengths (``autotune probe --seq-len 128,256,512``) stores one profile per length under
one fingerprint, each carrying the same peak surface over (m, L) (autotune/core/surface.py). A datasheet
of such a profile shows:

- the lengths of its fingerprint (every stored profile with a ``seq_len``, linked by id);
- one chart, ``chart-lengths``: m_max and tokens per micro-batch (m_max × L) against L. The
  measured lengths are points (their profiles' ``max_micro_batch``), the surface is a line (m_max
  read off it at the profile's own limit, budget × (1 − headroom), over the lengths it covers, as
  ``/suggest`` reads it: ``sequence.surface_max``), and the longest length at m = multiple_of is
  marked.

Only the siblings that the line describes are drawn as points: the same surface, limit, caps, device
model and source. Others of the fingerprint (another budget, another device) are listed, not drawn:
their m_max answers another limit.

    view = length_view(session, row, profile)      # None for a profile without seq_len
    view.figures["chart-lengths"], view.siblings
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from autotune.core.schemas import Profile, Surface
from autotune.core.surface import PeakSurface
from autotune_server.models import ProfileRow
from autotune_server.repository import to_utc

__all__ = [
    "CHART_ID",
    "LINE_POINTS",
    "MAX_STEPS",
    "MAX_STEP_WORK",
    "MAX_SIBLINGS",
    "LengthSibling",
    "LengthView",
    "length_siblings",
    "length_view",
    "lengths_figure",
    "surface_line",
]

CHART_ID = "chart-lengths"
# The surface line is exact (each step of m_max's staircase) up to this many steps; past it, it is
# read at LINE_POINTS lengths: enough for a smooth line, few enough for a small page.
MAX_STEPS = 400
# ...and while steps x pieces stays under this (each step is a bisection over every piece): the line
# takes at most ~0.1 s (a loaded 2-core machine), even for the most pieces a surface may carry.
MAX_STEP_WORK = 4_000
LINE_POINTS = 80
# A fingerprint probed at more lengths than this lists its newest; no real sweep comes near it.
MAX_SIBLINGS = 200
_M_COLOR = "#1f6fb2"
_TOKENS_COLOR = "#15803d"
_LONGEST_COLOR = "#c0262d"
_LIMITED_BY = {
    "memory": "the next length does not fit",
    "cap": "the cap of the search (--max-seq-len) was reached: longer may fit",
    "model": "the model refused the next length",
}


@dataclass(frozen=True)
class LengthSibling:
    """A profile of the same fingerprint at some length, as the datasheet lists it."""

    id: int
    seq_len: int
    max_micro_batch: int
    device_name: str
    budget_bytes: int
    headroom: float
    source: str
    created_at: datetime
    # Measured under the same surface, limit, caps, device model and source: drawn on the chart.
    on_chart: bool
    # The profile whose datasheet this is.
    current: bool

    @property
    def tokens_per_micro_batch(self) -> int:
        """m_max × L."""
        return self.max_micro_batch * self.seq_len


@dataclass(frozen=True)
class LengthView:
    """What the datasheet of a sequence-aware profile adds: its siblings, its surface, the chart."""

    seq_len: int
    surface: Surface | None
    siblings: list[LengthSibling]
    figures: dict[str, dict[str, Any]]

    @property
    def on_chart(self) -> list[LengthSibling]:
        """The siblings drawn as points (this profile among them)."""
        return [s for s in self.siblings if s.on_chart]


# What a point on the chart must share with the profile: the line is m_max at its limit under its
# caps, so a sibling belongs on it only if it answers the same question from the same surface.
_SETUP_COLUMNS = (
    ProfileRow.device_name,
    ProfileRow.budget_bytes,
    ProfileRow.headroom,
    ProfileRow.multiple_of,
    ProfileRow.micro_batch_cap,
    ProfileRow.source,
    ProfileRow.strategy,
    ProfileRow.world_size,
    ProfileRow.activation_checkpointing,
    ProfileRow.surface,
)


def _setup(row: Any) -> tuple[Any, ...]:
    return tuple(getattr(row, column.key) for column in _SETUP_COLUMNS)


def length_siblings(session: Session, row: ProfileRow) -> list[LengthSibling]:
    """Every profile of row's fingerprint that has a length (row itself included), by length, then
    newest first; at most :data:`MAX_SIBLINGS` (the newest). Reads columns only, never a stored
    document or trials."""
    query = (
        select(ProfileRow.id, ProfileRow.seq_len, ProfileRow.max_micro_batch, ProfileRow.created_at, *_SETUP_COLUMNS)
        .where(ProfileRow.fingerprint == row.fingerprint, ProfileRow.seq_len.is_not(None))
        .order_by(ProfileRow.created_at.desc(), ProfileRow.id.desc())
        .limit(MAX_SIBLINGS)
    )
    found: list[Any] = list(session.execute(query))
    if all(other.id != row.id for other in found):
        found.append(row)
    setup = _setup(row)
    siblings = [
        LengthSibling(
            id=int(other.id),
            seq_len=int(other.seq_len or 0),
            max_micro_batch=int(other.max_micro_batch),
            device_name=other.device_name,
            budget_bytes=int(other.budget_bytes),
            headroom=float(other.headroom),
            source=other.source,
            created_at=to_utc(other.created_at),
            on_chart=other.id == row.id or _setup(other) == setup,
            current=other.id == row.id,
        )
        for other in found
    ]
    # Stable sort: within a length the query's order (newest first) stays.
    return sorted(siblings, key=lambda s: s.seq_len)


def _line_lengths(low: int, high: int, extra: list[int], points: int) -> list[int]:
    """Integer lengths from low to high, spaced evenly on a log scale, with ``extra`` (those within)."""
    if high <= low:
        return [low]
    ratio = high / low
    spaced = {round(low * ratio ** (i / (points - 1))) for i in range(points)}
    return sorted({low, high, *spaced, *(length for length in extra if low <= length <= high)})


def surface_line(profile: Profile, points: int = LINE_POINTS) -> list[tuple[int, int]]:
    """(L, m_max) read off the profile's surface at its own limit, over the lengths it covers.

    m_max is a staircase in L: where it takes at most :data:`MAX_STEPS` values (and steps x pieces
    is at most :data:`MAX_STEP_WORK`), the line is exact,
    the first and last length of each step (found by bisection on the surface, so that m x L is an
    exact sawtooth rather than one sampled); otherwise it is read at ``points`` lengths spaced
    evenly on a log scale, the measured lengths and the longest length among them. The offset
    (what the device's real trials showed above the fake surface) is taken off the limit, as
    ``/suggest`` does (``sequence.surface_max``). Lengths where not even multiple_of fits are left
    out. Empty for a profile without a surface.
    """
    if profile.surface is None:
        return []
    surface = profile.surface
    peak = PeakSurface.from_dict(surface.model_dump())
    limit = profile.limit_bytes - surface.offset_bytes
    low, high = surface.covered
    step = profile.multiple_of

    def m_max(length: int) -> int:
        return peak.max_fitting(limit, length, cap=profile.micro_batch_cap, multiple_of=step)

    top, bottom = m_max(low), max(m_max(high), step)
    if top == 0:
        return []
    steps = (top - bottom) // step + 1
    if steps > MAX_STEPS or steps * len(peak.pieces) > MAX_STEP_WORK:
        extra = [*surface.measured_lengths, *([surface.longest.seq_len] if surface.longest else [])]
        return [(length, m) for length in _line_lengths(low, high, extra, points) if (m := m_max(length)) > 0]
    line: list[tuple[int, int]] = []
    first = low
    for m in range(top, bottom - 1, -step):
        # Every length from first to last fits m (peaks grow with L); m + step stopped fitting at first.
        last = peak.longest_fitting(limit, m, cap=high, shortest=first)
        if last == 0:
            continue  # m_max skipped this value
        line.extend([(first, m), (last, m)] if last > first else [(first, m)])
        if last == high:
            break
        first = last + 1
    return line


def _tokens(value: int) -> str:
    return f"{value:,}"


def _x_axis(lengths: list[int]) -> dict[str, Any]:
    low, high = min(lengths), max(lengths)
    axis: dict[str, Any] = {"title": {"text": "sequence length L (tokens)"}, "zeroline": False}
    if high < 4 * low:
        axis["rangemode"] = "tozero"
        return axis
    # Lengths are chosen in powers of two and span decades: a log axis ticked at powers of two.
    first, last = math.ceil(math.log2(low)), math.floor(math.log2(high))
    ticks = [2**k for k in range(first, last + 1)]
    axis["type"] = "log"
    axis["range"] = [math.log10(low) - 0.05, math.log10(high) + 0.05]
    if 2 <= len(ticks) <= 16:
        axis["tickvals"] = ticks
        axis["ticktext"] = [_tokens(t) for t in ticks]
    return axis


def lengths_figure(profile: Profile, siblings: list[LengthSibling]) -> dict[str, Any]:
    """The Plotly figure of m_max and tokens per micro-batch against L (see the module docstring).

    Traces, by ``meta``: ``surface-m-max`` and ``surface-tokens`` (the surface's lines, tokens on
    the right axis), ``measured-m-max`` and ``measured-tokens`` (one point per sibling on the
    chart), ``longest`` (the longest length at m = multiple_of). No stored text goes into it.
    """
    points = [s for s in siblings if s.on_chart]
    line = surface_line(profile)
    # The lines go under the points. The staircase has corners only where m_max changes, so a
    # measured point is nearer than any of the line's corners and Plotly's hover names the point.
    lines: list[dict[str, Any]] = []
    if line:
        xs = [length for length, _ in line]
        ms = [m for _, m in line]
        tokens = [m * length for length, m in line]
        lines.append(
            {
                "type": "scatter",
                "mode": "lines",
                "meta": "surface-m-max",
                "name": "m max (surface)",
                "x": xs,
                "y": ms,
                "customdata": [[_tokens(t)] for t in tokens],
                "hovertemplate": "L = %{x}<br>m max %{y} by the surface (%{customdata[0]} tokens)<extra></extra>",
                "line": {"color": _M_COLOR, "width": 2},
            }
        )
        lines.append(
            {
                "type": "scatter",
                "mode": "lines",
                "meta": "surface-tokens",
                "name": "tokens per micro-batch (surface)",
                "x": xs,
                "y": tokens,
                "yaxis": "y2",
                "customdata": [[m] for m in ms],
                "hovertemplate": "L = %{x}<br>%{y:,} tokens = %{customdata[0]} × L by the surface<extra></extra>",
                "line": {"color": _TOKENS_COLOR, "width": 2, "dash": "dot"},
            }
        )
    traces: list[dict[str, Any]] = list(lines)
    sizes = [14 if s.current else 10 for s in points]
    labels = [
        [f"profile {s.id}" + (" (this one)" if s.current else ""), _tokens(s.tokens_per_micro_batch)] for s in points
    ]
    traces.append(
        {
            "type": "scatter",
            "mode": "markers",
            "meta": "measured-m-max",
            "name": "m max (measured)",
            "x": [s.seq_len for s in points],
            "y": [s.max_micro_batch for s in points],
            "customdata": labels,
            "hovertemplate": "L = %{x}<br>m max %{y}, %{customdata[1]} tokens<br>%{customdata[0]}<extra></extra>",
            "marker": {
                "color": _M_COLOR,
                "size": sizes,
                "symbol": "circle",
                "line": {"color": "#12263a", "width": 1.5},
            },
        }
    )
    traces.append(
        {
            "type": "scatter",
            "mode": "markers",
            "meta": "measured-tokens",
            "name": "tokens per micro-batch (measured)",
            "x": [s.seq_len for s in points],
            "y": [s.tokens_per_micro_batch for s in points],
            "yaxis": "y2",
            "customdata": labels,
            "hovertemplate": "L = %{x}<br>%{customdata[1]} tokens (m max %{text})<br>%{customdata[0]}<extra></extra>",
            "text": [str(s.max_micro_batch) for s in points],
            "marker": {
                "color": _TOKENS_COLOR,
                "size": sizes,
                "symbol": "square",
                "line": {"color": "#12263a", "width": 1.5},
            },
        }
    )
    longest = profile.surface.longest if profile.surface is not None else None
    if longest is not None:
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "meta": "longest",
                "name": f"longest L at m = {longest.micro_batch}",
                "x": [longest.seq_len],
                "y": [longest.micro_batch],
                "customdata": [[_tokens(longest.seq_len * longest.micro_batch), _LIMITED_BY[longest.limited_by]]],
                "hovertemplate": "longest L = %{x} at m = %{y} (%{customdata[0]} tokens)<br>%{customdata[1]}"
                "<extra></extra>",
                "marker": {
                    "color": _LONGEST_COLOR,
                    "size": 15,
                    "symbol": "star",
                    "line": {"color": "#fff", "width": 1},
                },
            }
        )
    lengths = [*(x for x, _ in line), *(s.seq_len for s in points), *([longest.seq_len] if longest else [])]
    top_m = max([1, *(m for _, m in line), *(s.max_micro_batch for s in points)])
    top_tokens = max([1, *(m * x for x, m in line), *(s.tokens_per_micro_batch for s in points)])
    layout = {
        "margin": {"l": 70, "r": 80, "t": 10, "b": 50},
        "xaxis": _x_axis(lengths),
        # m_max starts where tokens per micro-batch start (both at the shortest length): the tokens
        # axis reaches higher, so that the two do not start on the same spot.
        "yaxis": {
            "title": {"text": "m max (sequences per micro-batch)"},
            "range": [0, top_m * 1.08],
            "color": _M_COLOR,
        },
        "yaxis2": {
            "title": {"text": "tokens per micro-batch (m max × L)"},
            "overlaying": "y",
            "side": "right",
            "range": [0, top_tokens * 1.3],
            "showgrid": False,
            # Its own round ticks, not ticks synchronized with the left axis' grid.
            "tickmode": "auto",
            "zeroline": False,
            "tickformat": ",d",
            "color": _TOKENS_COLOR,
        },
        "legend": {"orientation": "h", "y": -0.22},
        "hovermode": "closest",
    }
    return {"data": traces, "layout": layout, "config": {"responsive": True, "displaylogo": False}}


def length_view(session: Session, row: ProfileRow, profile: Profile) -> LengthView | None:
    """The sequence-length part of a datasheet, or None for a profile without a length."""
    if profile.seq_len is None:
        return None
    siblings = length_siblings(session, row)
    return LengthView(
        seq_len=profile.seq_len,
        surface=profile.surface,
        siblings=siblings,
        figures={CHART_ID: lengths_figure(profile, siblings)},
    )
