"""autotune's probe beside Lightning's BatchSizeFinder and Accelerate's find_executable_batch_size.

    .venv/bin/pip install -e '.[bench]'        # pytorch-lightning and accelerate (keep the torch you have)
    .venv/bin/python bench/peers.py            # 9 cases, a few minutes on 2 cores
    .venv/bin/python bench/peers.py --cases mlp --output /tmp/peers.json
    .venv/bin/python bench/peers.py --device cuda   # 3 cases on one GPU, about a minute (bench/gpu_check.sh)
    .venv/bin/python bench/peers.py --suite m50     # 6 cases at m_true ~ 50 against Lightning binsearch
    .venv/bin/python bench/peers.py --suite m50 --no-presearch --output /tmp/m50_real_only.json

For each example task at three budgets (the cases of tests/autotune/test_probe.py, headroom 0.10), on
the CPU meter:

- autotune: ``probe(task, ProbeConfig(device="cpu", budget_bytes=B, headroom=0.10))``;
- Lightning ``Tuner(trainer).scale_batch_size`` in ``binsearch`` and ``power`` modes (init_val 2,
  margin 0, steps_per_trial 2 with accumulate_grad_batches 2), see bench/_peers_lightning.py;
- Accelerate ``find_executable_batch_size`` from twice the true m, see bench/_peers_accelerate.py;
- the truth: every m from 1 to (largest m anyone found) + 3 with autotune's trial on a fresh meter.

With ``--suite m50`` (issue 13; written to bench/results/peers_m50.json): the three examples and three
transformers models built from small configs (bench/_hf_tasks.py: GPT-2, Llama, BERT MLM; no weights,
nothing downloaded), each at a CPU-meter budget where m_true is about 50 (:data:`M50_CASES`), against
Lightning binsearch only unless ``--peers`` names more. autotune's trials are counted apart: real ones
(and their OOMs) and the fake pre-search's, whose seconds are inside autotune's wall time. A second
table gives one row per case and the summary: exact on every case, the median of real trials, the
most OOMs in a case, the median and worst autotune/Lightning wall ratio.

The same line for everyone: a trial fits when its peak is at most B x (1 - headroom). autotune's meter
has budget B and tells a fit from its measured peak; a peer sees only OOMs, so the peers' meter raises
at B x (1 - headroom), which makes "no OOM" mean "fits" (bench/_peers_meter.py). The peers recognise an
OOM by message text only; the peers' meter raises torch.OutOfMemoryError with the text of PyTorch's
CPU allocator, and the script prints whether each peer recognises autotune's own CPU-meter OOM.

With ``--device cuda`` (one case per example, written to bench/results/peers_cuda.json): autotune probes
with ``device="cuda:0"`` and its CudaMeter (the budget enforced through the allocator's per-process memory
fraction; the figure is max_memory_reserved plus this process's memory outside the allocator); the peers
run the same training step on the GPU under a CudaMeter of budget B x (1 - headroom) that binds only inside
their trials (bench/_peers_meter.py ``CudaPeerMeter``), so their real CUDA OOMs mean "does not fit"; the
truth is the same exhaustive trial with a CudaMeter. The CUDA context and what the allocator keeps (cuBLAS
workspaces) count in the budget and differ between machines, so each CUDA budget is set from the meter's
resting figure, measured after one warm-up trial: B = (resting + room) / (1 - headroom), in whole MiB,
with the room per example in :data:`CUDA_CASES` (chosen for an m_true in the tens to hundreds).

Prints a markdown table (per case and method: m found, m_true, trials, OOMs, wall and CPU seconds,
autotune/peer ratios of trials and wall seconds) and writes it all as JSON. Wall seconds on a shared
machine are noisy; CPU seconds of this process are printed beside them, and every method runs with
the same torch thread count (``--threads``, default 1). Figures only: never part of
the test run's pass/fail.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    from _peers_accelerate import run_accelerate
    from _peers_lightning import PeerRun, PeerTrial, run_lightning
except ModuleNotFoundError as exc:  # pytorch-lightning or accelerate (the `bench` extra) is not installed
    MISSING_BENCH_EXTRA: ModuleNotFoundError | None = exc
else:
    MISSING_BENCH_EXTRA = None
from _peers_meter import PEER_OOM_TEXT, CudaPeerMeter, PeerMeter, cuda_recognition, recognition

from autotune.measure.meters import CpuMeter, CudaMeter, Meter
from autotune.measure.trial import run_trial
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task

# Run as a script, bench/ is on sys.path but the repo root (examples/) is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.cases import CPU_BUDGET_CASES, HEADROOM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
CASES = CPU_BUDGET_CASES
PEERS = ("lightning-binsearch", "lightning-power", "accelerate")
# --device cuda: (example, MiB of room above the CUDA meter's resting figure up to B x (1 - headroom)).
# Chosen for an m_true in the tens to hundreds away from the caching allocator's jumps: a request over
# 1 MiB takes a 20 MiB segment, one of 10 MiB or more a segment of its own. gpt (~0.8 MiB a sample on
# the CPU meter, its largest tensors 64 KiB a sample) and cnn (~0.35 MiB, 64 KiB) stay under m = 160,
# where those tensors reach 10 MiB. The mlp (~5 KiB a sample) is set by the allocator: its input (4 KiB
# a sample) fits the 2 MiB small-pool segments up to m = 256 and needs a 20 MiB segment from m = 257,
# or 12 MiB from m = 2561, so 10 MiB of room puts its m_true at 256 whatever its few small segments take.
CUDA_CASES: list[tuple[str, float]] = [("gpt", 80), ("cnn", 40), ("mlp", 10)]
CUDA_INDEX = 0
# --suite m50: (case, task spec relative to the repo, budget in MiB), the budget's limit B x 0.9 half-way
# between the CPU meter's peaks at m_true and m_true + 1 (fake and real trials agree to the byte). The mlp
# is at 60: up to m = 59 its peak is the optimizer step's (1,657,112 bytes), flat in m, so no budget
# puts its boundary lower and above 1.
M50_CASES: list[tuple[str, str, float]] = [
    ("mlp", "examples/mlp.py:task", 1.7615),  # m_true 60
    ("gpt", "examples/gpt.py:task", 42.954),  # 50
    ("cnn", "examples/cnn.py:task", 19.0646),  # 50
    ("hf-gpt2", "bench/_hf_tasks.py:gpt2", 161.8605),  # 50
    ("hf-llama", "bench/_hf_tasks.py:llama", 109.4814),  # 50
    ("hf-bert", "bench/_hf_tasks.py:bert", 125.3656),  # 50
]
SUITE_PEERS = {"budgets": PEERS, "m50": ("lightning-binsearch",)}
SKIPPED_EXIT = 3  # the `bench` extra is not installed: nothing was compared


def _meter(device: str, budget_bytes: int) -> Meter:
    return CpuMeter(budget_bytes) if device == "cpu" else CudaMeter(CUDA_INDEX, budget_bytes)


def _peer_meter(device: str, limit_bytes: int) -> PeerMeter | CudaPeerMeter:
    return PeerMeter(limit_bytes) if device == "cpu" else CudaPeerMeter(CUDA_INDEX, limit_bytes)


def cuda_resting_bytes(warm_up_spec: str | None = None) -> int:
    """The CUDA meter's figure for no work, after one trial of warm_up_spec at m = 2 (if given).

    The warm-up loads what the first trial loads (kernels, cuBLAS handles and workspaces, which the
    allocator keeps), so that the resting figure is what every later trial starts from.
    """
    meter = CudaMeter(CUDA_INDEX)
    try:
        if warm_up_spec is not None:
            run_trial(load_task(warm_up_spec), meter, 2, limit_bytes=meter.budget_bytes)
        with meter.measure():
            pass
        return meter.reading().peak_bytes
    finally:
        meter.close()


@dataclass
class PreSearch:
    """What autotune's run has beside a peer's: the fake pre-search's trials (their seconds are inside
    the run's wall time) and the profile's warnings (a pre-search that fell back says why there)."""

    fake_trials: int = 0
    fake_seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    # (m, fake peak, real peak) wherever both ran: on the CPU meter they should agree to the byte.
    fake_and_real_peaks: list[tuple[int, int, int]] = field(default_factory=list)
    fake_log: list[tuple[int, bool, float]] = field(default_factory=list)  # (m, fits, seconds) in order


def run_autotune(
    spec: str, budget_bytes: int, device: str = "cpu", *, presearch: bool = True
) -> tuple[PeerRun, PreSearch]:
    """autotune's probe, its real trials in the same shape as a peer's, and its fake ones apart."""
    task = load_task(spec)
    wall, cpu = time.perf_counter(), time.process_time()
    probe_device = "cpu" if device == "cpu" else f"cuda:{CUDA_INDEX}"
    config = ProbeConfig(device=probe_device, budget_bytes=budget_bytes, headroom=HEADROOM, presearch=presearch)
    profile = probe(task, config)
    run = PeerRun(name="autotune", micro_batch=profile.max_micro_batch)
    run.seconds = round(time.perf_counter() - wall, 3)
    run.cpu_seconds = round(time.process_time() - cpu, 3)
    real = [t for t in profile.trials if not t.fake]
    fake = [t for t in profile.trials if t.fake]
    assert len(real) == profile.trial_count, (len(real), profile.trial_count)
    run.trials = [PeerTrial(t.micro_batch, t.oom, round(t.seconds, 4), 0) for t in real]
    fake_peaks = {t.micro_batch: t.peak_bytes for t in fake}
    both = [(t.micro_batch, fake_peaks[t.micro_batch], t.peak_bytes) for t in real if t.micro_batch in fake_peaks]
    fakes = PreSearch(
        len(fake),
        round(sum(t.seconds for t in fake), 3),
        list(profile.warnings),
        both,
        [(t.micro_batch, t.fits, round(t.seconds, 4)) for t in fake],
    )
    return run, fakes


def exhaustive(spec: str, budget_bytes: int, upto: int, device: str = "cpu") -> tuple[int, list[int], float]:
    """(largest fitting m, every fitting m, seconds): autotune's trial at every m from 1 to upto.

    The truth is not a timed contestant, so it runs with the heap that existed before it frozen
    (``gc.freeze``): each trial's ``gc.collect()`` then skips the imported modules' objects, which
    makes a trial on these small models about a hundred times faster and changes no byte it counts.
    """
    task = load_task(spec)
    meter = _meter(device, budget_bytes)
    limit = int(budget_bytes * (1 - HEADROOM))
    started = time.perf_counter()
    frozen = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        fitting = [m for m in range(1, upto + 1) if run_trial(task, meter, m, limit_bytes=limit).fits]
    finally:
        meter.close()
        if not frozen:
            gc.unfreeze()
    return (max(fitting) if fitting else 0), fitting, round(time.perf_counter() - started, 3)


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator else None


class GcClock:
    """Counts and times ``gc.collect()`` calls (each method's own clean-up between trials).

    On these small CPU models a full collection (~0.1-0.2 s with torch, Lightning and Accelerate
    imported) costs more than a trial's compute, so the wall seconds are mostly collections: the
    count and the time are reported beside them so the table says which is which.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0
        self._collect = gc.collect

    def __enter__(self) -> GcClock:
        def collect(*args: Any, **kwargs: Any) -> int:
            started = time.perf_counter()
            try:
                return self._collect(*args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - started

        gc.collect = collect
        return self

    def __exit__(self, *exc: object) -> None:
        gc.collect = self._collect


def _run_peer(device: str, limit: int, run: Any, *args: Any, **kwargs: Any) -> PeerRun:
    """A peer under a fresh peer meter, closed afterwards (the CUDA one resets the memory fraction)."""
    meter = _peer_meter(device, limit)
    try:
        return run(*args, meter, **kwargs)
    finally:
        meter.close()


def run_case(
    name: str,
    budget_mib: float,
    lightning_max_trials: int,
    device: str = "cpu",
    *,
    spec: str | None = None,
    peers: tuple[str, ...] = PEERS,
    presearch: bool = True,
) -> dict[str, Any]:
    """Every method on one case, then the truth; the accelerate start needs the truth, so it runs last.

    spec: the task, relative to the repo (default examples/<name>.py:task); peers: which peers run;
    presearch: autotune's fake pre-search (ProbeConfig.presearch).
    """
    spec = str(REPO / (spec or f"examples/{name}.py:task"))
    budget = int(budget_mib * MiB)
    limit = int(budget * (1 - HEADROOM))
    task = load_task(spec)
    clocks = {key: GcClock() for key in ("autotune", *PEERS)}
    runs: dict[str, PeerRun] = {}
    with clocks["autotune"]:
        runs["autotune"], fakes = run_autotune(spec, budget, device, presearch=presearch)
    for mode in ("binsearch", "power"):
        if f"lightning-{mode}" not in peers:
            continue
        with clocks[f"lightning-{mode}"]:
            runs[f"lightning-{mode}"] = _run_peer(
                device, limit, run_lightning, task, mode=mode, max_trials=lightning_max_trials
            )
    found = [r.micro_batch for r in runs.values() if r.micro_batch is not None]
    m_true, fitting, truth_seconds = exhaustive(spec, budget, max(found, default=1) + 3, device)
    monotone = fitting == list(range(1, m_true + 1))
    if "accelerate" in peers:
        with clocks["accelerate"]:
            runs["accelerate"] = _run_peer(
                device, limit, run_accelerate, task, starting_batch_size=2 * max(m_true, 1)
            )
    auto = runs["autotune"]
    methods = {}
    for key, run in runs.items():
        methods[key] = {
            "micro_batch": run.micro_batch,
            "exact": run.micro_batch == m_true,
            "fits": run.micro_batch is not None and run.micro_batch in fitting,
            "trials": len(run.trials),
            "ooms": run.oom_count,
            "seconds": run.seconds,
            "cpu_seconds": run.cpu_seconds,
            "gc_collects": clocks[key].calls,
            "gc_seconds": round(clocks[key].seconds, 3),
            "error": run.error,
            "trial_log": [vars(t) for t in run.trials],
            **(vars(fakes) if key == "autotune" else {}),
            "autotune_over_peer": None
            if key == "autotune"
            else {
                "trials": _ratio(len(auto.trials), len(run.trials)),
                "ooms": _ratio(auto.oom_count, run.oom_count),
                "seconds": _ratio(auto.seconds, run.seconds),
                "cpu_seconds": _ratio(auto.cpu_seconds, run.cpu_seconds),
            },
        }
    return {
        "task": name,
        "spec": spec.removeprefix(str(REPO) + "/"),
        "budget_mib": budget_mib,
        "budget_bytes": budget,
        "limit_bytes": limit,
        "m_true": m_true,
        "truth_checked_upto": max(found, default=1) + 3,
        "truth_monotone": monotone,
        "truth_seconds": truth_seconds,
        "methods": methods,
    }


def table(cases: list[dict[str, Any]]) -> str:
    """The per-case markdown table."""
    head = (
        "| task | budget | m_true | method | m | trials | fake trials | OOMs | wall s | CPU s | gc.collect n / s "
        "| trials a/p | wall a/p |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for case in cases:
        for key, r in case["methods"].items():
            ratios = r["autotune_over_peer"] or {}
            m = r["micro_batch"] if r["error"] is None else f"error: {r['error'][:40]}"
            mark = "" if r["exact"] else " ≠"
            rows.append(
                f"| {case['task']} | {case['budget_mib']} MiB | {case['m_true']} | {key} | {m}{mark} | {r['trials']} "
                f"| {r.get('fake_trials', '')} | {r['ooms']} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} "
                f"| {r['gc_collects']} / {r['gc_seconds']:.2f} "
                f"| {ratios.get('trials', '') if ratios else ''} | {ratios.get('seconds', '') if ratios else ''} |"
            )
    return "\n".join(rows)


def summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: exact answers, median trials, OOMs and seconds; per peer: the cases autotune does not win."""
    out: dict[str, Any] = {}
    keys = [key for key in ("autotune", *PEERS) if all(key in c["methods"] for c in cases)]
    for key in keys:
        rs = [c["methods"][key] for c in cases]
        out[key] = {
            "exact": sum(r["exact"] for r in rs),
            "cases": len(rs),
            "median_trials": statistics.median(r["trials"] for r in rs),
            "total_ooms": sum(r["ooms"] for r in rs),
            "median_seconds": round(statistics.median(r["seconds"] for r in rs), 3),
            "median_cpu_seconds": round(statistics.median(r["cpu_seconds"] for r in rs), 3),
        }
    for key in keys[1:]:
        out[key]["autotune_not_winning"] = [
            f"{c['task']} {c['budget_mib']} MiB"
            for c in cases
            if not (
                c["methods"]["autotune"]["exact"]
                and c["methods"]["autotune"]["trials"] < c["methods"][key]["trials"]
                and c["methods"]["autotune"]["seconds"] < c["methods"][key]["seconds"]
            )
        ]
    return out


def summary_table(summ: dict[str, Any]) -> str:
    """The per-method medians as a markdown table."""
    rows = [
        "| method | exact m | median trials | OOMs (all cases) | median wall s | median CPU s "
        "| autotune not winning on |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, s in summ.items():
        losing = ", ".join(s.get("autotune_not_winning", [])) or ("—" if key != "autotune" else "")
        rows.append(
            f"| {key} | {s['exact']}/{s['cases']} | {s['median_trials']} | {s['total_ooms']} | {s['median_seconds']} "
            f"| {s['median_cpu_seconds']} | {losing} |"
        )
    return "\n".join(rows)


def case_table(cases: list[dict[str, Any]], peer: str = "lightning-binsearch") -> str:
    """One row per case: autotune (real and fake trials apart) beside one peer, and the wall and CPU ratios."""
    rows = [
        "| case | budget MiB | m_true | autotune m | real trials | fake trials (s) | OOMs | wall s (CPU s) "
        f"| {peer} m / trials / OOMs | wall s (CPU s) | wall a/p | CPU a/p |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        a, p = case["methods"]["autotune"], case["methods"][peer]
        ratios = p["autotune_over_peer"]
        rows.append(
            f"| {case['task']} | {case['budget_mib']} | {case['m_true']} "
            f"| {a['micro_batch']}{'' if a['exact'] else ' ≠'} "
            f"| {a['trials']} | {a['fake_trials']} ({a['fake_seconds']:.2f}) | {a['ooms']} "
            f"| {a['seconds']:.2f} ({a['cpu_seconds']:.2f}) "
            f"| {p['micro_batch']}{'' if p['exact'] else ' ≠'} / {p['trials']} / {p['ooms']} "
            f"| {p['seconds']:.2f} ({p['cpu_seconds']:.2f}) | {ratios['seconds']} | {ratios['cpu_seconds']} |"
        )
    return "\n".join(rows)


def targets(cases: list[dict[str, Any]], peer: str = "lightning-binsearch") -> dict[str, Any]:
    """Issue 13's figures: exact on every case, median real trials, most OOMs, wall (and CPU) ratios to peer."""
    autos = [c["methods"]["autotune"] for c in cases]
    walls = [c["methods"][peer]["autotune_over_peer"]["seconds"] for c in cases]
    cpus = [c["methods"][peer]["autotune_over_peer"]["cpu_seconds"] for c in cases]
    return {
        "exact_on_all": all(a["exact"] for a in autos),
        "exact": f"{sum(a['exact'] for a in autos)}/{len(autos)}",
        "median_real_trials": statistics.median(a["trials"] for a in autos),
        "max_ooms": max(a["ooms"] for a in autos),
        "median_fake_trials": statistics.median(a["fake_trials"] for a in autos),
        "wall_ratio_median": round(statistics.median(walls), 3),
        "wall_ratio_worst": max(walls),
        "cpu_ratio_median": round(statistics.median(cpus), 3),
        "cpu_ratio_worst": max(cpus),
        "fake_equals_real": all(f == r for c in cases for _, f, r in c["methods"]["autotune"]["fake_and_real_peaks"]),
        "presearch_fell_back": {
            c["task"]: [w for w in c["methods"]["autotune"]["warnings"] if w.startswith("fake pre-search skipped")]
            for c in cases
            if any(w.startswith("fake pre-search skipped") for w in c["methods"]["autotune"]["warnings"])
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="*", default=None, help="only these tasks (mlp, gpt, cnn, hf-gpt2, ...)")
    parser.add_argument(
        "--suite",
        choices=("budgets", "m50"),
        default="budgets",
        help="budgets: the examples at three budgets each; m50: examples and transformers models at m_true ~ 50",
    )
    parser.add_argument(
        "--peers", nargs="*", choices=PEERS, default=None, help="default: all (budgets), lightning-binsearch (m50)"
    )
    parser.add_argument(
        "--presearch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="autotune's fake pre-search (--no-presearch: real trials only, ProbeConfig(presearch=False))",
    )
    parser.add_argument("--lightning-max-trials", type=int, default=25, help="Lightning's max_trials (its default)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads for every method (1: steady timings on a shared machine)"
    )
    parser.add_argument(
        "--freeze-heap",
        action="store_true",
        help="gc.freeze() the heap before every method (the same for all): what the times are without "
        "the full collections each method makes between trials",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: the CPU meter, 3 budgets per example; cuda: cuda:0 and its meter, one budget per example",
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="default bench/results/peers.json (cpu), peers_cuda.json (cuda)"
    )
    args = parser.parse_args(argv)
    if args.suite == "m50" and args.device != "cpu":
        parser.error("--suite m50 is a CPU suite")
    peers = tuple(args.peers) if args.peers is not None else SUITE_PEERS[args.suite]
    if args.output is None:
        name = "peers_m50.json" if args.suite == "m50" else f"peers{'' if args.device == 'cpu' else '_cuda'}.json"
        args.output = REPO / "bench" / "results" / name
    if MISSING_BENCH_EXTRA is not None:
        print(
            f"peers.py: skipped, the `bench` extra is not installed ({MISSING_BENCH_EXTRA}): "
            "pip install -e '.[bench]' installs pytorch-lightning and accelerate",
            file=sys.stderr,
        )
        return SKIPPED_EXIT
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"peers.py: --device cuda: CUDA is not available here (torch {torch.__version__})", file=sys.stderr)
        return 2
    # Two intra-op threads on a 2-core machine that other work shares spin against each other and
    # make a trial 10-40x slower and its time noise; one thread is the same for every method.
    torch.set_num_threads(args.threads)

    # Lightning reports each batch size it tries at INFO and gives advice through warnings: not figures.
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    from accelerate.utils.memory import should_reduce_batch_size
    from pytorch_lightning.utilities.memory import is_oom_error

    if args.device == "cpu":
        recognised: dict[str, Any] = {
            "lightning is_oom_error": recognition(is_oom_error),
            "accelerate should_reduce_batch_size": recognition(should_reduce_batch_size),
        }
        print(f"peers recognise (peer meter's OOM text: {PEER_OOM_TEXT!r}): {recognised}", file=sys.stderr)
    else:
        recognised = cuda_recognition(
            {"lightning is_oom_error": is_oom_error, "accelerate should_reduce_batch_size": should_reduce_batch_size},
            CUDA_INDEX,
        )
        print(f"peers recognise a real CUDA OOM under the peer meter: {recognised}", file=sys.stderr)

    if args.freeze_heap:
        gc.freeze()
    if args.suite == "m50":
        table_cases: list[tuple[str, str | None, float]] = M50_CASES  # type: ignore[assignment]
    else:
        table_cases = [(n, None, b) for n, b in (CASES if args.device == "cpu" else CUDA_CASES)]
    selected = [(n, spec, b) for n, spec, b in table_cases if not args.cases or n in args.cases]
    started = time.perf_counter()
    cases = []
    for name, spec, size_mib in selected:
        cuda_facts: dict[str, Any] = {}
        if args.device == "cpu":
            budget_mib = size_mib
        else:
            resting = cuda_resting_bytes(str(REPO / "examples" / f"{name}.py") + ":task")
            budget_mib = math.ceil((resting + size_mib * MiB) / (1 - HEADROOM) / MiB)
            cuda_facts = {"room_mib": size_mib, "resting_bytes": resting}
        case = run_case(
            name, budget_mib, args.lightning_max_trials, args.device, spec=spec, peers=peers, presearch=args.presearch
        )
        if cuda_facts:
            # A resting figure that grew during the case (kernels a peer loaded) moves the line for later methods.
            case.update(cuda_facts, resting_after_bytes=cuda_resting_bytes())
        brief = {
            k: (v["micro_batch"], v["trials"], v.get("fake_trials", 0), v["ooms"], v["seconds"])
            for k, v in case["methods"].items()
        }
        what = "(m, real trials, fake trials, OOMs, s)"
        print(f"{name} {budget_mib} MiB: m_true {case['m_true']}; {what} {brief}", file=sys.stderr)
        cases.append(case)
    summ = summary(cases)
    print(table(cases))
    print()
    print(summary_table(summ))
    suite_targets = None
    if args.suite == "m50" and "lightning-binsearch" in peers:
        suite_targets = targets(cases)
        print()
        print(case_table(cases))
        print()
        print(f"targets (exact on all, median 2 real trials, at most 1 OOM, wall <= 0.35x binsearch): {suite_targets}")
    import accelerate
    import pytorch_lightning

    peer_meter = (
        "CpuMeter accounting, budget = budget x (1 - headroom), enforced only inside peer trials, "
        f"OOM message contains {PEER_OOM_TEXT!r}"
        if args.device == "cpu"
        else "CudaMeter accounting (max_memory_reserved + memory outside the allocator), budget = budget x "
        "(1 - headroom), enforced through the per-process memory fraction only inside peer trials, "
        "the OOM is CUDA's own"
    )
    result: dict[str, Any] = {
        "command": "python bench/peers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "headroom": HEADROOM,
        "peer_meter": peer_meter,
        "versions": {
            "torch": torch.__version__,
            "pytorch_lightning": pytorch_lightning.__version__,
            "accelerate": accelerate.__version__,
            **({"transformers": sys.modules["transformers"].__version__} if "transformers" in sys.modules else {}),
        },
        "torch_threads": torch.get_num_threads(),
        "lightning_max_trials": args.lightning_max_trials,
        "freeze_heap": args.freeze_heap,
        "peers_recognise": recognised,
        "total_seconds": round(time.perf_counter() - started, 1),
        "summary": summ,
        "suite": args.suite,
        "presearch": args.presearch,
        "targets": suite_targets,
        "cases": cases,
    }
    if args.device == "cuda":
        result["device"] = {
            "name": torch.cuda.get_device_name(CUDA_INDEX),
            "cuda": torch.version.cuda,
            "budget": "B = (resting figure after a warm-up trial + room_mib) / (1 - headroom), in whole MiB",
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.output} ({result['total_seconds']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
