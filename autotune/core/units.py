"""Byte sizes as people write them ("800MiB", "24GiB", "1.5GB") and as people read them. Torch-free."""

from __future__ import annotations

import re

__all__ = ["MAX_SIZE_BYTES", "format_bytes", "limit_bytes", "limit_bytes_unrounded", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "p": 1000**5,
    "pb": 1000**5,
    "e": 1000**6,
    "eb": 1000**6,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
    "eib": 1024**6,
}
# The largest size a profile records (autotune.core.schemas.MAX_BYTES, 1 EiB; a test holds them equal): a larger
# one is refused where it is read, not by the profile's validation after the trials.
MAX_SIZE_BYTES = 2**60
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Parse "800MiB", "24GiB", "1.5GB" or a plain number of bytes (a fraction of a byte rounds down).

    >>> parse_bytes("800MiB")
    838860800
    >>> parse_bytes("1PiB") == 2**50, parse_bytes("1EiB") == 2**60
    (True, True)
    >>> parse_bytes("0.5")
    Traceback (most recent call last):
    ...
    ValueError: size '0.5' is less than one byte: give bytes or a unit such as 800MiB, 24GiB, 1.5GB

    Raises:
        ValueError: naming the text and the rule it breaks (not a size, below one byte, above 1 EiB).
    """
    match = _PATTERN.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use bytes or a unit such as 800MiB, 24GiB, 1.5GB")
    number, scale = match.group(1), _UNITS[unit]
    # Whole numbers stay integers: float() would round 99999999999999TiB before the cap could see it.
    value = int(number) * scale if "." not in number else int(float(number) * scale)
    if value < 1:
        raise ValueError(f"size {text!r} is less than one byte: give bytes or a unit such as 800MiB, 24GiB, 1.5GB")
    if value > MAX_SIZE_BYTES:
        raise ValueError(f"size {text!r} is above 1 EiB (2**60 bytes), the largest a profile records")
    return value


def limit_bytes_unrounded(budget_bytes: float, headroom: float) -> float:
    """The largest peak that counts as fitting a budget: budget x (1 - headroom), unrounded (the server
    compares and predicts with it as it is). The one home of the headroom rule.

    >>> limit_bytes_unrounded(1000, 0.25)
    750.0
    """
    return budget_bytes * (1.0 - headroom)


def limit_bytes(budget_bytes: float, headroom: float) -> int:
    """:func:`limit_bytes_unrounded` rounded down to a whole byte: the limit a trial's peak is held to.

    >>> limit_bytes(1001, 0.1)
    900
    """
    return int(limit_bytes_unrounded(budget_bytes, headroom))


def format_bytes(value: float | None) -> str:
    """Human units, binary: 1536 -> '1.50 KiB'."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(size) < 1024 or unit == "PiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} PiB"
