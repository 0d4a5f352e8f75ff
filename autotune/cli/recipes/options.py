"""--recipe, --model and --write-recipe, as ``probe`` and ``estimate`` take them."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_recipe_options"]


def add_recipe_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "recipe", "the job from the user's own file (docs/recipe-files.md); flags given beside it override it"
    )
    g.add_argument(
        "--recipe",
        type=Path,
        metavar="FILE",
        help="the job an Axolotl config (.yml), a Hugging Face TrainingArguments / TRL SFTConfig JSON (.json) or a "
        "torchtitan job config (.toml) describes, instead of TASK: its model, length, precision, optimizer, "
        "checkpointing, adapter and mesh, and its global batch as the target",
    )
    g.add_argument(
        "--model",
        metavar="PATH",
        help="with --recipe: the model config (a config.json or a folder holding one) instead of the file's own",
    )
    g.add_argument(
        "--write-recipe",
        type=Path,
        metavar="OUT",
        help="with --recipe: write the file to OUT with only its batch keys changed to the plan (micro-batch and "
        "accumulation; torchtitan's local batch, its global batch kept)",
    )
