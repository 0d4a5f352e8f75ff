"""``--write-recipe OUT``: after the probe or estimate, the recipe written with the plan's batch, and the datasheet's
lines that say which keys changed and from what."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from autotune.cli.common import CliError
from autotune.cli.recipes.write import recipe_changes, rewrite_recipe, write_bytes_atomically

__all__ = ["write_recipe_for"]


def write_recipe_for(profiles: list[Any], args: argparse.Namespace) -> None:
    """Write ``args.write_recipe`` from the recipe applied to args and the plan of its profile (one policy, one
    length: autotune.cli.recipes.apply refused more); nothing where the command had no recipe or no --write-recipe.

    Raises:
        CliError: a plan that does not keep the file's global batch in equal micro-batches (nothing written).
    """
    loaded = getattr(args, "recipe_loaded", None)
    out = getattr(args, "write_recipe", None)
    if loaded is None or out is None:
        return
    (profile,) = profiles
    plan = profile.plan
    if plan is None or not plan.exact or len(plan.micro_batches) != 1:
        said = "no plan" if plan is None else f"the plan {plan.note or plan.micro_batches}"
        raise CliError(
            f"--write-recipe {out}: {said} does not keep the target batch in equal micro-batches: nothing written"
        )
    job = loaded.job
    changes = recipe_changes(
        job.kind, loaded.data, job.batch, micro_batch=plan.micro_batch, accumulation_steps=plan.accumulation_steps
    )
    write_bytes_atomically(out, rewrite_recipe(job.path, job.kind, loaded.text, loaded.data, changes))
    changed = ", ".join(change.text() for change in changes) or "no batch key changed"
    print(
        f"  recipe written   {out}: {changed} (global batch {plan.effective_batch} = {plan.micro_batch} x "
        f"{plan.accumulation_steps} x {plan.world_size})",
        file=sys.stderr if args.json else sys.stdout,
    )
