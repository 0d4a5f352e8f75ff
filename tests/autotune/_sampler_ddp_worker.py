"""The body of the sampler's DDP test, run in each spawned process (importable by name): the rank's
LengthBatchSampler share (num_replicas and rank from the process group), DDP, the Accumulator's groups
from the sampler, one epoch."""

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from autotune.loop.accumulate import Accumulator
from autotune.loop.sampler import LengthBatchSampler
from examples import gpt

TINY = gpt.GPTConfig(vocab_size=64, seq_len=64, d_model=32, n_heads=2, n_layers=2)
LR = 0.1
TARGET_TOKENS = 300
LENGTHS = [2 + (i * 37) % 61 for i in range(90)]  # 2..62 tokens, uneven


def capacity(length: int) -> int:
    return max(1, 160 // length)


def documents() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, TINY.vocab_size, (n,), generator=gen) for n in LENGTHS]


def pad(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    longest = max(len(d) for d in docs)
    input_ids = torch.zeros(len(docs), longest, dtype=torch.long)
    labels = torch.full((len(docs), longest), gpt.IGNORE_INDEX, dtype=torch.long)
    for row, doc in enumerate(docs):
        input_ids[row, : len(doc)] = doc
        labels[row, : len(doc) - 1] = input_ids[row, 1 : len(doc)]
    return {"input_ids": input_ids, "labels": labels}


def sampler(**kwargs: object) -> LengthBatchSampler:
    return LengthBatchSampler(LENGTHS, capacity, target_tokens=TARGET_TOKENS, seed=1, **kwargs)  # type: ignore[arg-type]


def run(rank: int, world_size: int, rendezvous_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(gpt.GPT(TINY))
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR), accumulation_steps=1)
        mine = sampler()  # num_replicas and rank: the process group's
        allreduces: list[int] = []  # the group of each gradient all-reduce

        def counting_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            allreduces.append(acc._group.index if acc._group is not None else -1)
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        model.register_comm_hook(None, counting_hook)
        loader = DataLoader(documents(), batch_sampler=mine, collate_fn=pad)
        sizes, denominators = [], []
        for group in mine.groups(acc, loader, count=lambda b: (b["labels"] != gpt.IGNORE_INDEX).sum()):
            sizes.append(len(group))
            denominators.append(group.denominator)
            for batch in group:
                with acc.micro_step():
                    total, n = gpt.loss_sum(model, batch)
                    acc.backward(total, count=n)
            acc.step()
        torch.save(
            {
                "replicas": (mine.num_replicas, mine.rank),
                "sizes": sizes,
                "denominators": denominators,
                "allreduces": allreduces,
                "params": {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()},
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
