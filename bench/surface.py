"""One probe over four sequence lengths beside four single-length probes, and the 7B estimate over
four lengths. Figures only (these machines are noisy: ratios are of runs made here, now).

    .venv/bin/python bench/surface.py               # both parts
    .venv/bin/python bench/surface.py --part probe  # the probe comparison (a few minutes)
    .venv/bin/python bench/surface.py --part 7b     # the 7B estimate (under two minutes)

Part 1, as a user runs them, each in a process of its own (the CLI, ``--no-throughput``: the timed
runs after the search are the same either way): ``autotune probe examples/gpt.py:task_seq --seq-len
128,256,512,1024`` (one run: the surface from seven traced fake trials, two real trials per length,
the longest length at m = 1) against ``autotune probe`` of the same task bound to each length (four
runs: two traced fake and two real trials each). Repeated ``--repeats`` times, alternating which goes
first; the median wall seconds and their ratio (target <= 0.5x), the trials of each, and whether the
m of every length agrees (the single-length probe is exact on the CPU).

Part 2: ``autotune estimate examples/gpt.py:task_7b_seq --seq-len 2048,4096,8192,16384 --strategy
fsdp --world-size 8 --budget 80GiB``: wall seconds and the peak RSS of its processes together, sampled
from /proc (the main one and its fake-trial workers, autotune/search/lanes.py; targets < 120 s, < 2 GiB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LENGTHS = (128, 256, 512, 1024)
BUDGET = "64MiB"
TARGET_RATIO = 0.5
TARGET_7B_SECONDS = 120
TARGET_7B_RSS_BYTES = 2 << 30
SEVEN_B_LENGTHS = (2048, 4096, 8192, 16384)

# The same task bound to each length: what a user probes without --seq-len (one probe per length).
BOUND_TASKS = """
from autotune.tasks.load import load_task

task = load_task({spec!r})
{bound}
"""


def _cli(*args: str) -> tuple[float, Any, str]:
    """Run ``autotune ARGS --json`` in a child process: (wall seconds, parsed stdout, stderr)."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli", *args, "--json"], cwd=REPO, capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"autotune {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return seconds, json.loads(done.stdout), done.stderr


def _trials(profiles: list[dict[str, Any]]) -> tuple[int, int]:
    real = sum(1 for p in profiles for t in p["trials"] if not t["fake"])
    fake = sum(1 for p in profiles for t in p["trials"] if t["fake"])
    return real, fake


def _over_lengths_trials(stderr: str) -> tuple[int, int]:
    """Every trial a run printed (the longest-length search's too, which no profile holds)."""
    lines = [line for line in stderr.splitlines() if line.startswith("trial m=")]
    fake = sum(1 for line in lines if " fake " in line)
    return len(lines) - fake, fake


