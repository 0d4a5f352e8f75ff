"""Recipe files, the user's own description of a job, as autotune's input and output (docs/recipe-files.md).

``autotune probe --recipe FILE`` and ``autotune estimate --recipe FILE`` read an Axolotl config (YAML), a Hugging Face
``TrainingArguments`` or TRL ``SFTConfig`` JSON, or a torchtitan job config (TOML) as the job the tool that owns it
runs: one reader per kind (``axolotl``, ``trainer``, ``torchtitan``) turns the file into the model it names and the
flags it amounts to (``job``, ``reading``, ``optimizers``, ``read``); ``apply`` parses those flags with the command's
own parser, so a recipe and the same job given as flags are one setup, flags given beside the file overriding it.
``--write-recipe OUT`` writes the file back with only its batch keys changed to the plan (``write``, ``emit``).

Torch-free, on the CLI's floor: it makes command lines. Modules are imported by their own names (this package
imports none of them), so the parser's modules and ``main`` import only what each needs.
"""

__all__: list[str] = []
