"""Every `autotune` command README.md and docs/ show runs as written (issue 62, item 2: `hf:configs/llama.json` was
documented and did not exist).

- Each is **checked** in its block's own folder, after the block's setup (tests/doc_commands.py): run by the CLI's
  ``main`` in this process in check mode, it runs as a user's command does up to its first trial (the parser, the
  CLI's input checks, the task and its files loaded, the model's shape asked of the composition table, the config
  validated) and stops there (one process: transformers' model modules import once, where a fresh process per
  command spent 2-20 s importing them);
  `suggest` and `profiles` ask a live server (an empty store answers 5, nothing stored: the query was valid); a
  command for a CUDA device is checked up to the device where this machine has none; a documented refusal prints
  what the page shows.
- The **quick** ones run whole and print what their page shows (:data:`QUICK`); README's and probing.md's probe,
  whose datasheets both pages show, runs in tests/e2e/test_docs.py.
- ``bench/doc_commands.py`` runs every command whole and prints each one's time.

What is not an `autotune` command (`make`, `pip`, `ray start`, `python SCRIPT`) is not run here: installing and
starting clusters is no test's, and the scripts run in their own tests (tests/e2e/test_launch_path.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from autotune.cli import main
from tests import warm_cli
from tests.doc_commands import Block, Step, StoppedBeforeTrial, documented_blocks, run_setup, stop_before_trial
from tests.e2e.conftest import REPO, LiveServer, autotune_command
from tests.e2e.test_docs import normalized

TIMEOUT_SECONDS = 300
BLOCKS = documented_blocks()
# A command whose inputs are what the block's commands before it write: the block runs whole in its own test.
RUN_WHOLE_ELSEWHERE = {("docs/recipes.md", "recommend"): "tests/e2e/test_recipes_doc.py"}
# The commands whose output is quick to reproduce (refusals, a fake trial's diagnosis, verify): run whole, printing
# what the page shows. The others with output run whole in bench/doc_commands.py (gpt-100m's diagnosis: 80 s here).
QUICK = [
    ("docs/probing.md", "estimate examples/mlp.py:task --gpu l4 --budget 1TiB"),
    ("docs/probing.md", "estimate examples/mlp.py:task --gpu h100 --micro-batches 5000"),
    ("docs/probing.md", "probe examples/mlp.py:task --device cpu --budget 2MiB --output profiles/"),
    ("docs/probing.md", "probe examples/gpt.py:task --device cpu --budget 3MiB"),
    ("docs/accumulate.md", "verify examples/gpt.py:task --target-batch 8 --micro-batch 2"),
]
NO_CUDA = "autotune: error: CUDA is not available on this machine: use --device cpu with a --budget"


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _folder(tmp_path: Path) -> Path:
    """A user's folder: empty, but for a copy of the repository's examples (the commands name examples/...; a copy,
    not a link: the fleet ships the folder it runs from, and a task file must lie inside it)."""
    folder = tmp_path / "work"
    shutil.copytree(REPO / "examples", folder / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def _env(live_server: LiveServer) -> dict[str, str]:
    env = live_server.env()
    env["PATH"] = f"{Path(autotune_command()[0]).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _arguments(step: Step, env: dict[str, str], server: str) -> list[str]:
    """The command's arguments as bash passes them, the live server's URL in place of the page's (a host name the
    page names for illustration)."""
    words = step.arguments(env)
    return [server if k and words[k - 1] == "--server" else word for k, word in enumerate(words)]


def _run(step: Step, folder: Path, env: dict[str, str], server: str) -> subprocess.CompletedProcess[str]:
    command_env = {**env, **{name: value for name, value in step.env}}
    if "AUTOTUNE_URL" in command_env:
        command_env["AUTOTUNE_URL"] = server
    return warm_cli.run(
        [*autotune_command(), *_arguments(step, command_env, server)],
        cwd=folder,
        env=command_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in the order a terminal shows it
        text=True,
        timeout=TIMEOUT_SECONDS,
    )


@contextlib.contextmanager
def _as_a_shell_would(folder: Path, env: dict[str, str]) -> object:
    """This process in the command's folder and environment, put back after it."""
    before_env, before_cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before_cwd)
        os.environ.clear()
        os.environ.update(before_env)


