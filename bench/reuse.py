"""Model reuse on the ~100M-parameter GPT: autotune's probe before and after, beside Lightning's binsearch.

    .venv/bin/pip install -e '.[bench]'        # pytorch-lightning (keep the torch you have)
    .venv/bin/python bench/reuse.py            # about half an hour on 2 shared cores
    .venv/bin/python bench/reuse.py --methods autotune lightning-binsearch --output /tmp/reuse.json

One task, ``examples/gpt.py:task_100m`` (12 layers, d_model 768, seq 256, vocab 8192: ~98 M
parameters), one CPU-meter budget, headroom 0.10, each method in a fresh process of its own, one after
another (``--in-process``: all in this one, where the first pays for the process's warm-up):

- ``autotune``: ``probe(task, ProbeConfig(device="cpu", budget_bytes=B, headroom=0.10))`` as it is
  now: fake-tensor pre-search, then real trials, one model built for the probe and reused;
- ``autotune-fresh``: the same with ``reuse_model=False`` (a fresh model per real trial);
- ``autotune-old``: ``presearch=False, reuse_model=False``: the probe before both changes;
- ``lightning-binsearch``: ``Tuner(trainer).scale_batch_size(mode="binsearch")`` under the peer meter
  (bench/_peers_lightning.py, init_val 2, steps_per_trial 2 with accumulate_grad_batches 2, margin 0).

The budget puts m_max at 8: on the CPU meter this model peaks at 2,988,862,044 bytes at m = 8 and
3,166,798,428 at m = 9 (fake and real trials agree to the byte), 177,936,384 bytes a sample; 3262 MiB
gives a limit B x 0.9 = 3,078,409,420 bytes, 89.5 MB above the first and 88.4 MB below the second.
The truth is read from the real trials the methods run (every method runs m = 8 and m = 9 for real,
or one next to them): m_true is the largest m measured to fit when the next m was measured not to
fit; ``--truth`` adds an exhaustive real search from 1 (expensive: a real trial at m = 8 takes
~75 CPU seconds here).

Prints a markdown table (m found, m_true, real and fake trials, OOMs, wall and CPU seconds, seconds
spent in fake trials, autotune/Lightning wall ratio) and writes JSON (default bench/results/reuse.json).
Figures only: never part of the test run's pass/fail.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

try:
    from _peers_lightning import PeerRun, PeerTrial, run_lightning
except ModuleNotFoundError as exc:  # pytorch-lightning (the `bench` extra) is not installed
    MISSING_BENCH_EXTRA: ModuleNotFoundError | None = exc
else:
    MISSING_BENCH_EXTRA = None
from _peers_meter import PeerMeter

from autotune.measure.meters import CpuMeter
from autotune.measure.trial import run_trial
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
HEADROOM = 0.10
SPEC = "examples/gpt.py:task_100m"
BUDGET_MIB = 3262  # m_max = 8 (see the docstring)
SKIPPED_EXIT = 3
AUTOTUNE_CONFIGS: dict[str, dict[str, bool]] = {
    "autotune": {},
    "autotune-fresh": {"reuse_model": False},
    "autotune-old": {"presearch": False, "reuse_model": False},
}
METHODS = ("autotune", "lightning-binsearch", "autotune-fresh", "autotune-old")


def run_autotune(
    task: Any, budget_bytes: int, *, presearch: bool = True, reuse_model: bool = True
) -> tuple[PeerRun, dict[str, Any]]:
    """The probe with these ProbeConfig settings: the run in a peer's shape, and the fake trials apart."""
    wall, cpu = time.perf_counter(), time.process_time()
    config = ProbeConfig(
        device="cpu", budget_bytes=budget_bytes, headroom=HEADROOM, presearch=presearch, reuse_model=reuse_model
    )
    profile = probe(task, config)
    run = PeerRun(name="autotune", micro_batch=profile.max_micro_batch)
    run.seconds = round(time.perf_counter() - wall, 3)
    run.cpu_seconds = round(time.process_time() - cpu, 3)
    real = [t for t in profile.trials if not t.fake]
    fake = [t for t in profile.trials if t.fake]
    run.trials = [PeerTrial(t.micro_batch, t.oom, round(t.seconds, 3), 0) for t in real]
    extra = {
        "trial_count": profile.trial_count,
        "fake_trials": len(fake),
        "fake_seconds": round(sum(t.seconds for t in fake), 3),
        "real_fits": {t.micro_batch: t.fits for t in real},
        "fake_log": [(t.micro_batch, t.peak_bytes, t.fits, round(t.seconds, 3)) for t in fake],
        "real_log": [(t.micro_batch, t.peak_bytes, t.fits, t.oom, round(t.seconds, 3)) for t in real],
        "warnings": profile.warnings,
    }
    return run, extra


def truth_from_trials(fits: dict[int, bool]) -> int | None:
    """The largest m measured to fit whose m + 1 was measured not to fit (None if no such pair)."""
    pairs = [m for m, ok in fits.items() if ok and fits.get(m + 1) is False]
    return max(pairs) if pairs else None


def exhaustive(task: Any, budget_bytes: int, upto: int) -> tuple[int, list[int]]:
    meter = CpuMeter(budget_bytes)
    limit = int(budget_bytes * (1 - HEADROOM))
    try:
        fitting = [m for m in range(1, upto + 1) if run_trial(task, meter, m, limit_bytes=limit).fits]
    finally:
        meter.close()
    return (max(fitting) if fitting else 0), fitting


