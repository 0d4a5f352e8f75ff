"""A recipe file read as a job: its kind by its suffix (an Axolotl YAML, a Trainer JSON, a torchtitan TOML), parsed,
and handed to the reader of its kind. Torch-free."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.cli.recipes.axolotl import read_axolotl
from autotune.cli.recipes.job import RecipeError, RecipeJob, RecipeKind
from autotune.cli.recipes.reading import ReadContext
from autotune.cli.recipes.torchtitan import read_torchtitan
from autotune.cli.recipes.trainer import read_trainer

__all__ = ["KINDS", "kind_of", "parse_recipe", "parse_text", "read_recipe", "read_table"]

# suffix -> the kind of file it holds.
KINDS: dict[str, RecipeKind] = {".yml": "axolotl", ".yaml": "axolotl", ".json": "trainer", ".toml": "torchtitan"}
_READERS: dict[RecipeKind, Callable[[Path, dict[str, Any], ReadContext], RecipeJob]] = {
    "axolotl": read_axolotl,
    "trainer": read_trainer,
    "torchtitan": read_torchtitan,
}
_NAMES = {"axolotl": "an Axolotl config", "trainer": "a TrainingArguments JSON", "torchtitan": "a torchtitan TOML"}


def kind_of(path: Path) -> RecipeKind:
    """The kind of recipe path holds, by its suffix.

    Raises:
        RecipeError: a suffix that names no kind autotune reads.
    """
    kind = KINDS.get(path.suffix.lower())
    if kind is None:
        raise RecipeError(
            f"{path}: not a recipe autotune reads: an Axolotl config (.yml, .yaml), a Hugging Face TrainingArguments "
            "or TRL SFTConfig JSON (.json) or a torchtitan job config (.toml)"
        )
    return kind


def parse_recipe(path: Path) -> tuple[RecipeKind, str, dict[str, Any]]:
    """The file's kind, its text and its parsed table.

    Raises:
        RecipeError: a file that is missing, unreadable, or not a table of its format.
    """
    kind = kind_of(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"--recipe {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        data = parse_text(kind, text)
    except ValueError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RecipeError(f"{path}: not {_NAMES[kind]} ({first})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: not {_NAMES[kind]}: its top level is not a table of keys")
    return kind, text, data


def parse_text(kind: RecipeKind, text: str) -> Any:
    """text parsed as its kind's format: JSON, TOML (tomllib; tomli before Python 3.11) or YAML (PyYAML, which
    transformers brings).

    Raises:
        ValueError: text that is not the format (each parser's error is a ValueError or is made one).
        RecipeError: the format's parser is not installed.
    """
    if kind == "trainer":
        return json.loads(text)
    if kind == "torchtitan":
        try:
            toml = importlib.import_module("tomllib")
        except ImportError:  # Python 3.10
            try:
                toml = importlib.import_module("tomli")
            except ImportError:
                raise RecipeError(
                    "reading a TOML recipe needs Python 3.11 (tomllib) or tomli: pip install tomli"
                ) from None
        return toml.loads(text)  # TOMLDecodeError is a ValueError
    try:
        import yaml
    except ImportError:
        raise RecipeError("reading a YAML recipe needs PyYAML: pip install pyyaml") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(" ".join(str(exc).split())) from None


def read_recipe(path: Path, context: ReadContext) -> RecipeJob:
    """The job the recipe at path describes, as its tool runs it.

    Raises:
        RecipeError: the file cannot be read as its kind, or a key cannot be read (one line: the key and the file).
    """
    kind, _, data = parse_recipe(path)
    return read_table(path, kind, data, context)


def read_table(path: Path, kind: RecipeKind, data: dict[str, Any], context: ReadContext) -> RecipeJob:
    """The job of a recipe already parsed (:func:`parse_recipe`), by the reader of its kind.

    Raises:
        RecipeError: a key that cannot be read, naming it and the file.
    """
    return _READERS[kind](path, data, context)
