"""Where a profile's memory goes, drawn as SVG on the server (no script needed to read it): the peak of m_max and of
the size above it as stacked bars by what holds it, and each trial's step as a stacked area over its allocations
with the peak marked (autotune/measure/breakdown.py records them; autotune/core/schemas.py: MemoryBreakdown).

Torch-free, as the whole server is. Every text that comes from the profile is escaped.
"""

from __future__ import annotations

from html import escape

from autotune.core.schemas import MEMORY_PART_LABELS, MEMORY_PARTS, MemoryBreakdown, Profile
from autotune.core.units import format_bytes

__all__ = ["PART_COLOURS", "breakdown_bars", "breakdown_rows", "size_label", "timeline_svg"]

PART_COLOURS = {
    "trainable_parameters": "#1f77b4",
    "frozen_parameters": "#aec7e8",
    "buffers": "#7f7f7f",
    "gradients": "#ff7f0e",
    "optimizer_state": "#2ca02c",
    "activations": "#d62728",
    "inputs": "#9467bd",
    "temporaries": "#e7ba52",
    "collectives": "#17becf",
    "allocator_reserve": "#bcbd22",
    "outside_allocator": "#8c564b",
}
_WIDTH = 640
_BAR_HEIGHT = 26


def size_label(breakdown: MemoryBreakdown) -> str:
    """What a breakdown is of: its micro-batch, and a pipeline's most loaded stage (whose peak it is)."""
    stage = "" if breakdown.stage is None else f", stage {breakdown.stage}"
    return f"m = {breakdown.micro_batch}{stage}"


def breakdown_rows(profile: Profile) -> list[tuple[str, str, str, list[int]]]:
    """The table beside the bars: (part, label, colour, bytes at each broken-down size) for every part that holds
    bytes at one of them, in MEMORY_PARTS' order."""
    return _rows([b.parts for b in profile.breakdown or []])


def host_rows(profile: Profile) -> list[tuple[str, str, str, list[int]]]:
    """Under --offload, the host's peak in the same trials by part (rows as :func:`breakdown_rows`'); none without."""
    return _rows([b.host_parts or {} for b in profile.breakdown or []])


def _rows(parts_by_size: list[dict[str, int]]) -> list[tuple[str, str, str, list[int]]]:
    rows = []
    for part in MEMORY_PARTS:
        cells = [parts.get(part, 0) for parts in parts_by_size]
        if any(cells):
            rows.append((part, MEMORY_PART_LABELS[part], PART_COLOURS[part], cells))
    return rows


def breakdown_bars(profile: Profile) -> str:
    """One stacked bar per broken-down size (m_max, the size above it), on one scale (the larger peak), the
    budget's limit as a line; each segment titled with its part, bytes and share. "" without a breakdown."""
    breakdowns = profile.breakdown or []
    if not breakdowns:
        return ""
    # Room for the longest label ("m = 12, stage 3 (does not fit)"), about 7 px a character at the labels' size.
    longest = max(len(f"{size_label(b)} (does not fit)") for b in breakdowns)
    label_width = left = max(150, 7 * longest + 8)
    span = _WIDTH - left - 90  # room on the right for the largest bar's total
    scale = max(max(b.peak_bytes for b in breakdowns), profile.limit_bytes) or 1
    height = 20 + len(breakdowns) * (_BAR_HEIGHT + 14) + 24
    parts_svg: list[str] = []
    for row, breakdown in enumerate(breakdowns):
        y = 20 + row * (_BAR_HEIGHT + 14)
        verdict = "fits" if breakdown.fits else "does not fit"
        parts_svg.append(
            f'<text x="{label_width - 8}" y="{y + _BAR_HEIGHT * 0.65:.1f}" text-anchor="end" class="bar-label">'
            f"{escape(size_label(breakdown))} ({verdict})</text>"
        )
        x = float(left)
        for part in MEMORY_PARTS:
            nbytes = breakdown.parts.get(part, 0)
            if not nbytes:
                continue
            width = span * nbytes / scale
            share = 100 * nbytes / max(1, breakdown.peak_bytes)
            parts_svg.append(
                f'<rect class="part" data-part="{part}" data-bytes="{nbytes}" '
                f'data-micro-batch="{breakdown.micro_batch}" x="{x:.2f}" y="{y}" width="{width:.2f}" '
                f'height="{_BAR_HEIGHT}" fill="{PART_COLOURS[part]}">'
                f"<title>{escape(MEMORY_PART_LABELS[part])}: {escape(format_bytes(nbytes))} ({share:.1f}% of the peak "
                f"of m = {breakdown.micro_batch})</title></rect>"
            )
            x += width
        parts_svg.append(
            f'<text x="{x + 4:.1f}" y="{y + _BAR_HEIGHT * 0.65:.1f}" class="bar-total">'
            f"{escape(format_bytes(breakdown.peak_bytes))}</text>"
        )
    limit_x = left + span * profile.limit_bytes / scale
    parts_svg.append(
        f'<line class="limit" x1="{limit_x:.2f}" x2="{limit_x:.2f}" y1="12" y2="{height - 22}" stroke="#000" '
        f'stroke-dasharray="4 3"><title>limit {escape(format_bytes(profile.limit_bytes))}</title></line>'
        f'<text x="{limit_x:.2f}" y="{height - 8}" text-anchor="middle" class="limit-label">limit</text>'
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="breakdown-bars" viewBox="0 0 {_WIDTH} {height}" '
        f'role="img" aria-label="the peak by what holds it">{"".join(parts_svg)}</svg>'
    )


