"""What the three readers share: what they are told beside the file, what counts as a key being set, the refusal of
keys autotune cannot express, and the world size a file leaves to its launcher. Torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.cli.recipes.job import RecipeError, Settings, positive_int_value

__all__ = ["ReadContext", "is_set", "note_mesh", "refuse_when_set"]


@dataclass(frozen=True)
class ReadContext:
    """What a reader is told beside the file: ``--model`` (the model config, overriding the file's), ``--world-size``
    where the user gave it (the launcher's ranks, which most files leave out), and every flag the user gave."""

    model: str | None = None
    world_size: int | None = None
    given: frozenset[str] = frozenset()


def is_set(value: object) -> bool:
    """Whether a key's value sets something: anything but none, false and empty (0 is a value)."""
    return value is not None and value is not False and value not in ("", [], {})


def refuse_when_set(path: Path, data: Mapping[str, Any], refused: Mapping[str, str], *, where: str = "") -> None:
    """Refuse the first key of ``refused`` that data sets, with its reason.

    Raises:
        RecipeError: ``FILE: KEY is set: WHY``.
    """
    for key, why in refused.items():
        if key in data and is_set(data[key]):
            raise RecipeError(f"{path}: {where}{key} is set: {why}")


def note_mesh(
    path: Path,
    settings: Settings,
    notes: list[str],
    *,
    named: int | None,
    given: int | None,
    least: int,
    named_by: str,
    launcher: str,
) -> int:
    """The world size W the job runs on, set as ``--world-size`` (the file's: ``named``, the product of its degrees,
    where it names them; else ``least``, the ranks its model-parallel degrees need, with a note that the launcher
    decides); ``given`` (the user's ``--world-size``) where there is one, which the batch is counted over.

    Raises:
        RecipeError: a world size that the model-parallel degrees do not divide.
    """
    world = named if named is not None else least
    if named is None:
        notes.append(
            f"the ranks are the launcher's ({launcher}), which the file does not say: read as {world}"
            + ("" if given is not None else "; give --world-size N for another")
        )
    if world != 1:
        settings.set("--world-size", world, *([named_by] if named is not None else []))
    effective = given if given is not None else world
    if effective % least:
        raise RecipeError(
            f"{path}: {effective} ranks are not a multiple of the {least} its model-parallel and replica degrees take"
        )
    return effective


def data_parallel_of(
    path: Path,
    settings: Settings,
    notes: list[str],
    degrees: Mapping[str, Any],
    *,
    given: int | None,
    named_by: str,
    launcher: str,
) -> int:
    """The data-parallel replicas D of a file that names its mesh as accelerate's ParallelismConfig does
    (``dp_shard_size`` x ``dp_replicate_size``, with the ``--tp`` and ``--cp`` read already): the world size
    :func:`note_mesh` sets, over the model-parallel ranks."""
    tp, cp = int(settings.get("--tp") or 1), int(settings.get("--cp") or 1)
    replicate = positive_int_value(path, "dp_replicate_size", degrees.get("dp_replicate_size") or 1)
    named = None
    if is_set(degrees.get("dp_shard_size")):
        named = positive_int_value(path, "dp_shard_size", degrees["dp_shard_size"]) * replicate * tp * cp
    least = replicate * tp * cp
    world = note_mesh(
        path, settings, notes, named=named, given=given, least=least, named_by=named_by, launcher=launcher
    )
    return world // (tp * cp)
