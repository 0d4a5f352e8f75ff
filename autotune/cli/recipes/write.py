"""A recipe written back with the plan's batch: only its batch keys changed, every other byte kept.

The substitution is by line: the value of each batch key is replaced where it stands (its comment, spacing and the
file's key order kept); a batch key the file leaves out (at its default) is added beside the others. The result is
parsed again and must equal the file but for those keys, or nothing is written. The keys:

- Axolotl: ``micro_batch_size`` and ``gradient_accumulation_steps`` (or ``batch_size`` where the file counts that);
- TrainingArguments: ``per_device_train_batch_size`` and ``gradient_accumulation_steps``;
- torchtitan: ``[training] local_batch_size`` with ``global_batch_size`` kept (written out where the file left it at
  -1, one step's batch, and the new local batch makes another); under a pipeline ``[parallelism]
  pipeline_parallel_microbatch_size`` too; in the newer form ``num_tokens_per_microbatch_per_dp_rank`` and
  ``num_tokens_per_train_step`` (and ``num_pp_microbatches``).

Torch-free.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.cli.recipes.job import BatchKeys, RecipeError, RecipeKind
from autotune.cli.recipes.read import parse_text

__all__ = ["Change", "recipe_changes", "rewrite_recipe", "write_bytes_atomically"]


@dataclass(frozen=True)
class Change:
    """One batch key written: its table (``training`` in a TOML, ``""`` at the top), its name, the value before (None
    where the file left it out) and after."""

    table: str
    key: str
    before: int | None
    after: int

    @property
    def name(self) -> str:
        return f"{self.table}.{self.key}" if self.table else self.key

    def text(self) -> str:
        before = "(absent)" if self.before is None else str(self.before)
        return f"{self.name} {before} -> {self.after}"


def recipe_changes(
    kind: RecipeKind, data: dict[str, Any], batch: BatchKeys, *, micro_batch: int, accumulation_steps: int
) -> list[Change]:
    """The batch keys a plan of micro_batch x accumulation_steps (over the file's D) writes, with their old values;
    keys whose value stays are left out."""
    if kind == "axolotl":
        changes = [Change("", "micro_batch_size", data.get("micro_batch_size"), micro_batch)]
        if batch.keys[1] == "batch_size":
            changes.append(Change("", "batch_size", data.get("batch_size"), micro_batch * accumulation_steps))
        else:
            changes.append(
                Change("", "gradient_accumulation_steps", data.get("gradient_accumulation_steps"), accumulation_steps)
            )
    elif kind == "trainer":
        changes = [
            Change("", "per_device_train_batch_size", data.get("per_device_train_batch_size"), micro_batch),
            Change("", "gradient_accumulation_steps", data.get("gradient_accumulation_steps"), accumulation_steps),
        ]
    else:
        changes = _torchtitan_changes(data, batch, micro_batch=micro_batch, accumulation_steps=accumulation_steps)
    # The formats' own defaults (a key left out holds them): schemas/training.py, TrainingArguments, job_config.py.
    defaults = {
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "per_device_train_batch_size": 8,
        "local_batch_size": 8,
        "pipeline_parallel_microbatch_size": 1,
        "num_pp_microbatches": 1,
        "num_tokens_per_microbatch_per_dp_rank": 16384,
    }
    return [c for c in changes if (c.before if c.before is not None else defaults.get(c.key)) != c.after]


def _torchtitan_changes(
    data: dict[str, Any], batch: BatchKeys, *, micro_batch: int, accumulation_steps: int
) -> list[Change]:
    training = data.get("training") or {}
    parallelism = data.get("parallelism") or {}
    pipeline = (parallelism.get("pipeline_parallel_degree") or 1) > 1
    tokens = batch.tokens_per_sequence
    scale = tokens or 1
    global_batch = micro_batch * accumulation_steps * batch.data_parallel
    local_key, global_key = batch.keys
    # Under a pipeline the plan's accumulation is the schedule's micro-batches: one step holds them all.
    local = micro_batch * accumulation_steps if pipeline and tokens is None else micro_batch
    changes = [Change("training", local_key, training.get(local_key), local * scale)]
    if pipeline and tokens is None:
        changes.append(
            Change(
                "parallelism",
                "pipeline_parallel_microbatch_size",
                parallelism.get("pipeline_parallel_microbatch_size"),
                micro_batch,
            )
        )
    elif pipeline:
        changes.append(
            Change("parallelism", "num_pp_microbatches", parallelism.get("num_pp_microbatches"), accumulation_steps)
        )
    before = training.get(global_key)
    # -1 (or absent) is one step's batch: it stays right only where the new local batch makes one step of it.
    one_step = (local if not pipeline or tokens is None else micro_batch * accumulation_steps) * batch.data_parallel
    if before not in (None, -1) or one_step != global_batch:
        changes.append(Change("training", global_key, before, global_batch * scale))
    return changes


def rewrite_recipe(path: Path, kind: RecipeKind, text: str, data: dict[str, Any], changes: list[Change]) -> str:
    """The file's text with each change made in place (or the key added), checked by parsing it again.

    Raises:
        RecipeError: a batch key the text holds in a form a line cannot change (twice, or inside a value), so that
            the written file would not be the file with only its batch keys changed: nothing is written.
    """
    new = text
    for change in changes:
        if kind == "axolotl":
            new = _yaml_line(path, new, change)
        elif kind == "trainer":
            new = _json_value(path, new, change)
        else:
            new = _toml_line(path, new, change)
    _check(path, kind, data, new, changes)
    return new


def _yaml_line(path: Path, text: str, change: Change) -> str:
    pattern = re.compile(rf"^({re.escape(change.key)}[ \t]*:[ \t]*)([^#\n]*?)([ \t]*(?:#[^\n]*)?)$", re.MULTILINE)
    found = pattern.findall(text)
    if len(found) > 1:
        raise RecipeError(f"{path}: {change.key} stands on {len(found)} lines: nothing written")
    if found:
        return pattern.sub(lambda m: f"{m.group(1)}{change.after}{m.group(3)}", text, count=1)
    # Absent (at its default): beside micro_batch_size, where the batch is said, or at the end.
    anchor = re.search(r"^micro_batch_size[ \t]*:[^\n]*\n", text, re.MULTILINE)
    line = f"{change.key}: {change.after}\n"
    if anchor:
        return text[: anchor.end()] + line + text[anchor.end() :]
    return text + ("" if text.endswith("\n") or not text else "\n") + line


def _json_value(path: Path, text: str, change: Change) -> str:
    pattern = re.compile(rf'("{re.escape(change.key)}"\s*:\s*)(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|null)')
    found = pattern.findall(text)
    if len(found) > 1:
        raise RecipeError(f'{path}: "{change.key}" stands {len(found)} times: nothing written')
    if found:
        return pattern.sub(lambda m: f"{m.group(1)}{change.after}", text, count=1)
    opening = re.match(r"\s*\{(\s*)", text)
    if opening is None:
        raise RecipeError(f"{path}: not a JSON object: nothing written")
    indent = opening.group(1) or " "
    return text[: opening.end()] + f'"{change.key}": {change.after},' + indent + text[opening.end() :]


def _toml_line(path: Path, text: str, change: Change) -> str:
    lines = text.splitlines(keepends=True)
    table = ""
    header_at = None
    value = re.compile(rf"^([ \t]*{re.escape(change.key)}[ \t]*=[ \t]*)([^#\n]*?)([ \t]*(?:#[^\n]*)?)(\r?\n?)$")
    hits = []
    for index, line in enumerate(lines):
        header = re.match(r"^[ \t]*\[([^\[\]]+)\][ \t]*(?:#.*)?$", line.rstrip("\r\n"))
        if header:
            table = header.group(1).strip()
            if table == change.table:
                header_at = index
            continue
        if table == change.table and value.match(line):
            hits.append(index)
    if len(hits) > 1:
        raise RecipeError(f"{path}: [{change.table}] {change.key} stands on {len(hits)} lines: nothing written")
    if hits:
        match = value.match(lines[hits[0]])
        assert match is not None
        lines[hits[0]] = f"{match.group(1)}{change.after}{match.group(3)}{match.group(4)}"
        return "".join(lines)
    if header_at is not None:
        lines.insert(header_at + 1, f"{change.key} = {change.after}\n")
        return "".join(lines)
    tail = "" if text.endswith("\n") or not text else "\n"
    return text + tail + f"\n[{change.table}]\n{change.key} = {change.after}\n"


def _check(path: Path, kind: RecipeKind, data: dict[str, Any], text: str, changes: list[Change]) -> None:
    """The new text parses to the old table with exactly the changes made."""
    try:
        written = parse_text(kind, text)
    except ValueError as exc:
        raise RecipeError(f"{path}: the rewritten file would not parse ({exc}): nothing written") from None
    expected = json.loads(json.dumps(data))
    for change in changes:
        (expected.setdefault(change.table, {}) if change.table else expected)[change.key] = change.after
    if json.loads(json.dumps(written)) != expected:
        raise RecipeError(f"{path}: the batch keys are not where a line can change them alone: nothing written")


def write_bytes_atomically(path: Path, text: str) -> None:
    """Write text exactly (no newline added), beside path first and then renamed over it: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(text.encode("utf-8"))
    tmp.replace(path)