def _parameters(task: Any) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in task.model().parameters())


def table(result: dict[str, Any]) -> str:
    rows = [
        "| method | m | m_true | real trials (m: fits) | fake trials (s) | OOMs | wall s | CPU s | wall / Lightning |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    light = result["methods"].get("lightning-binsearch")
    for key, r in result["methods"].items():
        mark = "" if r["micro_batch"] == result["m_true"] else " ≠"
        m = r["micro_batch"] if r["error"] is None else f"error: {r['error'][:40]}"
        log = ", ".join(f"{m_}:{'y' if ok else 'n'}" for m_, ok in r["real_fits"].items())
        fake = f"{r['fake_trials']} ({r['fake_seconds']:.1f})" if r["fake_trials"] is not None else "—"
        ratio = f"{r['seconds'] / light['seconds']:.2f}" if light and key != "lightning-binsearch" else ""
        rows.append(
            f"| {key} | {m}{mark} | {result['m_true']} | {r['trials']} ({log}) | {fake} | {r['ooms']} "
            f"| {r['seconds']:.1f} | {r['cpu_seconds']:.1f} | {ratio} |"
        )
    return "\n".join(rows)


def run_method(key: str, task: Any, budget_bytes: int, limit_bytes: int) -> dict[str, Any]:
    """One method's run, as the JSON keeps it."""
    gc.collect()
    extra: dict[str, Any] = {"fake_trials": None, "fake_seconds": 0.0}
    if key in AUTOTUNE_CONFIGS:
        run, extra = run_autotune(task, budget_bytes, **AUTOTUNE_CONFIGS[key])
    else:
        meter = PeerMeter(limit_bytes)
        try:
            run = run_lightning(task, meter, mode="binsearch")
        finally:
            meter.close()
        extra["real_fits"] = {t.micro_batch: not t.oom for t in run.trials}
    return {
        "micro_batch": run.micro_batch,
        "trials": len(run.trials),
        "ooms": run.oom_count,
        "seconds": run.seconds,
        "cpu_seconds": run.cpu_seconds,
        "error": run.error,
        "trial_log": [vars(t) for t in run.trials],
        **extra,
    }


def run_method_in_child(key: str, args: argparse.Namespace) -> dict[str, Any]:
    """One method in a process of its own. In one process, whichever method runs first pays for the
    process's first large allocations and first kernels at each shape: its trial at m = 8 took 61 s
    where the same trial later took 54 s, and the order decided which method looked faster."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "method.json"
        command = [
            sys.executable, __file__, "--one", key, "--spec", args.spec, "--budget-mib", str(args.budget_mib),
            "--threads", str(args.threads), "--output", str(out),
        ]  # fmt: skip
        subprocess.run(command, check=True)
        entry: dict[str, Any] = json.loads(out.read_text())
    entry["real_fits"] = {int(m): ok for m, ok in entry["real_fits"].items()}
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", default=SPEC, help="another task (a quick check of the script)")
    parser.add_argument("--budget-mib", type=float, default=BUDGET_MIB)
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every method")
    parser.add_argument("--truth", action="store_true", help="also an exhaustive real search from m = 1")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "reuse.json")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="every method in this process, one after another (default: each in its own)",
    )
    parser.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)  # a child's single method
    args = parser.parse_args(argv)
    if MISSING_BENCH_EXTRA is not None:
        print(f"reuse.py: skipped, the `bench` extra is not installed ({MISSING_BENCH_EXTRA})", file=sys.stderr)
        return SKIPPED_EXIT
    torch.set_num_threads(args.threads)
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")

    task = load_task(str(REPO / args.spec))
    budget = int(args.budget_mib * MiB)
    limit = int(budget * (1 - HEADROOM))
    if args.one:
        args.output.write_text(json.dumps(run_method(args.one, task, budget, limit), default=str) + "\n")
        return 0
    started = time.perf_counter()
    methods: dict[str, dict[str, Any]] = {}
    fits: dict[int, bool] = {}
    for key in args.methods:
        if args.in_process:
            entry = run_method(key, task, budget, limit)
        else:
            entry = run_method_in_child(key, args)
        methods[key] = entry
        for m, ok in entry["real_fits"].items():
            if fits.setdefault(int(m), ok) != ok:
                print(f"reuse.py: m = {m} fits for one method and not for another", file=sys.stderr)
        print(
            f"{key}: m {entry['micro_batch']}, real trials {entry['trials']} {entry['real_fits']}, "
            f"fake {entry['fake_trials']}, OOMs {entry['ooms']}, {entry['seconds']} s wall, "
            f"{entry['cpu_seconds']} s CPU",
            file=sys.stderr,
        )
    m_true = truth_from_trials(fits)
    truth: dict[str, Any] = {"from_real_trials": m_true, "real_fits_seen": dict(sorted(fits.items()))}
    if args.truth:
        found = [r["micro_batch"] for r in methods.values() if r["micro_batch"]]
        m_true, fitting = exhaustive(task, budget, max(found, default=1) + 1)
        truth["exhaustive"] = {"m_true": m_true, "fitting": fitting}
    result: dict[str, Any] = {
        "command": "python bench/reuse.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "task": args.spec,
        "parameters": _parameters(task),
        "budget_mib": args.budget_mib,
        "budget_bytes": budget,
        "limit_bytes": limit,
        "headroom": HEADROOM,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "m_true": m_true,
        "truth": truth,
        "methods": methods,
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    print(table(result))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {args.output} ({result['total_seconds']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
