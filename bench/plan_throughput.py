"""Samples per second of a short real training run of the GPT example under the divisor plan and the
balanced plan, same seed, same data, in the same run (CPU).

    .venv/bin/python bench/plan_throughput.py [--budget 24MiB] [--target-batch 256] [--updates 3] [--rounds 2]

The probe measures m_max on the CPU meter within the budget (24 MiB: m_max = 26), then each policy
trains a fresh model from the same seed on the same samples: a map-style dataset fed by
``PlanBatchSampler`` (the plan's micro-batches in order) into ``Accumulator`` (token-weighted group
normalization), AdamW, one update per group. The policies alternate for ``--rounds`` rounds, each
round one warm-up update and then ``--updates`` timed ones; the table has the sums over the rounds.
Both policies see the same samples in the same order, so their losses agree up to float rounding.
No assertions: the figures are what they are on this machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autotune.core.plan import micro_batches_text, plan
from autotune.core.units import parse_bytes
from autotune.loop.accumulate import Accumulator, PlanBatchSampler
from autotune.orchestrate.probe import ProbeConfig, probe

# Run as a script, bench/ is on sys.path but the repo root (examples/) is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import gpt  # noqa: E402

SEED = 0


class Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Map-style: item i is sample i of every tensor of a dict batch."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return int(self.batch["labels"].shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.batch.items()}


def count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"] != gpt.IGNORE_INDEX).sum()


def train(policy: str, m_max: int, target: int, updates: int, data: Samples) -> dict[str, Any]:
    """One warm-up update, then ``updates`` timed ones, from a fresh seeded model."""
    the_plan = plan(m_max, target, policy=policy)  # type: ignore[arg-type]
    torch.manual_seed(SEED)
    model = gpt.GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = Accumulator(model, optimizer, accumulation_steps=the_plan.accumulation_steps)
    sampler = PlanBatchSampler(range((updates + 1) * target), the_plan, drop_last=True)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    seconds, samples, loss_total, tokens = 0.0, 0, 0.0, 0
    for group in acc.groups(loader, count=count):
        started = time.perf_counter()
        group_loss = 0.0
        for batch in group:
            with acc.micro_step():
                total, n = gpt.loss_sum(model, batch)
                acc.backward(total, count=n)
            group_loss += total.item()
        acc.step()
        if group.index == 0:
            continue  # warm-up: allocator and thread pools
        seconds += time.perf_counter() - started
        samples += group.samples
        loss_total += group_loss
        tokens += group.count
    return {
        "plan": the_plan,
        "seconds": seconds,
        "samples": samples,
        "updates": updates,
        "loss": loss_total / max(tokens, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="24MiB")
    parser.add_argument("--target-batch", type=int, default=256)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    profile = probe(gpt.task, ProbeConfig(device="cpu", budget_bytes=parse_bytes(args.budget)))
    m_max, target = profile.max_micro_batch, args.target_batch
    print(
        f"gpt-small on the CPU, budget {args.budget}: m_max = {m_max}; T = {target}; "
        f"{args.rounds} rounds x {args.updates} timed updates per policy; torch threads {torch.get_num_threads()}"
    )
    data = Samples(gpt.make_batch((args.updates + 1) * target, seed=SEED, variable_lengths=True))
    totals: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for policy in ("divisor", "balanced"):
            run = train(policy, m_max, target, args.updates, data)
            total = totals.setdefault(policy, {"plan": run["plan"], "seconds": 0.0, "samples": 0, "updates": 0})
            total["seconds"] += run["seconds"]
            total["samples"] += run["samples"]
            total["updates"] += run["updates"]
            total["loss"] = run["loss"]
    print()
    print("| plan policy | micro-batches per update | steps | updates | samples | seconds | samples/s | token loss |")
    print("|---|---|---|---|---|---|---|---|")
    for policy, total in totals.items():
        p = total["plan"]
        print(
            f"| {policy} | {micro_batches_text(p.micro_batches, p.world_size)} | {p.accumulation_steps} | "
            f"{total['updates']} | {total['samples']} | {total['seconds']:.2f} | "
            f"{total['samples'] / total['seconds']:.1f} | {total['loss']:.6f} |"
        )
    ratio = (totals["balanced"]["samples"] / totals["balanced"]["seconds"]) / (
        totals["divisor"]["samples"] / totals["divisor"]["seconds"]
    )
    print(f"\nbalanced / divisor samples/s: {ratio:.3f}")


if __name__ == "__main__":
    main()
