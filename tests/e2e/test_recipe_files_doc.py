"""docs/recipe-files.md's commands, run (each in a fresh process, forked warm by tests/warm_cli.py, in a folder holding
examples/configs and examples/recipes, as a user would): each example's recipe prints the flags it equals, its answer
and the written file's diff as the page shows them; those flags, run beside it, measure the same fingerprint, m_max
and plan (the truth that a recipe and its flags are one setup); the written file read back is the same job with the
plan's batch. The refusal block says its one line and exits 2."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import warm_cli
from tests.e2e.test_docs import DOCS, REPO, blocks, section

PAGE = DOCS / "recipe-files.md"
TIMEOUT_SECONDS = 600
EXAMPLES = [
    "### An Axolotl QLoRA config with 8-bit Adam",
    "### A TRL SFT config: LoRA under FSDP x tensor parallel",
    "### A torchtitan job config: FSDP x tensor parallel, op-level checkpointing",
]

pytest.importorskip("peft", reason="the hf extra (peft) is not installed")


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("AUTOTUNE_URL", None)
    return warm_cli.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for name in ("configs", "recipes"):
        shutil.copytree(REPO / "examples" / name, tmp_path / "examples" / name)
    return tmp_path


def _profile(path: Path) -> dict[str, object]:
    data = json.loads(path.read_text())
    return dict(data[0] if isinstance(data, list) else data)


@pytest.mark.parametrize("heading", EXAMPLES)
def test_each_example_answers_as_shown_and_equals_its_flags(
    folder: Path, heading: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = section(PAGE, heading)
    (script,) = blocks(text, "bash")
    (shown,) = blocks(text, "")
    probe_line, diff_line = script.replace("\\\n", " ").strip().splitlines()
    command = shlex.split(probe_line)
    done = run([*command, "--output", "recipe.json"], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [" ".join(line.split()) for line in (done.stdout + done.stderr).splitlines()]
    shown_lines = shown.strip("\n").splitlines()
    diff_at = next(i for i, line in enumerate(shown_lines) if line[:1].isdigit())
    for line in shown_lines[:diff_at]:
        assert " ".join(line.split()) in printed, (line, done.stderr[-3000:])
    diff = subprocess.run(shlex.split(diff_line), cwd=folder, capture_output=True, text=True, check=False)
    assert diff.stdout.splitlines() == shown_lines[diff_at:]

    # The flags the recipe equals, with the same measurement flags: one setup.
    said = shown_lines[0].split(" is the job of: ", 1)[1]
    measured = command[command.index("--device") : command.index("--write-recipe")]
    flags = run([*shlex.split(said), *measured, "--output", "flags.json"], folder)
    assert flags.returncode == 0, flags.stderr[-3000:]
    by_recipe, by_flags = _profile(folder / "recipe.json"), _profile(folder / "flags.json")
    for key in ("fingerprint", "max_micro_batch", "plan", "strategy", "world_size", "precision", "tags"):
        assert by_recipe[key] == by_flags[key], key

    # The written file, read back: the same job, the plan's micro-batch and accumulation.
    from autotune.cli.recipes.read import read_recipe
    from autotune.cli.recipes.reading import ReadContext

    original, written = Path(command[command.index("--recipe") + 1]), Path(command[command.index("--write-recipe") + 1])
    monkeypatch.chdir(folder)  # the recipes name their model relative to the folder they run in
    before, after = read_recipe(original, ReadContext()), read_recipe(written, ReadContext())
    plan = by_recipe["plan"]
    assert isinstance(plan, dict)
    assert after.settings == before.settings and after.model == before.model
    assert (after.batch.micro_batch, after.batch.accumulation_steps * after.batch.data_parallel) == (
        plan["micro_batch"],
        plan["accumulation_steps"] * plan["world_size"],
    )


def test_the_refusal_says_its_line_and_exits_2(folder: Path) -> None:
    text = section(PAGE, "## Refused, in one line")
    (script,) = blocks(text, "bash")
    (shown,) = blocks(text, "")
    (folder / "run.sh").write_text(script)
    done = run(["bash", "run.sh"], folder)
    assert done.returncode == 0
    assert (done.stderr + done.stdout).splitlines() == shown.strip("\n").splitlines()
