"""Emulated-card estimates beside a real card's figures: the calibration to run when a card is lent (issue 44).

    python3 bench/card_calibration.py                    # on the card's machine: probe each case, then estimate it
    .venv/bin/python bench/card_calibration.py --estimates-only --gpu h200   # here: the estimates alone

For each case the real probe (``autotune probe CASE --device cuda``: real trials on the card, the figure each
records being max_memory_reserved + the memory outside the allocator) gives the card's m_max and its figure at
each size it ran; then ``autotune estimate CASE --gpu NAME`` (the emulated card of the catalog that NVML's name
matches) runs under ``--estimate-bound safe`` and ``tight`` at those sizes. Printed: the card's m_max, each
estimate's, and the figures' gap at the card's m_max; then the predicted step time (issue 65: the estimate at the
card's m_max, ``--estimate-bound tight``) against the probe's timed run on the card, part by part (compute against
the measured forward and backward, the optimizer step against the measured one); written:
``bench/results/card_calibration-CARD-DATE.json``
(``--output``), the record a later test or session compares against (the card's figures are the truth there:
the safe m_max must never be above the card's).

The cases (the models built from configs: no weights are needed):
- the GPT example at 2 GiB (the 2026-11-30 H200 record: m_max 1212);
- GPT-2 small (the published config) in fp32 at L 1024 under 16 GiB, with torch's attention kernel and under
  ``--sdpa-backend math`` (the kernel an older torch ran: what the ViT record of issue 44 showed);
- a 4-layer Llama 3.1 (8B's widths) in bf16, FSDP as rank 0 of 8 (a fake process group on the card: FSDP2's
  streams are real, NCCL is not there, so the tight estimate is the one to compare), op-level checkpointing, L 2048.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30

GPT2_SMALL = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
    "n_embd": 768, "n_layer": 12, "n_head": 12, "activation_function": "gelu_new", "resid_pdrop": 0.1,
    "embd_pdrop": 0.1, "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-05,
}  # fmt: skip


def _llama_4_layers() -> dict[str, Any]:
    config = json.loads((REPO / "examples" / "configs" / "llama-3.1-8b.json").read_text())
    return {**config, "num_hidden_layers": 4}


# (name, spec or config, arguments, budget): a config is written to a file and run as hf:FILE.
CASES: list[tuple[str, str | dict[str, Any], tuple[str, ...], str]] = [
    ("gpt-example", "examples/gpt.py:task", (), "2GiB"),
    ("gpt2-small-fp32", GPT2_SMALL, ("--seq-len", "1024", "--max-seq-len", "1024"), "16GiB"),
    ("gpt2-small-fp32-math", GPT2_SMALL, ("--seq-len", "1024", "--max-seq-len", "1024", "--sdpa-backend", "math"),
     "16GiB"),
    ("llama-4-layers-fsdp8-op", _llama_4_layers(),
     ("--seq-len", "2048", "--max-seq-len", "2048", "--strategy", "fsdp", "--world-size", "8", "--precision", "bf16",
      "--ac", "op"), "40GiB"),
]  # fmt: skip


def _autotune(argv: list[str], out: Path, timeout: int) -> dict[str, Any]:
    """One CLI run writing its profile to out: the profile (the first length's), or {"error": its line}."""
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "autotune.cli", *argv, "--no-breakdown", "--output", str(out)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if done.returncode != 0 or not out.exists():
        lines = [line for line in done.stderr.splitlines() if line.startswith("autotune")] or ["no profile written"]
        return {"error": lines[-1]}
    profile = json.loads(out.read_text())
    profile = profile[0] if isinstance(profile, list) else profile
    profile["_seconds"] = round(time.perf_counter() - started, 1)
    return profile


def _figures(profile: dict[str, Any], real: bool) -> dict[int, dict[str, Any]]:
    """Each size's figure (reserved + outside), whether it fit, and its reserved bytes, from the profile's trials
    (the real ones only, for the card's)."""
    found = {}
    for trial in profile.get("trials", []):
        if real and trial.get("fake"):
            continue
        outside = trial.get("outside_allocator_bytes") or 0
        found[int(trial["micro_batch"])] = {
            "figure_bytes": trial["peak_bytes"],
            "reserved_bytes": None if trial.get("oom") else trial["peak_bytes"] - outside,
            "fits": trial["fits"],
        }
    return found


def _card_name() -> str | None:
    """The catalog's short name for this machine's card (NVML's name, as /suggest matches it)."""
    import torch

    if not torch.cuda.is_available():
        return None
    from autotune.core.cards import lookup

    return lookup(torch.cuda.get_device_name(0)).short_name


def calibrate(gpu: str, estimates_only: bool, timeout: int, only: set[str] | None) -> dict[str, Any]:
    record: dict[str, Any] = {"card": gpu, "date": datetime.date.today().isoformat(), "cases": []}
    with tempfile.TemporaryDirectory() as folder:
        for name, spec, args, budget in CASES:
            if only and name not in only:
                continue
            if isinstance(spec, dict):
                path = Path(folder) / f"{name}.json"
                path.write_text(json.dumps(spec))
                spec = f"hf:{path}"
            case: dict[str, Any] = {"case": name, "args": [spec, *args, "--budget", budget]}
            sizes: list[int] = []
            if not estimates_only:
                card = _autotune(
                    ["probe", spec, *args, "--budget", budget, "--device", "cuda"], Path(folder) / "c", timeout
                )
                case["card"] = {"error": card["error"]} if "error" in card else {
                    "max_micro_batch": card["max_micro_batch"], "seconds": card["_seconds"],
                    "torch": card.get("device", {}).get("torch_version"), "figures": _figures(card, real=True),
                }  # fmt: skip
                case["card_throughput"] = card.get("throughput")  # the probe's timed run on the card
                sizes = sorted(case["card"].get("figures", {}))
            for bound in ("safe", "tight"):
                argv = ["estimate", spec, *args, "--budget", budget, "--gpu", gpu, "--estimate-bound", bound]
                if sizes:
                    argv += ["--micro-batches", ",".join(str(m) for m in sizes)]
                found = _autotune(argv, Path(folder) / f"e-{bound}", timeout)
                case[bound] = {"error": found["error"]} if "error" in found else {
                    "max_micro_batch": found["max_micro_batch"], "seconds": found["_seconds"],
                    "figures": _figures(found, real=False),
                    # Where the card could not be emulated, the estimate ran with CPU semantics and says so.
                    "emulated": any(w.startswith("emulated ") for w in found.get("warnings", [])),
                }  # fmt: skip
            m_card = case.get("card", {}).get("max_micro_batch")
            if m_card:  # the step's time at the card's m_max: predicted beside the probe's timed run (issue 65)
                argv = ["estimate", spec, *args, "--budget", budget, "--gpu", gpu, "--estimate-bound", "tight",
                        "--max-micro-batch", str(m_card)]  # fmt: skip
                found = _autotune(argv, Path(folder) / "e-time", timeout)
                case["predicted"] = {"error": found["error"]} if "error" in found else found.get("throughput")
            record["cases"].append(case)
            _print_case(case)
    return record


def _timing_rows(record: dict[str, Any]) -> list[str]:
    """Predicted against measured per part, for each update both have: the card's timed run (the probe's
    throughput: one forward and backward per size, the optimizer step) and the emulated estimate's prediction at the
    card's m_max. The cases run on one card through a fake process group (FSDP2's streams are real, NCCL is not
    there), so the measured step holds no communication: the prediction's exposed communication is shown apart and
    left out of the comparison."""
    rows = []
    for case in record["cases"]:
        timed = {tuple(map(tuple, t["micro_batches"])): t for t in case.get("card_throughput") or []}
        for predicted in case.get("predicted") or []:
            if not isinstance(predicted, dict):
                continue
            update = tuple(map(tuple, predicted["micro_batches"]))
            measured = timed.get(update)
            if measured is None:
                continue
            parts = predicted["parts"]
            compute = predicted["seconds_per_update"] - parts["exposed_communication_seconds"]
            pairs = zip(measured["micro_batch_seconds"], measured["micro_batches"], strict=True)
            forward_backward = sum(count * seconds for (_, seconds), (_, count) in pairs)
            rows.append(
                f"| {case['case']} | {' + '.join(f'{c}x{m}' for m, c in update)} | "
                f"{parts['compute_seconds']:.4g} | {forward_backward:.4g} | "
                f"{parts['compute_seconds'] / forward_backward - 1:+.1%} | {parts['optimizer_seconds']:.4g} | "
                f"{measured['step_seconds']:.4g} | {compute:.4g} | {measured['seconds_per_update']:.4g} | "
                f"{compute / measured['seconds_per_update'] - 1:+.1%} | {parts['exposed_communication_seconds']:.4g} |"
            )
    return rows


def _print_case(case: dict[str, Any]) -> None:
    card = case.get("card", {})
    m_card = card.get("max_micro_batch")
    cells = [case["case"], "-" if m_card is None else str(m_card)]
    for bound in ("safe", "tight"):
        found = case[bound]
        if "error" in found:
            cells += [f"error: {found['error']}", "-"]
            continue
        m = found["max_micro_batch"]
        side = "" if m_card is None else (" (above the card!)" if m > m_card else " (not above)")
        gap = "-"
        at = found["figures"].get(m_card) if m_card is not None else None
        on_card = card.get("figures", {}).get(m_card) if m_card is not None else None
        if at and on_card and at.get("reserved_bytes") and on_card.get("reserved_bytes"):
            gap = f"{100 * (at['reserved_bytes'] / on_card['reserved_bytes'] - 1):+.1f} %"
        cells += [f"{m}{side}", gap]
    print("| " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--gpu", help="the catalog card to emulate (default: the card of this machine)")
    parser.add_argument("--estimates-only", action="store_true", help="no card here: the estimates alone")
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run (default 600)")
    parser.add_argument("--output", type=Path, help="the record's file (default bench/results/...)")
    args = parser.parse_args(argv)
    gpu = args.gpu or _card_name()
    if gpu is None:
        print("no CUDA card here: name the card to emulate with --gpu and run --estimates-only", file=sys.stderr)
        return 2
    if not args.estimates_only and _card_name() is None:
        print("no CUDA card here to probe: --estimates-only runs the estimates alone", file=sys.stderr)
        return 2
    print("| case | card m_max | safe m_max | safe reserved gap at the card's m_max | tight m_max | tight gap |")
    print("|---|---|---|---|---|---|")
    only = set(args.only.split(",")) if args.only else None
    record = calibrate(gpu, args.estimates_only, args.timeout, only)
    out = args.output or REPO / "bench" / "results" / f"card_calibration-{gpu}-{record['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written: {out}")
    timings = _timing_rows(record)
    if timings:  # only where a card was probed: nothing is timed here otherwise
        print("\npredicted (emulated, tight) against measured (the probe's timed run on the card), seconds:")
        print("| case | update | compute predicted | forward+backward measured | gap | optimizer predicted | "
              "optimizer measured | update predicted (no comm) | update measured | gap | exposed comm predicted |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(timings))
    above = [c["case"] for c in record["cases"] if _above(c)]
    if above:
        print(f"the safe estimate's m_max is above the card's in: {', '.join(above)}")
        return 1
    return 0


def _above(case: dict[str, Any]) -> bool:
    card, safe = case.get("card", {}), case.get("safe", {})
    return "max_micro_batch" in card and "max_micro_batch" in safe and safe["max_micro_batch"] > card["max_micro_batch"]


if __name__ == "__main__":
    sys.exit(main())
