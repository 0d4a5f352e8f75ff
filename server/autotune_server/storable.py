"""What pydantic accepts but a database cannot keep, refused as a 422 naming the field.

The wire schemas bound most numbers; a few values still slip through and would otherwise fail
inside the database (a 500) or come back unreadable: NUL characters (PostgreSQL text refuses them),
non-finite floats in tags (JSON has no NaN), and integers wider than their columns.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

from autotune_server.errors import UnstorableValue

__all__ = ["INT32_MAX", "INT64_MAX", "check_storable"]

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

# A surface's coefficients (autotune/core/surface.py) are integers over a common denominator, wider than
# 64 bits for long sequences; they live in a JSON column and the document, never in an integer column.
_EXACT_JSON_PATHS = ("surface.pieces.", "surface.denominator")

# Fields stored in 32-bit integer columns whose wire schema has no upper bound.
_INT32_FIELDS = frozenset({"trial_count", "oom_count"})


def _walk(value: Any, path: str) -> None:
    if isinstance(value, str):
        if "\x00" in value:
            raise UnstorableValue(f"{path}: NUL characters cannot be stored", field=path)
    elif isinstance(value, bool):
        return
    elif isinstance(value, int):
        if path.startswith(_EXACT_JSON_PATHS):
            return  # kept in a JSON column, which carries integers of any width exactly
        leaf = path.rsplit(".", 1)[-1]
        limit = INT32_MAX if leaf in _INT32_FIELDS else INT64_MAX
        if abs(value) > limit:
            raise UnstorableValue(f"{path}: {value} is out of range (at most {limit})", field=path)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise UnstorableValue(f"{path}: {value} is not a finite number", field=path)
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(key, path)
            _walk(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _walk(item, f"{path}.{index}" if path else str(index))


def check_storable(model: BaseModel) -> None:
    """Raise UnstorableValue (422, naming the field) for a value the store cannot keep as sent."""
    _walk(model.model_dump(mode="python"), "")
