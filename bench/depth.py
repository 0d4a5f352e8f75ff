"""What an emulated estimate costs against the depth of the model (issue 64, autotune/search/depth.py): the estimate
of a deep model (the shortcut: a few blocks walked, the rest repeated) against the same model cut to 4 blocks (walked
whole: too few to repeat), in one run, and against ``--full-walk`` (every block walked), with every figure of the two
compared.

    nice .venv/bin/python bench/depth.py                       # the 8B and 70B rows (tens of minutes)
    nice .venv/bin/python bench/depth.py --only 8b --no-full   # the 8B's ratio only
    nice .venv/bin/python bench/depth.py --rows recipes        # every row of bench/recipes.py, before and after
    nice .venv/bin/python bench/depth.py --rows meshes         # every row of bench/meshes.py, before and after

- **8b**: Llama 3.1 8B, FSDP over 8 H100 96 GB, bf16, L 8192, op-level SAC, local batch 2 (bench/recipes.py's first
  row, torchtitan's Table 1), 32 blocks.
- **70b**: Llama 3.1 70B, FSDP 8 x TP 8 over 64 H100 80 GB, bf16, L 8192, full checkpointing (bench/meshes.py's
  "fsdp 8 x tp 8"), 80 blocks.

Each estimate is `autotune estimate ... --json` in a child process, as a user runs it: its wall seconds and peak RSS
(the CLI's and its emulation child's, by wait4). "same" says whether the shortcut's profile and the full walk's agree
on every trial (reserved, allocated, the phases, the verdict), the breakdown and the pipeline's stages. The ratios are
of times measured in this run (the machine's speed varies). Figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import meshes  # the bench's own rows (this folder is on the path of a script run from it)
import recipes

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30

MODELS = {
    "8b": (recipes.RECIPES[0].args[0], recipes.RECIPES[0].args[1:]),
    "70b": (meshes.MODELS["70b"], (*meshes.COMMON, *meshes.MESHES_64["fsdp 8 x tp 8"])),
}
CUT = 4


def estimate(spec: str, args: tuple[str, ...]) -> dict[str, Any]:
    """One `autotune estimate` in a child process: its profile (or error), wall seconds and peak RSS."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "profile.json"
        command = [sys.executable, "-m", "autotune.cli", "estimate", spec, *args, "--output", str(out)]
        started = time.perf_counter()
        with open(Path(folder) / "err", "w+") as err:
            process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(process.pid, 0)
            err.seek(0)
            lines = [line for line in err.read().splitlines() if line.startswith("autotune:")]
        found: dict[str, Any] = {"seconds": time.perf_counter() - started, "rss_bytes": usage.ru_maxrss * 1024}
        if os.waitstatus_to_exitcode(status) != 0 or not out.exists():
            found["error"] = lines[-1] if lines else "no profile written"
            return found
        profile = json.loads(out.read_text())
    found["profile"] = profile[0] if isinstance(profile, list) else profile
    return found


def cut(spec: str, blocks: int, folder: Path) -> str:
    """The hf: spec with its config's layers cut to ``blocks`` (a copy of the config, its query kept)."""
    path, _, query = spec.removeprefix("hf:").partition("?")
    config = json.loads((REPO / path).read_text())
    config["num_hidden_layers"] = blocks
    written = folder / f"cut-{blocks}.json"
    written.write_text(json.dumps(config))
    return f"hf:{written}" + (f"?{query}" if query else "")


def figures(profile: dict[str, Any]) -> dict[str, Any]:
    """What the two walks must agree on: every trial but its seconds, the breakdown, the stages, m_max."""
    trials = [{k: v for k, v in t.items() if k != "seconds"} for t in profile["trials"]]
    return {
        "max_micro_batch": profile["max_micro_batch"],
        "trials": trials,
        "breakdown": profile.get("breakdown"),
        "pipeline": profile.get("pipeline"),
    }


