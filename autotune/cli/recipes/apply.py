"""``--recipe FILE`` on the command line: the file read as the job, its flags parsed by the command's own parser and
set where the user gave none beside it, so the job a recipe describes and the same job given as flags are one setup.

``main`` calls :func:`apply_recipe` on the parsed flags before it checks them (autotune.cli.inputs), so a recipe's
flags are checked as typed ones are, and a key autotune cannot read costs no trial and writes nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.cli.common import CliError
from autotune.cli.recipes.job import RecipeError, RecipeJob
from autotune.cli.recipes.read import parse_recipe, read_table
from autotune.cli.recipes.reading import ReadContext

__all__ = ["RECIPE_COMMANDS", "LoadedRecipe", "apply_recipe", "given_dests"]

# The commands that take --recipe.
RECIPE_COMMANDS = ("probe", "estimate")


@dataclass(frozen=True)
class LoadedRecipe:
    """A recipe applied to a command: the job read, and the file's text and table (what --write-recipe rewrites)."""

    job: RecipeJob
    text: str
    data: dict[str, Any]


# A recipe's flag the user's flag stands in for: the length (one --seq-len is the file's length) and the target
# (tokens instead of sequences).
_LED_BY = {"max_seq_len": "seq_len", "target_batch": "target_tokens"}


class _Unset:
    """The default every option of a command gets in :func:`given_dests`: a value still this was not typed."""


def apply_recipe(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    """With ``--recipe FILE``: set in args the task and every flag the file amounts to, but those the user gave beside
    it (each said on stderr as an override), and keep the file for ``--write-recipe`` (``args.recipe_loaded``).
    Without it: TASK is needed, and --model and --write-recipe are refused.

    Raises:
        CliError: no task and no recipe, both, or --model / --write-recipe without a recipe.
        RecipeError: the file cannot be read as a job (one line naming the key and the file).
    """
    if getattr(args, "command", None) not in RECIPE_COMMANDS:
        return
    path = args.recipe
    if path is None:
        if args.task is None:
            raise CliError(
                f"{args.command} needs TASK (path/to/file.py:name, package.module:name or hf:PATH) or --recipe FILE"
            )
        for flag, dest in (("--model", "model"), ("--write-recipe", "write_recipe")):
            if getattr(args, dest, None) is not None:
                raise CliError(f"{flag} goes with --recipe FILE")
        return
    if args.task is not None:
        raise CliError(f"give TASK or --recipe FILE, not both: {path} names its model (--model PATH replaces it)")
    given = given_dests(args.command, sys.argv[1:] if argv is None else argv)
    parser = _command_parser(args.command)
    dests = {flag: action.dest for action in parser._actions for flag in action.option_strings}
    context = ReadContext(
        model=args.model,
        world_size=args.world_size if "world_size" in given else None,
        given=frozenset(flag for flag, dest in dests.items() if dest in given),
    )
    kind, text, data = parse_recipe(path)
    job = read_table(path, kind, data, context)
    recipe_args = _parsed(parser, job)
    lines = [f"recipe {path} ({job.kind}) is the job of: {job.command(args.command)}"]
    flags = {dest: flag for flag, dest in reversed(dests.items())}  # a dest's first spelling (--world-size)
    for setting in job.settings:
        dest = dests[setting.flag]
        typed = dest if dest in given else _LED_BY.get(dest) if _LED_BY.get(dest) in given else None
        if typed is None:
            setattr(args, dest, getattr(recipe_args, dest))
            continue
        said = " and ".join(setting.keys) or "ranks"
        lines.append(f"  {flags[typed]} given beside the file overrides its {said} ({' '.join(setting.words)})")
    args.task = recipe_args.task
    lines += [f"  note: {note}" for note in job.notes]
    print("\n".join(lines), file=sys.stderr)
    _check_write(args, path)
    args.recipe_loaded = LoadedRecipe(job, text, data)


def given_dests(command: str, argv: Sequence[str]) -> frozenset[str]:
    """The destinations of the options the user typed for command (``world_size`` for ``--world-size 8``, however
    abbreviated or spelled ``--flag=value``): argv parsed again with every option's default a marker that typing it
    replaces (argparse keeps no record of what was typed)."""
    from autotune.cli.parser import build_parser

    parser = build_parser()
    sub = _subparsers(parser)[command]
    unset = _Unset()
    sub.set_defaults(**{action.dest: unset for action in sub._actions if action.dest != argparse.SUPPRESS})
    parsed = parser.parse_args(list(argv))
    return frozenset(dest for dest, value in vars(parsed).items() if value is not unset)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    # argparse has no public way to a sub-parser: its action holds them by name.
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _command_parser(command: str) -> argparse.ArgumentParser:
    from autotune.cli.parser import build_parser

    return _subparsers(build_parser())[command]


def _parsed(parser: argparse.ArgumentParser, job: RecipeJob) -> argparse.Namespace:
    """The recipe's words parsed by the command's parser: each value checked by the flag's own type.

    Raises:
        RecipeError: a value the flag refuses, naming the keys that gave it and the file.
    """
    parser.exit_on_error = False
    try:
        return parser.parse_args(job.words())
    except argparse.ArgumentError as exc:
        setting = next((s for s in job.settings if exc.argument_name and s.flag in exc.argument_name), None)
        said = " and ".join(setting.keys) if setting else "a key"
        raise RecipeError(f"{job.path}: {said} gives {exc.argument_name} {exc.message}") from None


def _check_write(args: argparse.Namespace, path: Path) -> None:
    """--write-recipe OUT: one profile to write from (one policy, one length), and a file this process can write."""
    out = getattr(args, "write_recipe", None)
    if out is None:
        return
    if len(args.ac or ()) > 1 or len(args.seq_len or ()) > 1:
        raise CliError(f"--write-recipe {out}: writes one plan; give one --ac policy and one --seq-len")
    if out.is_dir():
        raise CliError(f"--write-recipe {str(out)!r} is a folder: give a file name, e.g. {str(out / path.name)!r}")
    folder = out.parent
    while not folder.exists():
        folder = folder.parent
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".autotune-check-"):
            pass
    except OSError as exc:
        raise CliError(
            f"--write-recipe {str(out)!r}: cannot write in {str(folder)!r} ({exc.strerror or exc})"
        ) from None