def _check(step: Step, folder: Path, env: dict[str, str], server: str) -> subprocess.CompletedProcess[str]:
    """The command in check mode in this process: its exit code (-1: stopped before its first trial) and output."""
    command_env = {**env, **{name: value for name, value in step.env}}
    if "AUTOTUNE_URL" in command_env:
        command_env["AUTOTUNE_URL"] = server
    argv = _arguments(step, command_env, server)
    out, err = io.StringIO(), io.StringIO()
    with _as_a_shell_would(folder, command_env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            with stop_before_trial():
                code = main(argv)
        except StoppedBeforeTrial:
            code = -1
        except SystemExit as exc:  # the parser's own refusals
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def _reads_the_blocks_outputs(step: Step, block: Block) -> bool:
    written = {s.argv[s.argv.index("--output") + 1] for s in block.steps if "--output" in s.argv}
    files = [word for word in step.argv[1:] if not word.startswith("-") and word.endswith(".json")]
    return bool(files) and set(files) <= written


def _verdict(step: Step, done: subprocess.CompletedProcess[str]) -> str | None:
    """What a checked command's run says (None: it is not one a user could run as written)."""
    err = done.stderr
    if done.returncode == -1:
        return "checked up to its first trial"
    if done.returncode == 0:
        return "ran whole"
    if step.argv[0] in ("suggest", "profiles") and done.returncode == 5:
        return "asked the server (nothing stored)"
    if "cuda" in step.argv and NO_CUDA in err.splitlines() and not _has_cuda():
        return "checked up to the device (no CUDA here)"
    shown = [line for line in step.shown if line.startswith("autotune: error:")]
    if shown and [line for line in err.splitlines() if line.startswith("autotune: error:")] == shown:
        return "refused as the page shows"
    return None


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.page}:{b.line}" for b in BLOCKS])
def test_every_documented_command_runs_as_written(block: Block, live_server: LiveServer, tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    env = _env(live_server)
    said = []
    for step in block.steps:
        if step.kind == "setup":
            run_setup(step, folder, env)
            continue
        if step.kind != "autotune":
            continue
        elsewhere = RUN_WHOLE_ELSEWHERE.get((step.page, step.argv[0]))
        if elsewhere is not None and _reads_the_blocks_outputs(step, block):
            assert (REPO / elsewhere).exists()
            said.append(f"{step.where}: run whole by {elsewhere}")
            continue
        done = _check(step, folder, env, live_server.url)
        verdict = _verdict(step, done)
        assert verdict is not None, f"{step.where}: autotune {' '.join(step.argv)}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        said.append(f"{step.where}: {verdict}")
    assert said  # every block holds a command


def _masked(text: str) -> list[str]:
    """normalized() lines, with verify's worst error (a rounding at 1e-16, and the tensor it falls on) masked."""
    lines = normalized(re.sub(r"\d\.\de-1\d \([\w.]+\)", "E (tensor)", text))
    return [line for line in lines if line and not line.startswith(("W1", "Failed to load"))]


def _compared(step: Step, done: subprocess.CompletedProcess[str]) -> None:
    printed = done.stdout + (f"{done.returncode}\n" if "echo $?" in step.after else "")
    shown = _masked("\n".join(step.shown))
    lines = _masked(printed)
    assert lines == shown, f"{step.where}: the page shows\n" + "\n".join(shown) + "\nthe command prints\n" + printed


@pytest.mark.parametrize(("page", "command"), QUICK, ids=[f"{page}: {command}" for page, command in QUICK])
def test_the_quick_ones_print_what_the_page_shows(
    page: str, command: str, live_server: LiveServer, tmp_path: Path
) -> None:
    (step,) = [s for b in BLOCKS if b.page == page for s in b.steps if " ".join(s.argv) == command]
    assert step.shown, step.where
    _compared(step, _run(step, _folder(tmp_path), _env(live_server), live_server.url))


def test_every_command_is_found_and_none_names_a_file_that_is_not_there() -> None:
    """The extraction finds what the pages hold (a command lost by it would go unchecked), and every hf: config a
    command names outside a block that writes it is in the repository."""
    steps = [s for b in BLOCKS for s in b.steps if s.kind == "autotune"]
    assert len(steps) >= 50
    pages = {s.page for s in steps}
    assert {"README.md", "docs/probing.md", "docs/cuda-estimates.md", "docs/meshes.md", "docs/recipes.md"} <= pages
    for block in BLOCKS:
        written = " ".join(s.text for s in block.steps if s.kind == "setup")
        for step in block.steps:
            for word in step.argv:
                path = word.removeprefix("hf:").split("?", 1)[0] if word.startswith("hf:") else None
                if path is not None and path not in (".",) and path not in written:
                    assert (REPO / path).exists(), f"{step.where}: {word} names no file of the repository"
    assert not re.search(r"hf:configs/", "\n".join(p.read_text() for p in (REPO / "docs").glob("*.md")))
    assert shutil.which("bash")
