"""What a recipe file says, as autotune's command line says it: the model, the flags, the batch keys.

A reader (``axolotl``, ``trainer``, ``torchtitan``) turns a file into a :class:`RecipeJob`: the local model config
the file names, each flag it amounts to (``--precision bf16``, ``--ac full``, ...) with the keys that said it, and
its :class:`BatchKeys` (micro-batch, accumulation, data-parallel ranks: the file's own global batch). The CLI then
parses those flags with the command's own parser, so the job a recipe describes and the same job given as flags are
one setup by construction (``autotune.cli.recipes.apply``).

Every key of a file is one of three: read (it becomes a flag or a batch key), ignored (it does not change the
memory a step holds: learning rate, datasets, logging, saving), or refused (:class:`RecipeError`, one line naming the
key and the file, exit 2): a value autotune cannot express yet, and any key the reader does not know, since it
cannot say that key leaves memory alone. Torch-free.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from autotune.cli.common import CliError

__all__ = [
    "BatchKeys",
    "RecipeError",
    "RecipeJob",
    "RecipeKind",
    "Setting",
    "Settings",
    "check_keys",
    "local_model",
    "positive_int_value",
]

RecipeKind = Literal["axolotl", "trainer", "torchtitan"]


class RecipeError(CliError):
    """A recipe file autotune cannot read as a job: one line naming the file and the key (exit 2)."""


@dataclass(frozen=True)
class Setting:
    """One flag a recipe amounts to: ``--flag VALUE`` (VALUE None for a flag that takes none) and the keys of the
    file that said it (``("bf16",)``), for the lines that say where a flag came from or what overrode it."""

    flag: str
    value: str | None
    keys: tuple[str, ...]

    @property
    def words(self) -> list[str]:
        return [self.flag] if self.value is None else [self.flag, self.value]


@dataclass
class Settings:
    """The flags a reader has found so far, in the order found; a flag set twice keeps its last value and every key
    that said it. ``given`` holds the flags the user gave beside the file (they override it: a reader need not read,
    or refuse, the keys they stand for)."""

    given: frozenset[str] = frozenset()
    items: dict[str, Setting] = field(default_factory=dict)

    def set(self, flag: str, value: object, *keys: str) -> None:
        text = None if value is None else str(value)
        before = self.items.get(flag)
        said = tuple(dict.fromkeys((*(before.keys if before else ()), *keys)))
        self.items[flag] = Setting(flag, text, said)

    def get(self, flag: str) -> str | None:
        setting = self.items.get(flag)
        return None if setting is None else setting.value

    def __contains__(self, flag: object) -> bool:
        return flag in self.items

    def as_tuple(self) -> tuple[Setting, ...]:
        return tuple(self.items.values())


@dataclass(frozen=True)
class BatchKeys:
    """The file's batch: micro-batch m (sequences per rank per forward), accumulation A, and D, the data-parallel
    ranks it runs over; its global batch is m x A x D, the target autotune plans for. ``written`` names the keys a
    written recipe changes (the format's spelling) and ``tokens_per_sequence`` is set where the file counts its
    batch in tokens (torchtitan's newer form: m x L tokens per micro-batch)."""

    micro_batch: int
    accumulation_steps: int
    data_parallel: int
    keys: tuple[str, ...]
    tokens_per_sequence: int | None = None

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation_steps * self.data_parallel


@dataclass(frozen=True)
class RecipeJob:
    """A recipe read as a job: the file, its kind, the model config it names (a local path), the flags it amounts to,
    its batch, and the notes a reader has for the terminal (a key read with a stated assumption)."""

    path: Path
    kind: RecipeKind
    model: str
    model_key: str
    settings: tuple[Setting, ...]
    batch: BatchKeys
    notes: tuple[str, ...] = ()

    @property
    def spec(self) -> str:
        """The task: the model config as an ``hf:`` spec (the flags write LoRA and the rest into it)."""
        return f"hf:{self.model}"

    def words(self) -> list[str]:
        """The command line's words after the command: the task, then every flag."""
        return [self.spec, *(word for setting in self.settings for word in setting.words)]

    def command(self, name: str) -> str:
        """``autotune NAME hf:... --flag value ...``: the flags this recipe equals, as a user would type them."""
        return shlex.join(["autotune", name, *self.words()])


def check_keys(
    path: Path,
    data: Mapping[str, Any],
    *,
    read: Iterable[str],
    ignored: Iterable[str],
    where: str = "",
    what: str,
) -> None:
    """Refuse the first key of data that is neither read nor ignored: autotune cannot say it leaves memory alone.

    Raises:
        RecipeError: naming the key (``where`` is its table, ``"fsdp_config."``), the file and ``what`` the file is.
    """
    known = set(read) | set(ignored)
    for key in data:
        if key not in known:
            raise RecipeError(
                f"{path}: {where}{key} is not a key of {what} autotune knows, so it cannot say the key leaves memory "
                "alone: remove it, or give the job as flags"
            )


def positive_int_value(path: Path, key: str, value: object) -> int:
    """value as a positive integer (YAML, JSON and TOML all hand integers over as int; 8.0 is 8).

    Raises:
        RecipeError: a value that is not a positive integer, naming the key and the file.
    """
    if isinstance(value, bool):
        raise RecipeError(f"{path}: {key} = {value!r} is not a positive integer")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or value < 1:
        raise RecipeError(f"{path}: {key} = {value!r} is not a positive integer")
    return value


def local_model(path: Path, key: str, value: object, *, model: str | None) -> tuple[str, str]:
    """The model config a recipe trains, as a local path (a ``config.json`` or a folder holding one), and the key or
    flag that named it: ``--model`` where given (it overrides the file), else the file's key, read as the tool that
    owns the file reads it: relative to the folder it runs in. autotune downloads nothing: a hub id is refused.

    Raises:
        RecipeError: no model, or one that is not a local config, naming the key and the file.
    """
    if model is not None:
        chosen, said = model, "--model"
    elif isinstance(value, str) and value:
        chosen, said = value, key
    else:
        raise RecipeError(f"{path}: names no model ({key}): give --model PATH (a config.json or a folder holding one)")
    where = Path(chosen)
    if (where / "config.json").is_file() or (where.is_file() and where.suffix == ".json"):
        return chosen, said
    origin = "--model" if said == "--model" else f"{key} {chosen!r} in {path}"
    raise RecipeError(
        f"{origin} is not a local model config (a config.json, or a folder holding one, relative to this folder): "
        "autotune reads the config and downloads nothing; give --model PATH"
    )
