"""docs/client.md's "From a Lightning module", "From a Hugging Face Trainer" and "From a model config"
blocks (the README's until the reference moved to docs/), run as written (each in a fresh process, in an
empty folder, as a user would; the Python scripts and the bash block's `autotune`
commands forked warm by tests/warm_cli.py)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests import warm_cli

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_SECONDS = 600
PAGE = REPO / "docs" / "client.md"


def block(heading: str, language: str) -> str:
    """The first ``language`` block under docs/client.md's ``### heading``."""
    text = PAGE.read_text()
    marker = f"### {heading}\n"
    assert marker in text, f"docs/client.md has no section {heading!r}"
    section = text.split(marker, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    match = re.search(rf"```{language}\n(.*?)```", section, re.DOTALL)
    assert match, f"no {language} block under {heading!r}"
    return match.group(1)


def run(command: list[str], cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("AUTOTUNE_URL", None)
    done = warm_cli.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_from_a_lightning_module(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="the lightning extra is not installed")
    (tmp_path / "train.py").write_text(block("From a Lightning module", "python"))
    out = run([sys.executable, "train.py"], tmp_path)
    found = re.search(r"trained with (\d+) x (\d+) = 16 per update", out)
    assert found, out[-2000:]
    micro, steps = int(found.group(1)), int(found.group(2))
    assert micro * steps == 16 and micro < 16
    assert f"autotune: micro-batch {micro} x {steps} accumulation steps x 1 replicas = 16 (the recipe's batch)" in out


def test_from_a_hugging_face_trainer(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    (tmp_path / "train.py").write_text(block("From a Hugging Face Trainer", "python"))
    out = run([sys.executable, "train.py"], tmp_path)
    found = re.search(r"training with (\d+) x (\d+) = 16 per update", out)
    assert found, out[-2000:]
    micro, steps = int(found.group(1)), int(found.group(2))
    assert micro * steps == 16 and micro < 16
    assert "'train_loss'" in out or "train_loss" in out  # it trained


def test_from_a_model_config(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    (tmp_path / "run.sh").write_text(block("From a model config", "bash"))
    out = run(["bash", "-e", "run.sh"], tmp_path)
    named = re.search(r"named after the config's `model_type` and size \(`(llama-\w+)`\)", PAGE.read_text())
    assert named, "docs/client.md names no task for its config"
    name = named.group(1)  # llama-26K: the page's name is the one the commands print
    assert name in out
    assert re.search(rf"{re.escape(name)}: ok: accumulation reproduces the full-batch gradient", out), out[-2000:]
