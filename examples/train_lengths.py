"""Train the GPT example on a skewed length distribution with the length-aware sampler.

Lengths are lognormal (median 120 tokens, clipped to 8-1000), as real text is: most samples short, a
long tail. The script probes ``examples/gpt.py:task_seq`` at a few lengths (or reads the profiles of
such a run, ``--profiles run.json`` from ``autotune probe ... --seq-len ... --json``), builds the
capacity ``L -> m_max(L)`` from them, and trains with ``LengthBatchSampler``: every micro-batch as
large as fits at its own padded length, every update ``--target-tokens`` supervised tokens. On the CPU
the CPU meter holds the budget the whole time (a micro-batch past it would raise an out-of-memory error
as a card does) and gives the peak; on CUDA the peak is ``torch.cuda.max_memory_reserved``.

    python examples/train_lengths.py --samples 2000 --budget 64MiB
    python examples/train_lengths.py --pack-to 1024          # packed rows of 1024 tokens

``--pack-to L`` packs documents into rows of L tokens; attention then runs per document (the
``boundaries`` of each row, a varlen attention done here with one scaled_dot_product_attention per
document), never across documents. ``bench/length_batching.py`` compares both with fixed plans.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per process on a small CPU (tests/conftest.py)

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import Accumulator, Capacity, LengthBatchSampler, PackedRow, capacity, parse_bytes  # noqa: E402
from examples import gpt  # noqa: E402

IGNORE = gpt.IGNORE_INDEX
VOCAB = gpt.GPTConfig().vocab_size


def lognormal_lengths(
    count: int, *, median: int = 120, sigma: float = 1.0, low: int = 8, high: int = 1000, seed: int = 0
) -> list[int]:
    """count lengths, lognormal around median, clipped to [low, high]."""
    rng = random.Random(seed)
    return [min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(count)]


class Documents(Dataset[Any]):
    """Random token documents of the given lengths; a PackedRow key gives the row, documents back to back."""

    def __init__(self, lengths: Sequence[int], *, vocab: int = VOCAB, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.docs = [torch.randint(0, vocab, (length,), generator=gen) for length in lengths]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, key: int | PackedRow) -> Any:
        if isinstance(key, PackedRow):
            return key, [self.docs[i] for i in key.indices]
        return self.docs[key]


def pad_collate(multiple: int = 8) -> Any:
    """Documents right-padded to the longest (rounded up to multiple): input_ids, and next-token
    labels with -100 on padding and on each document's last token."""

    def collate(docs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        longest = -(-max(len(d) for d in docs) // multiple) * multiple
        input_ids = torch.zeros(len(docs), longest, dtype=torch.long)
        labels = torch.full((len(docs), longest), IGNORE, dtype=torch.long)
        for row, doc in enumerate(docs):
            input_ids[row, : len(doc)] = doc
            # From the batch's own tensor: a view of the dataset's (doc[1:]) would be counted by the CPU
            # meter for as long as the dataset lives.
            labels[row, : len(doc) - 1] = input_ids[row, 1 : len(doc)]
        return {"input_ids": input_ids, "labels": labels}

    return collate


def packed_collate(rows: Sequence[tuple[PackedRow, list[torch.Tensor]]]) -> dict[str, Any]:
    """Packed rows: the documents back to back in each row, labels within each document only, and
    the rows' boundaries for the attention."""
    length = rows[0][0].length
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for r, (row, docs) in enumerate(rows):
        for start, doc in zip(row.boundaries, docs, strict=False):
            input_ids[r, start : start + len(doc)] = doc
            labels[r, start : start + len(doc) - 1] = input_ids[r, start + 1 : start + len(doc)]
    return {"input_ids": input_ids, "labels": labels, "boundaries": [row.boundaries for row, _ in rows]}


def _varlen_block(block: gpt.Block, x: torch.Tensor, boundaries: Sequence[Sequence[int]]) -> torch.Tensor:
    """gpt.Block.forward with causal attention within each document of each row (a varlen kernel's
    job, one scaled_dot_product_attention per document here); padding attends to nothing."""
    b, t, c = x.shape
    heads = block.n_heads
    q, k, v = block.qkv(block.ln1(x)).split(c, dim=2)
    q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
    rows = []
    for r, bounds in enumerate(boundaries):
        # 4-D slices: a 3-D call takes the math path, which materializes the L x L scores.
        spans = [(slice(r, r + 1), slice(None), slice(a, e)) for a, e in zip(bounds, bounds[1:], strict=False)]
        parts = [F.scaled_dot_product_attention(q[at], k[at], v[at], is_causal=True) for at in spans]
        if bounds[-1] < t:
            parts.append(q.new_zeros(1, heads, t - bounds[-1], c // heads))
        rows.append(torch.cat(parts, dim=2))
    att = torch.cat(rows, dim=0)
    x = x + block.dropout(block.proj(att.transpose(1, 2).reshape(b, t, c)))
    return x + block.dropout(block.mlp(block.ln2(x)))


def loss_sum(model: gpt.GPT, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Summed token loss and supervised tokens, packed rows attending within their documents."""
    boundaries = batch.get("boundaries")
    if boundaries is None:
        return gpt.loss_sum(model, batch)
    input_ids, labels = batch["input_ids"], batch["labels"]
    x = model.tok(input_ids) + model.pos(torch.arange(input_ids.shape[1]))
    for block in model.blocks:
        x = _varlen_block(block, x, boundaries)
    logits = model.head(model.ln_f(x))
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return total, int((labels != IGNORE).sum())


def supervised(batch: dict[str, Any]) -> torch.Tensor:
    return (batch["labels"] != IGNORE).sum()


def probed_capacity(budget_bytes: int, lengths: Sequence[int], device: str = "cpu") -> Capacity:
    """Probe examples/gpt.py:task_seq at lengths in one run and build its capacity."""
    from autotune import ProbeConfig, probe_lengths

    run = probe_lengths(gpt.task_seq, ProbeConfig(device=device, budget_bytes=budget_bytes), list(lengths))
    return capacity(run.profiles)


class Peak:
    """The peak memory of the training loop: the CPU meter holding the budget on the CPU (an OOM past
    it, as on a card), torch.cuda's reserved peak on CUDA."""

    def __init__(self, device: str, budget_bytes: int) -> None:
        self.device = device
        self.meter: Any = None
        if device == "cpu":
            from autotune import CpuMeter

            self.meter = CpuMeter(budget_bytes)
        else:
            torch.cuda.reset_peak_memory_stats(device)

    def held(self) -> AbstractContextManager[Any]:
        return self.meter.hold() if self.meter is not None else nullcontext()

    def measured(self) -> AbstractContextManager[Any]:
        return self.meter.measure() if self.meter is not None else nullcontext()

    def reading(self) -> int:
        if self.meter is not None:
            return int(self.meter.reading().peak_bytes)
        return int(torch.cuda.max_memory_reserved(self.device))


def train(
    sampler: LengthBatchSampler,
    dataset: Documents,
    *,
    epochs: int = 1,
    device: str = "cpu",
    budget_bytes: int,
    log: Any = print,
) -> dict[str, float]:
    """Train a fresh GPT (task_seq's) with the sampler; tokens per second and the peak."""
    torch.manual_seed(0)
    collate = packed_collate if sampler.pack_to is not None else pad_collate(sampler.pad_to_multiple_of)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    peak = Peak(device, budget_bytes)
    peak_bytes = tokens = updates = 0
    started = time.perf_counter()
    with peak.held():
        model = gpt.task_seq.model().to(device)
        acc = Accumulator(model, gpt.task_seq.make_optimizer(model.parameters()), accumulation_steps=1)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for group in sampler.groups(acc, loader, count=supervised):
                loss = 0.0
                with peak.measured():
                    for batch in group:
                        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                        with acc.micro_step():
                            total, count = loss_sum(model, batch)
                            acc.backward(total, count=count)
                        loss += total.item()
                        del total
                    acc.step()
                peak_bytes = max(peak_bytes, peak.reading())
                tokens += group.count
                updates += 1
                log(f"epoch {epoch} update {updates}: {len(group)} micro-batches, {group.count} tokens, "
                    f"loss {loss / max(group.count, 1):.3f}")
    seconds = time.perf_counter() - started
    return {"tokens_per_second": tokens / seconds, "peak_bytes": peak_bytes, "seconds": seconds, "updates": updates}


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--budget", default="64MiB", help="the memory budget (the CPU meter's; on CUDA the card's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target-tokens", type=int, default=65536)
    parser.add_argument("--pack-to", type=int, default=None)
    parser.add_argument("--seq-len", default="8,120,1000", help="the lengths to probe")
    parser.add_argument("--profiles", type=Path, default=None, help="a run's profiles (JSON array) instead of a probe")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    budget = parse_bytes(args.budget)
    if args.profiles is not None:
        cap = capacity(json.loads(args.profiles.read_text()))
    else:
        cap = probed_capacity(budget, [int(n) for n in args.seq_len.split(",")], args.device)
    print(f"capacity: m_max {cap(8)} at L=8, {cap(120)} at L=120, {cap(1000)} at L=1000 (covers {cap.covered})")
    lengths = lognormal_lengths(args.samples)
    sampler = LengthBatchSampler(lengths, cap, target_tokens=args.target_tokens, pad_to_multiple_of=8,
                                 pack_to=args.pack_to, supervised_tokens=[n - 1 for n in lengths])
    result = train(sampler, Documents(lengths), epochs=args.epochs, device=args.device, budget_bytes=budget)
    print(f"{result['tokens_per_second']:.0f} supervised tokens/s, peak {result['peak_bytes'] / 2**20:.2f} MiB "
          f"of {budget / 2**20:.0f} MiB, {len(sampler)} micro-batches in {result['updates']} updates")
    return result


if __name__ == "__main__":
    main()
