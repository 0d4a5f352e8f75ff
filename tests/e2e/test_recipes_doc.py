"""docs/recipes.md's commands, run (each in a fresh process, in a folder holding the page's model configs, as a
user would). The recipes at real sizes (a 7B or 8B model on an emulated card) run here at tiny sizes: the same
command line with the model replaced by examples/configs/tiny-llama-one-layer.json (tiny-llama.json with one
decoder layer: a command's time is its nine or so fake trials', each its ops', which one layer about halves),
--seq-len by 32, the card (--gpu NAME, --micro-batches) by the CPU's semantics under a 64 MiB budget,
and --max-micro-batch 4, as the page says; bench/recipes.py runs them at their real sizes. The page's last recipe
is small by construction and runs as written."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import warm_cli
from tests.e2e.test_docs import DOCS, REPO, blocks, section

PAGE = DOCS / "recipes.md"
TIMEOUT_SECONDS = 600
TINY = "hf:examples/configs/tiny-llama-one-layer.json"

pytest.importorskip("peft", reason="the hf extra (peft) is not installed")


def commands(heading: str) -> list[list[str]]:
    """The `autotune ...` command lines of the section's bash blocks, continuation lines joined."""
    (script,) = blocks(section(PAGE, heading), "bash")
    lines = script.replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.startswith("autotune ")]


def tiny(command: list[str]) -> list[str]:
    """The command at tiny sizes: the page's stated overrides."""
    out: list[str] = []
    words = iter(command)
    for word in words:
        if word.startswith("hf:examples/configs/") and word != TINY:
            out.append(TINY)
        elif word == "--seq-len":
            out += [word, "32"]
            next(words)
        elif word == "--gpu":
            next(words)
            out += ["--device-kind", "cpu", "--budget", "64MiB"]
        elif word in ("--micro-batches", "--max-micro-batch"):
            next(words)
        else:
            out.append(word)
    return [*out, "--max-micro-batch", "4"]


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("AUTOTUNE_URL", None)
    return warm_cli.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "examples" / "configs", tmp_path / "examples" / "configs")
    return tmp_path


def test_the_tiny_overrides_keep_every_other_flag() -> None:
    (command,) = commands("## torchtitan's Llama 3.1 8B on eight H100s")
    assert command[:3] == ["autotune", "estimate", "hf:examples/configs/llama-3.1-8b.json"]
    assert tiny(command)[2:] == [
        TINY, "--device-kind", "cpu", "--budget", "64MiB", "--strategy", "fsdp", "--world-size", "8",
        "--precision", "bf16", "--ac", "op", "--seq-len", "32", "--max-micro-batch", "4",
    ]  # fmt: skip


def test_torchtitans_recipe_runs(folder: Path) -> None:
    """--ac op on an hf: Llama runs: a checkpointed step keeps no KV cache (autotune.measure.policies turns
    config.use_cache off, as transformers' own checkpointing does); with the cache on, the recompute filled it
    again and torch's selective checkpointing stopped at its first trial (on the one-layer model too: each
    checkpointed layer's recompute refills its own cache)."""
    (command,) = commands("## torchtitan's Llama 3.1 8B on eight H100s")
    done = run([*tiny(command), "--output", "titan.json"], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    profile = json.loads((folder / "titan.json").read_text())
    profile = profile[0] if isinstance(profile, list) else profile
    assert profile["strategy"] == "fsdp" and profile["world_size"] == 8 and profile["precision"] == "bf16"
    assert profile["activation_checkpointing"] == "op" and profile["source"] == "estimate"
    assert profile["max_micro_batch"] >= 1


def test_eight_bit_adam_holds_less_than_fused_adamw(folder: Path) -> None:
    eight_bit, fused = commands("## Llama 2 7B in full bf16 with 8-bit Adam on an A100 80 GB")
    peaks = []
    for index, command in enumerate((eight_bit, fused)):
        out = f"{index}.json"
        done = run([*tiny(command), "--output", out], folder)
        assert done.returncode == 0, done.stderr[-3000:]
        profile = json.loads((folder / out).read_text())
        profile = profile[0] if isinstance(profile, list) else profile
        peaks.append(min(t["step_bytes"] for t in profile["trials"] if t.get("step_bytes")))
    # Two one-byte moments against two bf16 ones: the step's floor is lower.
    assert peaks[0] < peaks[1]


def test_four_bit_adam_runs_eagerly_on_fake_tensors(folder: Path) -> None:
    (command,) = commands("## Llama 2 7B in full bf16 with torchao's 4-bit AdamW on an A100 80 GB")
    assert command[-2:] == ["--optimizer", "adamw4bit"]
    done = run([*tiny(command), "--output", "four.json"], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    profile = json.loads((folder / "four.json").read_text())
    profile = profile[0] if isinstance(profile, list) else profile
    assert profile["source"] == "estimate" and profile["max_micro_batch"] >= 1
    assert any("the fake trials ran it eagerly" in warning for warning in profile["warnings"])


def test_qlora_runs(folder: Path) -> None:
    (command,) = commands("## QLoRA: Llama 3.1 8B on an RTX 4090")
    done = run([*tiny(command), "--output", "qlora.json"], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    profile = json.loads((folder / "qlora.json").read_text())
    profile = profile[0] if isinstance(profile, list) else profile
    assert profile["tags"].get("quantize") == "nf4" and profile["plan"]["target_batch"] == 16


def test_choosing_among_setups_runs_as_written(folder: Path) -> None:
    lines = commands("## Choosing among setups")
    assert [line[1] for line in lines] == ["probe", "probe", "recommend"]
    for line in lines[:-1]:
        done = run(line, folder)
        assert done.returncode == 0, done.stderr[-3000:]
    done = run(lines[-1], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.match(
        r"recommended: optimizer (\S+): m_max \d+, update .*samples/s \(objective throughput\)", done.stdout
    )
    assert said, done.stdout
    # The named setup is the one whose plan was timed fastest.
    from autotune.core.recommend import options_for
    from autotune.core.schemas import Profile

    profiles = []
    for name in ("adamw", "adamw8bit"):
        data = json.loads((folder / f"{name}.json").read_text())
        profiles.append(Profile.model_validate(data[0] if isinstance(data, list) else data))
    fastest = max(options_for(profiles), key=lambda option: option.samples_per_second or 0.0)
    assert fastest.label == f"optimizer {said.group(1)}"
