"""A fingerprint as people copy it: the 16-digit prefix every listing shows, resolved to the stored one.

The datasheet, ``autotune profiles ls`` and the dashboard show a fingerprint's first
``FINGERPRINT_SHOWN_CHARS`` hex digits (``autotune.core.schemas``); ``/suggest`` takes that, or any prefix of
at least as many digits, or the whole: a prefix one stored fingerprint starts with answers for that fingerprint;
one that several start with is refused naming them (as ``git`` refuses an ambiguous short hash). A fingerprint
stored whole as asked is that one, whatever longer ones start with it.
"""

from __future__ import annotations

from sqlalchemy import Connection, select

from autotune.core.schemas import FULL_FINGERPRINT_CHARS
from autotune_server.errors import DomainError
from autotune_server.models import ProfileRow

__all__ = ["AmbiguousFingerprint", "resolve_fingerprint"]

# How many of the fingerprints a prefix matches the refusal names (the rest are counted).
_NAMED = 5


class AmbiguousFingerprint(DomainError):
    """A fingerprint prefix that several stored fingerprints start with: they are named; give more digits."""

    status_code = 422
    code = "ambiguous_fingerprint"


def resolve_fingerprint(conn: Connection, text: str) -> str:
    """The stored fingerprint text names: itself where it is whole (or stored as it is), the one stored
    fingerprint it is a prefix of, or text unchanged where none starts with it (the lookup then finds nothing).

    Raises:
        AmbiguousFingerprint: text is a prefix of several stored fingerprints and none is text itself.
    """
    if len(text) >= FULL_FINGERPRINT_CHARS:
        return text
    found = list(
        conn.execute(
            select(ProfileRow.fingerprint)
            .where(ProfileRow.fingerprint.startswith(text, autoescape=True))
            .distinct()
            .order_by(ProfileRow.fingerprint)  # text itself, where stored, sorts before every longer one
            .limit(_NAMED + 1)
        ).scalars()
    )
    if not found or found[0] == text:
        return text
    if len(found) == 1:
        return str(found[0])
    more = " and more" if len(found) > _NAMED else ""
    named = ", ".join(found[:_NAMED])
    raise AmbiguousFingerprint(
        f"fingerprint {text} is the start of several stored fingerprints ({named}{more}): give more of it",
        field="fingerprint",
        details={"fingerprint": text, "candidates": found[:_NAMED]},
    )