def depth_line(profile: dict[str, Any]) -> str:
    return next((w for w in profile.get("warnings", []) if w.startswith("depth:")), "")


def row(label: str, found: dict[str, Any], extra: str = "") -> None:
    seconds, rss = found["seconds"], found["rss_bytes"] / GiB
    if "error" in found:
        print(f"  {label:34} {seconds:7.0f} s {rss:6.2f} GiB  {found['error']}", flush=True)
        return
    profile = found["profile"]
    trial = next((t for t in profile["trials"] if not t.get("oom")), None)
    outside = (trial or {}).get("outside_allocator_bytes") or 0
    reserved = "-" if trial is None else f"{(trial['peak_bytes'] - outside) / GiB:.2f}"
    print(
        f"  {label:34} {seconds:7.0f} s {rss:6.2f} GiB  m_max {profile['max_micro_batch']:>3}  "
        f"reserved@m{trial['micro_batch'] if trial else '-'} {reserved} GiB  {extra}",
        flush=True,
    )


def model_rows(name: str, full: bool) -> None:
    spec, args = MODELS[name]
    with tempfile.TemporaryDirectory() as folder:
        print(f"{name}: {spec} {' '.join(args)}")
        short = estimate(spec, args)
        row("shortcut (every block's bytes)", short, depth_line(short.get("profile", {}))[:110])
        cut_found = estimate(cut(spec, CUT, Path(folder)), args)
        row(f"cut to {CUT} blocks (walked whole)", cut_found)
        if "error" not in short and "error" not in cut_found:
            print(f"  ratio shortcut / cut to {CUT}: {short['seconds'] / cut_found['seconds']:.2f}", flush=True)
        if full:
            whole = estimate(spec, (*args, "--full-walk"))
            same = "error" not in whole and "error" not in short
            same = same and figures(short["profile"]) == figures(whole["profile"])
            row("--full-walk", whole, f"same figures as the shortcut: {same}")
            if "error" not in whole and "error" not in short:
                print(f"  ratio full walk / shortcut: {whole['seconds'] / short['seconds']:.2f}", flush=True)


def before_after(which: str) -> None:
    """Every row of bench/recipes.py or bench/meshes.py, with --full-walk (before) and without (after)."""
    if which == "recipes":
        jobs = [(r.name, r.args[0], r.args[1:]) for r in recipes.RECIPES]
    else:
        jobs = [
            (f"{model} {mesh}", meshes.MODELS[model], (*meshes.COMMON, *mesh_args))
            for model, table in meshes.MESHES_OF.items()
            for mesh, mesh_args in table.items()
        ]
    print(f"{'row':44} {'before s':>9} {'after s':>8} {'ratio':>6} {'RSS before':>11} {'RSS after':>10}  same")
    for label, spec, args in jobs:
        before = estimate(spec, (*args, "--full-walk"))
        after = estimate(spec, args)
        same: Any = "-"
        if "error" not in before and "error" not in after:
            same = figures(before["profile"]) == figures(after["profile"])
        elif "error" in before and "error" in after:
            same = before["error"] == after["error"]
        print(
            f"{label:44} {before['seconds']:9.0f} {after['seconds']:8.0f} {before['seconds'] / after['seconds']:6.2f} "
            f"{before['rss_bytes'] / GiB:9.2f} G {after['rss_bytes'] / GiB:8.2f} G  {same}  "
            f"{depth_line(after.get('profile', {}))[:60] or after.get('error', '')}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--only", choices=sorted(MODELS), help="one model")
    parser.add_argument("--no-full", action="store_true", help="leave out the --full-walk runs")
    parser.add_argument("--rows", choices=("recipes", "meshes"), help="every row of that bench, before and after")
    args = parser.parse_args(argv)
    if args.rows:
        before_after(args.rows)
        return 0
    for name in MODELS:
        if args.only in (None, name):
            model_rows(name, full=not args.no_full)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
