"""Bytes as people read them, for the dashboard and the answers' notes.

The server loads only the parts of ``autotune.core`` it needs (``tests/server/test_no_torch.py`` lists
them, and ``autotune.core.units`` is not one), so this is its copy of ``format_bytes``, held to it by
``tests/server/test_pages.py``.
"""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(value: float | None) -> str:
    """Bytes in binary units, as ``autotune.core.units.format_bytes`` writes them: 1536 -> '1.50 KiB'."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TiB"
