"""Activation checkpointing on the CPU: each policy's exact m_max, its samples per second at m_max and
at the plan for T = 256, and the recommendation by throughput and by memory.

    .venv/bin/python bench/policies.py                     # the GPT example and the 100M GPT, ~minutes
    .venv/bin/python bench/policies.py --cases gpt --output /tmp/policies.json
    .venv/bin/python bench/policies.py --device cuda   # bench/gpu_check.sh: 2 GiB and 12 GiB budgets

For each case and each policy (none, every-2, full): ``probe`` with ``activation_checkpointing`` set
(fake pre-search, then the real trials that confirm m_max on the CPU meter). Then ``--repeats`` timed
runs per policy, going round the policies (none, every-2, full, none, ...) so that a change in a
shared machine's load falls on all of them alike. A run (autotune/measure/throughput.py ``time_sizes``) builds
the model under the policy, runs a warm-up update touching every size, then one update of one
micro-batch of each size (m_max and the plan's) and the optimizer step, each part timed on its own.
An update of the plan costs the sum of its micro-batches plus one step. The recorded figure is the
one the probe would store (the median of each part over the runs); the spread is the slowest and
fastest whole update among the runs. On the CPU the clock is this process's CPU time (one torch
thread: other engineers' processes on the same cores do not count); on CUDA wall time, each run at
least a second. The recommendation is autotune/core/recommend.py's, as the probe's ``recommended:`` line
prints it. Budgets on the CPU: 48 MiB for the GPT example (the issue's figure), 1890 MiB for the
100M GPT (none fits one sample, full a handful); on CUDA 2 GiB and 12 GiB. Headroom 0.10.

Prints a markdown table and writes JSON (default bench/results/policies.json). Figures only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autotune.core.recommend import option_for, recommend
from autotune.measure.meters import make_meter
from autotune.measure.policies import POLICIES
from autotune.measure.strategies import Replicated
from autotune.measure.throughput import Timings, throughput_of, time_sizes
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task

MiB = 1 << 20
CASES = {
    "gpt": "examples/gpt.py:task",
    "gpt-100m": "examples/gpt.py:task_100m",
}
BUDGETS = {
    "cpu": {"gpt": 48 * MiB, "gpt-100m": 1890 * MiB},
    "cuda": {"gpt": 2048 * MiB, "gpt-100m": 12 * 1024 * MiB},
}
TARGET = 256


def probe_policy(spec: str, device: str, budget: int, policy: str) -> dict[str, Any]:
    """The probe under ``policy``: m_max (fake pre-search, real trials confirming it) and the plan."""
    config = ProbeConfig(device=device, budget_bytes=budget, target_batch=TARGET, activation_checkpointing=policy)
    started = time.perf_counter()
    profile = probe(load_task(spec), config)
    assert profile.plan is not None
    real = [t for t in profile.trials if not t.fake]
    return {
        "policy": policy,
        "max_micro_batch": profile.max_micro_batch,
        "real_trials": len(real),
        "fake_trials": len(profile.trials) - len(real),
        "fits_at_max": next(t.fits for t in real if t.micro_batch == profile.max_micro_batch),
        "next_fits": next((t.fits for t in real if t.micro_batch == profile.max_micro_batch + 1), None),
        "peak_at_max": profile.peak_at(profile.max_micro_batch),
        "plan": [list(pair) for pair in profile.plan.micro_batches],
        "accumulation_steps": profile.plan.accumulation_steps,
        "probe_seconds": round(time.perf_counter() - started, 2),
        "profile": profile,
    }


def timed_run(spec: str, device: str, budget: int, row: dict[str, Any], clock: Any) -> Timings:
    """One timed run (its own model and warm-up update) at m_max and the plan's sizes."""
    task = dataclasses.replace(load_task(spec), activation_checkpointing=row["policy"])
    sizes = sorted({row["max_micro_batch"], *(size for size, _ in row["plan"])})
    meter = make_meter(device, budget)
    try:
        min_seconds = 0.0 if device == "cpu" else 1.0
        return time_sizes(task, meter, Replicated(1), sizes, repeats=1, min_seconds=min_seconds, clock=clock)
    finally:
        meter.close()


