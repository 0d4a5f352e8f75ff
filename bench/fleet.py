"""`autotune fleet` beside the same probes run one after another with `autotune probe`, in one run.

    .venv/bin/python bench/fleet.py                   # the three examples x two budgets: 6 probes
    .venv/bin/python bench/fleet.py --budgets 8MiB --ray-address 127.0.0.1:6379   # an existing cluster

Both sides run the commands as a user would, from the repository root, on the CPU meter, and write
their profiles to a scratch folder (no server: uploads are the same on both sides and not what is
timed). The sequential side is 6 `autotune probe` processes, each paying its own start-up (Python,
torch) and running its probe with torch's threads on every core; the fleet side is one `autotune
fleet` process whose wall time includes starting a local Ray instance (without --ray-address),
shipping the working directory and one fresh worker process per probe, on as many probes at once as
Ray has CPUs (one torch thread each). The table gives both wall times and their ratio, with the
sum of the probes' own seconds as the fleet's workers reported them.
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

from autotune.cli.common import size

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = ["examples/mlp.py:task", "examples/gpt.py:task", "examples/cnn.py:task"]
TARGET_BATCH = "256"


def _autotune() -> list[str]:
    script = Path(sys.executable).with_name("autotune")
    return [str(script)] if script.exists() else [sys.executable, "-m", "autotune.cli"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}


def _run(argv: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(argv)}\n{done.stderr[-3000:]}")
    return seconds, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="8MiB,16MiB", help="comma list (default 8MiB,16MiB)")
    parser.add_argument("--ray-address", help="an existing Ray cluster (default: a local instance per run)")
    args = parser.parse_args()
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    pairs = [(spec, budget) for spec in EXAMPLES for budget in budgets]

    with tempfile.TemporaryDirectory(prefix="autotune-bench-fleet-") as scratch:
        sequential_seconds = 0.0
        for index, (spec, budget) in enumerate(pairs):
            seconds, _ = _run(
                [*_autotune(), "probe", spec, "--device", "cpu", "--budget", budget, "--target-batch", TARGET_BATCH,
                 "--output", str(Path(scratch) / "sequential" / f"{index}.json")]
            )  # fmt: skip
            print(f"probe {spec} at {budget}: {seconds:.1f}s", file=sys.stderr)
            sequential_seconds += seconds

        fleet_argv = [*_autotune(), "fleet", *EXAMPLES, "--device", "cpu", "--budget", ",".join(budgets),
                      "--target-batch", TARGET_BATCH, "--output", str(Path(scratch) / "fleet"), "--json"]  # fmt: skip
        if args.ray_address:
            fleet_argv += ["--ray-address", args.ray_address]
        fleet_seconds, done = _run(fleet_argv)
        rows = json.loads(done.stdout)
        worker_seconds = sum(float(row["seconds"]) for row in rows)
        assert len(rows) == len(pairs) and all(row["state"] == "done" for row in rows), done.stdout
        # What tests/fleet/test_fleet.py asserts on two examples at 4 and 6 MiB, here at full size: the rows
        # in tasks x budgets order, each planned to the target batch, every pair logged done.
        assert [(row["task"], row["budget_bytes"]) for row in rows] == [(s, size(b)) for s, b in pairs], rows
        assert all(f" = {TARGET_BATCH} (" in str(row["plan"]) for row in rows), rows
        assert f"{len(pairs)} done, 0 failed" in done.stderr, done.stderr[-3000:]

    where = args.ray_address or "a local Ray instance started by the command"
    print(f"{len(pairs)} probes (3 examples x {len(budgets)} budgets, CPU meter), {os.cpu_count()} cores")
    print()
    print("| run | wall seconds | ratio |")
    print("|---|---|---|")
    print(f"| `autotune probe` x {len(pairs)}, one after another | {sequential_seconds:.1f} | 1.00 |")
    print(f"| `autotune fleet`, {where} | {fleet_seconds:.1f} | {fleet_seconds / sequential_seconds:.2f} |")
    print()
    print(f"fleet workers' own seconds per probe, summed: {worker_seconds:.1f} (load, probe; Ray start-up excluded)")


if __name__ == "__main__":
    main()
