"""Profile consistency in the store: refused on upload, checked again whenever a stored one is read.

Uploads go through :func:`require_consistent` (a 422 naming the field and the trial). Profiles
stored before the check existed, or under an older version of its rules, are checked when they
are read: ``GET /profiles/{id}`` and the dashboard serve one that fails with a warning, and
:func:`consistent_lookup` keeps it out of every /suggest answer (the next newest consistent profile
answers instead). Nothing is deleted. Stored profiles never change, so a verdict is remembered per
content hash.
"""

from __future__ import annotations

import threading
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Connection, select

from autotune.core.consistency import Problem, profile_problems
from autotune.core.schemas import Profile
from autotune_server.candidates import Lookup, lookup
from autotune_server.errors import InconsistentProfileError
from autotune_server.models import ProfileRow

__all__ = [
    "MAX_LOOKUP_ROUNDS",
    "consistent_lookup",
    "inconsistent_ids",
    "require_consistent",
    "stored_problems",
    "stored_warnings",
]

# Rounds of "look up, drop the inconsistent, look up again" before the rest are simply dropped.
MAX_LOOKUP_ROUNDS = 4
_MAX_VERDICTS = 50_000

_verdicts: dict[str, tuple[Problem, ...]] = {}
_lock = threading.Lock()


def require_consistent(profile: Profile) -> None:
    """Refuse a profile that contradicts itself.

    Raises:
        InconsistentProfileError: 422; ``field`` and the message are the first problem's (the field
            and the trial), ``details`` lists every problem as {field, message, trial, micro_batch}.
    """
    problems = profile_problems(profile)
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InconsistentProfileError(
            f"{first.field}: {first.message}{more}",
            field=first.field,
            details=[p.as_dict() for p in problems],
        )


def _check_document(document: Any) -> tuple[Problem, ...]:
    try:
        profile = Profile.model_validate(document)
    except ValidationError as exc:
        return (Problem("profile", f"the stored document no longer validates ({exc.error_count()} errors)"),)
    return tuple(profile_problems(profile))


def _remember(content_hash: str, problems: tuple[Problem, ...]) -> None:
    with _lock:
        if len(_verdicts) >= _MAX_VERDICTS:
            _verdicts.clear()
        _verdicts[content_hash] = problems


def stored_problems(row: ProfileRow) -> tuple[Problem, ...]:
    """The problems of a stored profile (none for one that passes), remembered per content hash."""
    known = _verdicts.get(row.content_hash)
    if known is None:
        known = _check_document(row.document)
        _remember(row.content_hash, known)
    return known


def stored_warnings(row: ProfileRow) -> list[str]:
    """What a reader of a stored profile is told when it fails the checks (empty when it passes)."""
    problems = stored_problems(row)
    if not problems:
        return []
    return [
        f"this stored profile contradicts itself and is never used by /suggest: {p.field}: {p.message}"
        for p in problems
    ]


def inconsistent_ids(conn: Connection, ids: set[int]) -> set[int]:
    """Which of these profile ids fail the checks (a document is read only for unknown hashes)."""
    if not ids:
        return set()
    hashes = dict(conn.execute(select(ProfileRow.id, ProfileRow.content_hash).where(ProfileRow.id.in_(ids))).all())
    unknown = {pid for pid, digest in hashes.items() if digest not in _verdicts}
    if unknown:
        for pid, document in conn.execute(
            select(ProfileRow.id, ProfileRow.document).where(ProfileRow.id.in_(unknown))
        ).all():
            _remember(hashes[pid], _check_document(document))
    return {pid for pid, digest in hashes.items() if _verdicts.get(digest, ())}


def consistent_lookup(conn: Connection, fingerprint: str, device_name: str) -> Lookup:
    """``candidates.lookup`` without the stored profiles that fail the checks.

    A newest profile that fails is passed over for the next newest; ``Lookup.skipped`` names the
    ones passed over, for the suggestion's warnings.
    """
    excluded: set[int] = set()
    found = lookup(conn, fingerprint, device_name)
    for _ in range(MAX_LOOKUP_ROUNDS):
        bad = inconsistent_ids(conn, found.ids())
        if not bad:
            return found.without(excluded=excluded)
        excluded |= bad
        found = lookup(conn, fingerprint, device_name, exclude_ids=excluded)
    # Still more inconsistent profiles than rounds: drop what is left of them from the answer.
    return found.without(excluded=excluded | inconsistent_ids(conn, found.ids()))
