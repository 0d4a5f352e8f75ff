"""The GPT example at one budget: ddp on one device beside fsdp as rank 0 of N = 2, 4, 8 (CPU meter).

    .venv/bin/python bench/fsdp_table.py                  # 24 MiB, headroom 0.10
    .venv/bin/python bench/fsdp_table.py --budget-mib 12

Per row: m_max found by the probe (fake pre-search, then real trials), the per-rank peak of one trial
at m = 8, the probe's real and fake trials and its wall seconds. Figures only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.core.units import format_bytes  # noqa: E402
from autotune.measure.meters import CpuMeter  # noqa: E402
from autotune.measure.strategy_choice import make_strategy  # noqa: E402
from autotune.measure.trial import TrialRunner  # noqa: E402
from autotune.orchestrate.probe import ProbeConfig, probe  # noqa: E402
from examples import gpt  # noqa: E402

MiB = 1 << 20
SETUPS = [("ddp", 1), ("fsdp", 2), ("fsdp", 4), ("fsdp", 8)]


def peak_at(strategy_name: str, world_size: int, micro_batch: int) -> int:
    strategy = make_strategy(strategy_name, world_size)
    meter = CpuMeter(1 << 40)
    with strategy.process_group(meter.device):
        runner = TrialRunner(gpt.task, meter, limit_bytes=1 << 40, strategy=strategy)
        try:
            return runner(micro_batch).peak_bytes
        finally:
            runner.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mib", type=float, default=24.0)
    parser.add_argument("--micro-batch", type=int, default=8, help="m of the per-rank peak column")
    args = parser.parse_args(argv)
    budget = int(args.budget_mib * MiB)
    print(f"gpt-small, budget {format_bytes(budget)}, headroom 0.10, CPU meter\n")
    print(f"| strategy | N | m_max | per-rank peak at m={args.micro_batch} | real trials | fake trials | seconds |")
    print("|---|---|---|---|---|---|---|")
    for name, world_size in SETUPS:
        started = time.perf_counter()
        profile = probe(gpt.task, ProbeConfig(device="cpu", budget_bytes=budget, strategy=name, world_size=world_size))
        seconds = time.perf_counter() - started
        fake = sum(1 for t in profile.trials if t.fake)
        peak = format_bytes(peak_at(name, world_size, args.micro_batch))
        print(
            f"| {name} | {world_size} | {profile.max_micro_batch} | {peak} "
            f"| {profile.trial_count} | {fake} | {seconds:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
