"""The optimizers a recipe names, as the ``--optimizer`` specs that hold the same state (autotune/tasks/optimizers.py).

Hugging Face's ``optim`` names (transformers' ``OptimizerNames``, training_args.py; built by trainer_optimizer.py,
transformers 5.24) and Axolotl's ``optimizer`` (the same names, passed to the Trainer as ``optim``: axolotl
src/axolotl/core/builders/base.py ``_configure_optimizer``, plus its own ``ao_adamw_*``, which it built from
``torchao.optim`` when it added them: axolotl commit e4063d60a). A name outside the table is refused: autotune does
not know the state it keeps. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from autotune.cli.recipes.job import RecipeError

__all__ = ["TRAINER_OPTIMIZERS", "optimizer_spec"]

# optim -> (the --optimizer spec, a note where the reading assumes something).
TRAINER_OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    # _get_adamw_torch: torch.optim.AdamW, with fused=True for the fused name (foreach otherwise, torch's default).
    "adamw_torch": ("AdamW", None),
    "adamw_torch_fused": ("AdamW:fused=true", None),
    # _get_bitsandbytes_optimizer: bitsandbytes.optim.AdamW(optim_bits=8), which is AdamW8bit.
    "adamw_bnb_8bit": ("adamw8bit", None),
    "adamw_8bit": ("adamw8bit", None),
    "paged_adamw_8bit": (
        "adamw8bit",
        "paged_adamw_8bit keeps AdamW8bit's state in CUDA unified memory, which the driver pages to the host only "
        "under pressure: counted on the card, the most the job holds there",
    ),
    "paged_adamw_32bit": (
        "bitsandbytes.optim.AdamW32bit",
        "paged_adamw_32bit keeps AdamW's fp32 state in CUDA unified memory, which the driver pages to the host only "
        "under pressure: counted on the card, the most the job holds there",
    ),
    # _get_torchao_optimizer: torchao.optim.AdamW4bit / AdamW8bit.
    "adamw_torch_4bit": ("adamw4bit", None),
    "adamw_torch_8bit": ("torchao.optim.AdamW8bit", None),
    # _get_adafactor: transformers' Adafactor with the Trainer's settings (the recipe autotune names adafactor).
    "adafactor": ("adafactor", None),
    # _get_sgd: torch.optim.SGD without momentum (no state).
    "sgd": ("SGD", None),
}
# Axolotl's own names on top of the Trainer's (enums.py CustomSupportedOptimizers).
AXOLOTL_OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    **TRAINER_OPTIMIZERS,
    "ao_adamw_4bit": ("adamw4bit", None),
    "ao_adamw_8bit": ("torchao.optim.AdamW8bit", None),
}


def optimizer_spec(path: Path, key: str, name: object, *, axolotl: bool = False) -> tuple[str, str | None]:
    """The ``--optimizer`` spec of the recipe's optimizer name and a note, if any.

    Raises:
        RecipeError: a name autotune does not know the state of (float8 states, GaLore, Lion, ...).
    """
    table = AXOLOTL_OPTIMIZERS if axolotl else TRAINER_OPTIMIZERS
    if not isinstance(name, str) or name.lower() not in table:
        known = ", ".join(sorted(table))
        raise RecipeError(
            f"{path}: {key} {name!r} is an optimizer autotune does not know the state of: one of {known}, or give "
            "--optimizer SPEC beside the file"
        )
    return table[name.lower()]