def merged(runs: list[Timings]) -> Timings:
    """The runs as one Timings whose repeat r is run r."""
    sizes = runs[0].per_size
    return Timings(
        per_size={size: [t for run in runs for t in run.per_size[size]] for size in sizes},
        steps=[t for run in runs for t in run.steps],
    )


def finish(row: dict[str, Any], timings: Timings) -> None:
    """The row's figures from its runs: the recorded one (medians of each part) and the spread of
    whole updates over the runs; the profile gets its throughput as the probe would record it."""
    at_max = [(row["max_micro_batch"], 1)]
    the_plan = [(size, count) for size, count in row["plan"]]
    profile = row["profile"]
    profile.throughput = [throughput_of(timings, at_max)] + (
        [throughput_of(timings, the_plan)] if the_plan != at_max else []
    )

    def rates(update: list[tuple[int, int]]) -> dict[str, Any]:
        samples = sum(size * count for size, count in update)
        per_run = [samples / seconds for seconds in timings.update_seconds(update)]
        recorded = throughput_of(timings, update).samples_per_second
        return {"recorded": recorded, "min": min(per_run), "max": max(per_run), "runs": per_run}

    row["samples_per_second_at_max"] = rates(at_max)
    row["samples_per_second_plan"] = rates(the_plan)
    row["seconds_forward_backward"] = {str(size): times for size, times in timings.per_size.items()}
    row["seconds_step"] = timings.steps


def sizes_text(update: list[tuple[int, int]]) -> str:
    return " + ".join(f"{count}x{size}" for size, count in update)


def spread_text(rate: dict[str, float]) -> str:
    return f"{rate['recorded']:.3g} ({rate['min']:.3g}-{rate['max']:.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per policy, each with its warm-up (default 3)"
    )
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        help="cpu: this process's CPU seconds (default on the CPU: one torch thread, so other processes on a "
        "shared machine do not count); wall: elapsed seconds (default on cuda)",
    )
    parser.add_argument("--device", choices=sorted(BUDGETS), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    parser.add_argument("--output", type=Path, help="default bench/results/policies[_cuda].json")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    clock_name = args.clock or ("cpu" if args.device == "cpu" else "wall")
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    report: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(0),
        "torch_threads": args.threads if args.device == "cpu" else None,
        "clock": clock_name,
        "target_batch": TARGET,
        "headroom": 0.10,
        "cases": {},
    }
    # samples/s: the recorded figure (median of each part), in brackets the slowest and fastest update.
    print("| case | policy | m_max | real/fake trials | samples/s at m_max | plan for T=256 | samples/s of the plan |")
    print("|---|---|---|---|---|---|---|")
    for case in args.cases:
        spec, budget = CASES[case], BUDGETS[args.device][case]
        rows = [probe_policy(spec, args.device, budget, policy) for policy in POLICIES]
        # The runs go round the policies (none, every-2, full, none, ...): a change in the machine's
        # load during the bench falls on every policy alike.
        runs: list[list[Timings]] = [[] for _ in rows]
        for _ in range(args.repeats):
            for index, row in enumerate(rows):
                runs[index].append(timed_run(spec, args.device, budget, row, clock))
        for row, timings in zip(rows, runs, strict=True):
            finish(row, merged(timings))
            print(
                f"| {case} ({budget // MiB} MiB) | {row['policy']} | {row['max_micro_batch']} | "
                f"{row['real_trials']}/{row['fake_trials']} | {spread_text(row['samples_per_second_at_max'])} | "
                f"{sizes_text(row['plan'])} ({row['accumulation_steps']} steps) | "
                f"{spread_text(row['samples_per_second_plan'])} |",
                flush=True,
            )
        options = [option_for(row["profile"]) for row in rows]
        by_throughput = recommend(options, "throughput")
        by_memory = recommend(options, "memory")
        print(f"  {case}: recommended by throughput: {by_throughput.text()}")
        print(f"  {case}: recommended by memory:     {by_memory.text()}")
        report["cases"][case] = {
            "task": spec,
            "budget_bytes": budget,
            "policies": [{k: v for k, v in row.items() if k != "profile"} for row in rows],
            "recommended": {"throughput": by_throughput.policy, "memory": by_memory.policy},
        }
    output = args.output or Path("bench/results") / ("policies.json" if args.device == "cpu" else "policies_cuda.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