def timeline_svg(breakdown: MemoryBreakdown) -> str:
    """The step's live bytes over its allocations, stacked by part (one polygon per part that holds bytes), the
    phases shaded by name along the bottom, and the peak marked with where it happened."""
    points = breakdown.timeline
    if len(points) < 2:
        return ""
    height, top, bottom = 220, 10, 180
    last_event = max(points[-1][0], breakdown.events, 1)
    peak = max(1, max(sum(p[1:]) for p in points))

    def x_of(event: int) -> float:
        return 8 + (_WIDTH - 16) * event / last_event

    def y_of(nbytes: int) -> float:
        return bottom - (bottom - top) * nbytes / peak

    polygons: list[str] = []
    below = [0] * len(points)
    for index, part in enumerate(MEMORY_PARTS):
        values = [p[index + 1] for p in points]
        if not any(values):
            continue
        above = [b + v for b, v in zip(below, values, strict=True)]
        upper = " ".join(f"{x_of(p[0]):.2f},{y_of(a):.2f}" for p, a in zip(points, above, strict=True))
        lower = " ".join(f"{x_of(p[0]):.2f},{y_of(b):.2f}" for p, b in reversed(list(zip(points, below, strict=True))))
        polygons.append(
            f'<polygon class="area" data-part="{part}" points="{upper} {lower}" fill="{PART_COLOURS[part]}">'
            f"<title>{escape(MEMORY_PART_LABELS[part])}</title></polygon>"
        )
        below = above
    phases = breakdown.phases
    bands: list[str] = []
    for i, (start, name) in enumerate(phases):
        end = phases[i + 1][0] if i + 1 < len(phases) else last_event
        bands.append(
            f'<rect class="phase" data-phase="{name}" x="{x_of(start):.2f}" y="{bottom + 6}" '
            f'width="{max(0.5, x_of(end) - x_of(start)):.2f}" height="10" fill="{_PHASE_SHADES[name]}">'
            f"<title>{name}</title></rect>"
        )
    peak_x = x_of(breakdown.peak_event)
    marker = (
        f'<line class="peak" x1="{peak_x:.2f}" x2="{peak_x:.2f}" y1="{top}" y2="{bottom}" stroke="#000">'
        f"<title>peak {escape(format_bytes(breakdown.peak_bytes))} at {escape(breakdown.peak_where)}</title></line>"
        f'<text class="peak-label" x="{peak_x:.2f}" y="{height - 8}" '
        f'text-anchor="{"end" if peak_x > _WIDTH / 2 else "start"}">'
        f"peak {escape(format_bytes(breakdown.peak_bytes))}: {escape(breakdown.peak_where)}</text>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" data-micro-batch="{breakdown.micro_batch}" '
        f'viewBox="0 0 {_WIDTH} {height}" role="img" aria-label="live bytes over the step">'
        f"{''.join(polygons)}{''.join(bands)}{marker}</svg>"
    )


_PHASE_SHADES = {"model": "#ddd", "inputs": "#c5b0d5", "forward": "#9edae5", "backward": "#f7b6d2", "step": "#98df8a"}
