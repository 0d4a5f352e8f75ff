"""Every `autotune` command README.md and docs/ show, run whole as written, each one's wall time printed.

    nice .venv/bin/python bench/doc_commands.py                   # every page (the 7B and 8B estimates: minutes)
    nice .venv/bin/python bench/doc_commands.py --only probing.md --only accumulate.md
    nice .venv/bin/python bench/doc_commands.py --list            # what would run, nothing run

The suite checks each command up to its first trial and runs the quick ones whole (tests/e2e/test_doc_commands.py);
this runs all of them whole, as a user would: each block in a fresh folder holding a copy of examples/, its setup
statements by bash (the config a block writes), its `autotune` commands as processes of their own (a fresh
interpreter each, its start-up in its time), against one live `autotune serve` that stands in for the server a page
names (`--server`, `$AUTOTUNE_URL`). Where a page shows a command's output, the lines it prints are compared (times
and rates aside; `...` on the page skips lines). What cannot run here is said, not run: a CUDA device this machine
lacks, a Ray cluster at a page's illustrative address, and programs that are not autotune (`pip`, `ray`, `make`,
`python SCRIPT`: the scripts have their own tests). `autotune serve` runs until it prints its address, then stops.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.doc_commands import Block, Step, documented_blocks, run_setup  # noqa: E402
from tests.e2e.conftest import LiveServer, start_server  # noqa: E402
from tests.e2e.test_docs import normalized  # noqa: E402

TIMEOUT_SECONDS = 3600


def _autotune() -> list[str]:
    script = Path(sys.executable).with_name("autotune")
    return [str(script)] if script.exists() else [sys.executable, "-m", "autotune.cli"]


def _cannot_run(step: Step) -> str | None:
    """Why this machine cannot run step as written, or None."""
    import torch

    if "cuda" in step.argv and not torch.cuda.is_available():
        return "a CUDA device (this machine has none)"
    if "--ray-address" in step.argv:
        return f"the Ray cluster at {step.argv[step.argv.index('--ray-address') + 1]}"
    if step.argv[0] == "fleet" and "--accelerators" in step.argv:
        return "GPU nodes of the named kinds in a Ray cluster"
    return None


def _arguments(step: Step, env: dict[str, str], server: str) -> list[str]:
    words = step.arguments(env)
    return [server if k and words[k - 1] == "--server" else word for k, word in enumerate(words)]


def _matches(shown: tuple[str, ...], printed: str) -> bool:
    """The page's lines appear in the output in order; a `...` line on the page skips any lines."""
    wanted = [line for line in normalized("\n".join(shown)) if line]
    got = [line for line in normalized(re.sub(r"\d\.\de-1\d \([\w.]+\)", "E (tensor)", printed)) if line]
    at = 0
    skipping = False
    for line in (re.sub(r"\d\.\de-1\d \([\w.]+\)", "E (tensor)", w) for w in wanted):
        if line == "...":
            skipping = True
            continue
        while at < len(got) and got[at] != line:
            if not skipping:
                return False
            at += 1
        if at == len(got):
            return False
        at += 1
        skipping = False
    return True


def _serve(argv: list[str], folder: Path, env: dict[str, str]) -> tuple[int, str]:
    """`autotune serve ...` until it prints where it answers (then stopped), on a port of its own."""
    argv = [word if not (k and argv[k - 1] == "--port") else "0" for k, word in enumerate(argv)]
    if "--database-url" not in argv and "AUTOTUNE_DATABASE_URL" not in env:
        argv += ["--database-url", f"sqlite:///{folder / 'store.db'}"]
    with subprocess.Popen(
        [*_autotune(), *argv], cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stderr is not None
        line = process.stderr.readline().strip()
        process.terminate()
        process.wait(timeout=30)
    return (0 if line.startswith("autotune: the dashboard at") else 1), line


def _run_block(block: Block, server: LiveServer, scratch: Path) -> list[tuple[Step, str, float, str]]:
    folder = scratch / f"{Path(block.page).stem}-{block.line}"
    shutil.copytree(REPO / "examples", folder / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    env = server.env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    rows = []
    for step in block.steps:
        if step.kind == "setup":
            run_setup(step, folder, env)
            continue
        if step.kind == "other":
            rows.append((step, "not run", 0.0, f"not autotune: {step.text.split()[0]}"))
            continue
        why = _cannot_run(step)
        if why is not None:
            rows.append((step, "cannot run here", 0.0, f"needs {why}"))
            continue
        command_env = {**env, **dict(step.env)}
        if "AUTOTUNE_URL" in command_env:
            command_env["AUTOTUNE_URL"] = server.url
        argv = _arguments(step, command_env, server.url)
        started = time.perf_counter()
        if argv[0] == "serve":
            code, printed = _serve(argv, folder, {k: v for k, v in command_env.items() if k != "AUTOTUNE_DATABASE_URL"})
        else:
            redirected = step.after.split(">", 1)[1].strip() if step.after.startswith(">") else None
            with open(folder / redirected, "w") if redirected else open(os.devnull, "w") as into:
                done = subprocess.run(
                    [*_autotune(), *argv], cwd=folder, env=command_env, text=True, timeout=TIMEOUT_SECONDS,
                    stdout=into if redirected else subprocess.PIPE,  # `> estimate.json`: the shell's redirection
                    stderr=subprocess.STDOUT if not redirected else subprocess.PIPE,  # as a terminal shows them
                )  # fmt: skip
            code, printed = done.returncode, (done.stdout or "") + (done.stderr or "")
        seconds = time.perf_counter() - started
        if argv[0] in ("suggest", "profiles") and code == 5:  # a fresh store: the page's profile is not in it
            verdict = "nothing stored here"
        elif step.shown:
            printed += f"\n{code}" if "echo $?" in step.after else ""
            verdict = "as the page shows" if _matches(step.shown, printed) else "DIFFERS from the page"
        else:
            verdict = "ok" if code == 0 or (argv[0] in ("suggest", "profiles") and code == 5) else f"FAILED ({code})"
        last = (printed.strip().splitlines() or [""])[-1]
        rows.append((step, verdict, seconds, last[:140]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="a page's file name (repeat for several)")
    parser.add_argument("--list", action="store_true", help="list the commands, run nothing")
    args = parser.parse_args()
    blocks = [b for b in documented_blocks() if not args.only or Path(b.page).name in args.only]
    if args.list:
        for block in blocks:
            for step in block.steps:
                what = step.text.splitlines()[0] if step.kind != "autotune" else "autotune " + " ".join(step.argv)
                print(f"{step.where:32s} {step.kind:8s} {what[:100]}")
        return 0
    failed = 0
    with tempfile.TemporaryDirectory(prefix="autotune-doc-commands-") as scratch:
        server = start_server(Path(scratch) / "server")
        try:
            print(f"{'where':32s} {'seconds':>8s}  verdict                 command / last line")
            for block in blocks:
                for step, verdict, seconds, last in _run_block(block, server, Path(scratch)):
                    failed += verdict.startswith(("FAILED", "DIFFERS"))
                    command = "autotune " + " ".join(step.argv) if step.kind == "autotune" else step.text
                    print(f"{step.where:32s} {seconds:8.1f}  {verdict:22s}  {command[:110]}", flush=True)
                    if verdict.startswith(("FAILED", "DIFFERS", "cannot", "not run")):
                        print(f"{'':44s}{last}", flush=True)
        finally:
            server.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