def part_probe(repeats: int, max_seq_len: int | None) -> None:
    spec = str(REPO / "examples" / "gpt.py") + ":task_seq"
    common = ["--device", "cpu", "--budget", BUDGET, "--no-throughput"]
    with tempfile.TemporaryDirectory() as folder:
        bound = Path(folder) / "bound.py"
        bound.write_text(
            BOUND_TASKS.format(spec=spec, bound="\n".join(f"at_{n} = task.at_length({n})" for n in LENGTHS))
        )
        over: list[float] = []
        single: list[float] = []
        for run in range(repeats):
            order = ("over", "single") if run % 2 == 0 else ("single", "over")
            for which in order:
                if which == "over":
                    cap = ["--max-seq-len", str(max_seq_len)] if max_seq_len else []
                    seconds, profiles, stderr = _cli(
                        "probe", spec, "--seq-len", ",".join(map(str, LENGTHS)), *cap, *common
                    )
                    over.append(seconds)
                    over_profiles, over_stderr = profiles, stderr
                else:
                    total = 0.0
                    alone = []
                    for n in LENGTHS:
                        seconds, profile, _ = _cli("probe", f"{bound}:at_{n}", *common)
                        total += seconds
                        alone.append(profile)
                    single.append(total)
                    single_profiles = alone
    over_m = {p["seq_len"]: p["max_micro_batch"] for p in over_profiles}
    single_m = {p["seq_len"]: p["max_micro_batch"] for p in single_profiles}
    ratio = statistics.median(over) / statistics.median(single)
    real, fake = _over_lengths_trials(over_stderr)
    single_real, single_fake = _trials(single_profiles)
    longest = over_profiles[0]["surface"]["longest"]
    print(
        f"part 1: examples/gpt.py:task_seq on the CPU meter, budget {BUDGET}, lengths {', '.join(map(str, LENGTHS))}, "
        f"--max-seq-len {max_seq_len or 'default (4x the longest)'}"
    )
    print(f"  {'':<28} {'median wall s':>13} {'runs':>5} {'real':>5} {'fake':>5}")
    print(f"  {'one probe over 4 lengths':<28} {statistics.median(over):>13.2f} {len(over):>5} {real:>5} {fake:>5}")
    print(
        f"  {'4 single-length probes':<28} {statistics.median(single):>13.2f} {len(single):>5} "
        f"{single_real:>5} {single_fake:>5}"
    )
    print(f"  wall ratio {ratio:.2f}x (target <= {TARGET_RATIO}x): {'met' if ratio <= TARGET_RATIO else 'NOT met'}")
    for n in LENGTHS:
        same = "exact (same as the single-length probe)" if over_m[n] == single_m[n] else "DIFFERS"
        print(f"  L={n:<5} m_max {over_m[n]:>4} vs {single_m[n]:>4}: {same}")
    print(f"  longest L at m=1: {longest['seq_len']} ({longest['limited_by']}), in the one run only")
    print(f"  runs, seconds: over lengths {[round(s, 2) for s in over]}, single {[round(s, 2) for s in single]}")


def _tree_rss_bytes(root: int) -> int:
    """Resident bytes of root and every process under it (the estimate's workers), from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        grew, tree = bool(more), tree | more
    total = 0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def part_7b() -> None:
    command = [
        sys.executable, "-m", "autotune.cli", "estimate",
        "examples/gpt.py:task_7b_seq", "--seq-len", ",".join(map(str, SEVEN_B_LENGTHS)),
        "--budget", "79GiB", "--strategy", "fsdp", "--world-size", "8", "--target-tokens", str(4 << 20),
        "--device-name", "NVIDIA H100 80GB HBM3", "--json",
    ]  # fmt: skip
    started = time.perf_counter()
    child = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rss = 0
    while child.poll() is None:  # the run's processes together: the main one and its fake-trial workers
        rss = max(rss, _tree_rss_bytes(child.pid))
        time.sleep(1.0)  # a scan of /proc costs a few ms of the cores the trials use
    stdout, stderr = child.communicate()
    seconds = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"the 7B estimate failed: {stderr.strip().splitlines()[-2:]}")
    done = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
    profiles = json.loads(done.stdout)
    print("part 2: examples/gpt.py:task_7b_seq, fsdp over 8 ranks, 80 GiB, bf16, by estimate (fake trials)")
    print(f"  {'L':>6} {'m_max':>6} {'tokens/micro-batch':>19} {'plan (4M tokens)':<24} {'fake trials':>11}")
    for p in profiles:
        plan = p["plan"]
        text = " + ".join(f"{count}x{size}" for size, count in plan["micro_batches"]) if plan else "-"
        print(
            f"  {p['seq_len']:>6} {p['max_micro_batch']:>6} {p['max_micro_batch'] * p['seq_len']:>19} "
            f"{text:<24} {len(p['trials']):>11}"
        )
    longest = profiles[0]["surface"]["longest"]
    if longest:
        print(f"  longest L at m=1: {longest['seq_len']} ({longest['limited_by']})")
    print(
        f"  wall {seconds:.1f} s (target < {TARGET_7B_SECONDS} s), peak RSS {rss / 2**30:.2f} GiB, the main process "
        f"and its fake-trial workers together (target < {TARGET_7B_RSS_BYTES / 2**30:.0f} GiB)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["probe", "7b", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=2048,
        help="the one run's cap on the longest length (default 2048: the model's position table, as a user "
        "who knows the context window passes it; 0: the default cap, 4x the longest length, where the search "
        "finds the model's limit by bisection)",
    )
    args = parser.parse_args(argv)
    if args.part in ("probe", "all"):
        part_probe(args.repeats, args.max_seq_len or None)
    if args.part in ("7b", "all"):
        part_7b()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
