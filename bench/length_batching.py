"""Length-aware batching against fixed plans, on the GPT example over a skewed length distribution.

    .venv/bin/python bench/length_batching.py                  # 1000 samples, 64 MiB: a few minutes here
    .venv/bin/python bench/length_batching.py --samples 4000 --budget 128MiB

One probe of ``examples/gpt.py:task_seq`` on the CPU meter at L = 8, 120, 1000 gives the capacity
``L -> m_max(L)`` (autotune.core.capacity). Lengths are lognormal, median 120, clipped to 8-1000; each
update holds ``--target-tokens`` supervised tokens. One epoch of each plan, in the same run:

- (a) m_max at the longest length (1000) for every micro-batch, random order, padded to the longest of
  each micro-batch: what fits whatever comes;
- (b) m_max at the median length for every micro-batch: fast, until a long micro-batch;
- (c) ``LengthBatchSampler``: each micro-batch within capacity at its own padded length (to 8);
- (d) ``LengthBatchSampler(pack_to=1024)``: rows of 1024 tokens, ``capacity(1024)`` rows per micro-batch,
  attention within each document (examples/train_lengths.py).

For each: micro-batches per epoch, padding (positions that carry no token, of all positions run),
supervised tokens per second of a timed epoch (no meter: its bookkeeping would slow the small
micro-batches most), and the peak of every micro-batch measured on the CPU meter in a second pass,
in the steady state (weights, gradients and AdamW state held), with the out-of-memory errors counted:
micro-batches whose peak passes the budget. The timed passes run one after the other on a machine
that may be busy: the ratios, taken in one run, are the figures to read.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.core.capacity import Capacity  # noqa: E402
from autotune.core.units import parse_bytes  # noqa: E402
from autotune.loop.sampler import LengthBatchSampler  # noqa: E402
from autotune.measure.meters.cpu import CpuMeter  # noqa: E402
from autotune.measure.trial import frozen_heap  # noqa: E402
from examples import gpt  # noqa: E402
from examples.train_lengths import (  # noqa: E402
    Documents,
    lognormal_lengths,
    loss_sum,
    packed_collate,
    pad_collate,
    probed_capacity,
    supervised,
)

PAD = 8
PACK_TO = 1024
PROBE_LENGTHS = (8, 120, 1000)


@dataclass
class Plan:
    """One epoch of one plan: its updates (lists of micro-batches of dataset keys) and its collate."""

    name: str
    updates: list[list[Any]]
    collate: Callable[[Sequence[Any]], dict[str, Any]]
    positions: Callable[[Any], int]  # positions one micro-batch runs (padded size)


def fixed_plan(name: str, lengths: Sequence[int], micro_batch: int, target_tokens: int, seed: int) -> Plan:
    """micro_batch samples in random order for every micro-batch; as many per update as hold about
    target_tokens on average."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    batches = [order[i : i + micro_batch] for i in range(0, len(order), micro_batch)]
    mean = sum(lengths) / len(lengths)
    steps = max(1, round(target_tokens / (micro_batch * mean)))
    updates = [batches[i : i + steps] for i in range(0, len(batches), steps)]
    return Plan(name, updates, pad_collate(PAD), lambda b: len(b) * -(-max(lengths[i] for i in b) // PAD) * PAD)


def sampler_plan(name: str, sampler: LengthBatchSampler) -> Plan:
    collate = packed_collate if sampler.pack_to is not None else pad_collate(PAD)
    return Plan(name, [list(u) for u in sampler.updates()], collate, lambda b: len(b) * sampler.padded_length(b))


def _batches(dataset: Documents, plan: Plan, update: list[Any]) -> list[dict[str, Any]]:
    return [plan.collate([dataset[key] for key in batch]) for batch in update]


def timed_epoch(plan: Plan, dataset: Documents) -> tuple[float, int]:
    """Seconds and supervised tokens of one epoch of training (no meter)."""
    torch.manual_seed(0)
    model = gpt.task_seq.model()
    optimizer = gpt.task_seq.make_optimizer(model.parameters())
    tokens = 0
    started = time.perf_counter()
    for update in plan.updates:
        batches = _batches(dataset, plan, update)
        denominator = sum(int(supervised(b)) for b in batches)
        for batch in batches:
            total, _ = loss_sum(model, batch)
            (total / denominator).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += denominator
    return time.perf_counter() - started, tokens


def metered_peaks(plan: Plan, dataset: Documents, budget_bytes: int, steady: Plan, *, by_shape: bool) -> list[int]:
    """The peak of every micro-batch of the plan (forward, backward, and the update's step after its
    last), on the CPU meter without enforcing the budget, once the weights' gradients and the AdamW
    state exist (one update of ``steady`` first); each micro-batch is collated just before it runs.

    ``by_shape``: a padded micro-batch's peak depends on its shape alone (the CPU meter counts bytes,
    and the probe's surface predicts these peaks to the byte), so each shape (m, padded L) is measured
    once; packed rows, whose attention runs per document, are measured one by one."""
    meter = CpuMeter(budget_bytes)
    peaks: list[int] = []
    known: dict[tuple[int, ...], int] = {}
    with frozen_heap(), meter.hold(), meter.unbounded():
        torch.manual_seed(0)
        model = gpt.task_seq.model()
        meter.adopt(model)
        optimizer = gpt.task_seq.make_optimizer(model.parameters())
        for warm in _batches(dataset, steady, steady.updates[0][:1]):
            loss_sum(model, warm)[0].backward()
        optimizer.step()  # the AdamW state, as in every update after the first
        del warm
        for update in plan.updates:
            for k, keys in enumerate(update):
                last = k == len(update) - 1
                shape = (len(keys), plan.positions(keys), last)
                if by_shape and shape in known:
                    peaks.append(known[shape])
                    continue
                with meter.measure():
                    batch = plan.collate([dataset[key] for key in keys])
                    total, _ = loss_sum(model, batch)
                    total.backward()
                    del total, batch
                    if last:
                        optimizer.step()
                peaks.append(known.setdefault(shape, meter.reading().peak_bytes))
    return peaks


def run(samples: int, budget_bytes: int, target_tokens: int, seed: int) -> dict[str, dict[str, float]]:
    started = time.perf_counter()
    cap: Capacity = probed_capacity(budget_bytes, PROBE_LENGTHS)
    lengths = lognormal_lengths(samples, seed=seed)
    median = sorted(lengths)[len(lengths) // 2]
    print(
        f"probe over L = {', '.join(map(str, PROBE_LENGTHS))} under {budget_bytes / 2**20:.0f} MiB: "
        f"{time.perf_counter() - started:.1f} s; m_max {cap(8)} at L=8, {cap(median)} at the median L={median}, "
        f"{cap(1000)} at L=1000, {cap(PACK_TO)} rows of {PACK_TO}; covers L {cap.covered[0]}..{cap.covered[1]}"
    )
    print(f"{samples} samples, {sum(lengths)} tokens (lognormal, median {median}, 8..1000), "
          f"{target_tokens} tokens per update, budget {budget_bytes} bytes")
    dataset = Documents(lengths)
    common: dict[str, Any] = dict(target_tokens=target_tokens, supervised_tokens=[n - 1 for n in lengths], seed=seed)
    plans = [
        fixed_plan(f"(a) m_max at L=1000 (m={cap(1000)})", lengths, cap(1000), target_tokens, seed),
        fixed_plan(f"(b) m_max at L={median} (m={cap(median)})", lengths, cap(median), target_tokens, seed),
        sampler_plan("(c) LengthBatchSampler", LengthBatchSampler(lengths, cap, pad_to_multiple_of=PAD, **common)),
        sampler_plan(f"(d) packed into rows of {PACK_TO}", LengthBatchSampler(lengths, cap, pack_to=PACK_TO, **common)),
    ]
    results: dict[str, dict[str, float]] = {}
    for plan in plans:
        seconds, tokens = timed_epoch(plan, dataset)
        peaks = metered_peaks(plan, dataset, budget_bytes, plans[2], by_shape=plan is not plans[3])
        positions = sum(plan.positions(b) for u in plan.updates for b in u)
        results[plan.name] = {
            "micro_batches": sum(len(u) for u in plan.updates),
            "updates": len(plan.updates),
            "padding": 1 - sum(lengths) / positions,
            "tokens_per_second": tokens / seconds,
            "peak_bytes": max(peaks),
            "ooms": sum(peak > budget_bytes for peak in peaks),
        }
    base = results[plans[0].name]["tokens_per_second"]
    print(f"\n{'plan':36} {'micro-batches':>13} {'updates':>7} {'padding':>8} {'tokens/s':>9} {'vs (a)':>7} "
          f"{'peak MiB':>9} {'OOMs':>5}")
    for name, row in results.items():
        print(f"{name:36} {row['micro_batches']:13.0f} {row['updates']:7.0f} {row['padding']:8.1%} "
              f"{row['tokens_per_second']:9.0f} {row['tokens_per_second'] / base:6.2f}x "
              f"{row['peak_bytes'] / 2**20:9.2f} {row['ooms']:5.0f}")
    print(f"\nbudget {budget_bytes / 2**20:.2f} MiB (limit {budget_bytes * 0.9 / 2**20:.2f} MiB with 10 % headroom); "
          f"{time.perf_counter() - started:.0f} s in all")
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--budget", default="64MiB")
    parser.add_argument("--target-tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    run(args.samples, parse_bytes(args.budget), args.target_tokens, args.seed)


if __name__ == "__main__":
    main()
